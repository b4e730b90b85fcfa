// Kernel: minhash. Word hashes, word-n-gram shingle sets, MinHash signatures and LSH band
// keys, read from the Arrow text column in place: bit-identical to dataprep/minhash.py's
// *_python functions, which stay the reference (tests/unit/dataprep/test_minhash_native.py
// compares the two).
//
// Lower-casing: Python lower-cases with str.lower(), the full Unicode case mapping, which
// can turn non-ASCII into ASCII (KELVIN SIGN -> 'k') and change lengths ('İ' -> 'i̇').
// CPython applies it one code point at a time, except for GREEK CAPITAL LETTER SIGMA
// (final sigma depends on the neighbours). So Python hands the kernel the mapping of every
// code point that lower() changes, made from the running interpreter (LowerTable: the
// kernel never carries a Unicode version of its own), and lower-cases the rare documents
// that hold a capital sigma itself, handing their bytes over as replacements.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics pass an "undefined" vector that -Wmaybe-uninitialized
// reports at every use (GCC bug 105593, fixed in 13): silence that one false alarm here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include "arrow_text.h"

namespace py = pybind11;

namespace ballast {
namespace {

using u32 = uint32_t;
using u64 = uint64_t;

// The odd multiplier of the polynomial word hash (minhash._P, the FNV prime).
constexpr u64 kP = 0x100000001B3ULL;
constexpr int kMaxNgram = 32;  // NearDedupConfig.ngram's bound; minhash._NGRAM_MULT's size

inline u64 splitmix64(u64 x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// minhash._WORD_BYTE: ASCII letters, digits, '_' and every non-ASCII byte (so non-Latin
// scripts make words without a Unicode tokenizer). kLower: ASCII lower-casing.
struct Tables {
  std::array<bool, 256> word{};
  std::array<unsigned char, 256> lower{};
  std::array<u64, kMaxNgram> ngram_mult{};  // minhash._NGRAM_MULT: splitmix64(k + 1) | 1
  Tables() {
    for (int c = 0; c < 256; ++c) {
      word[c] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '_' || c >= 128;
      lower[c] = static_cast<unsigned char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
    }
    for (int k = 0; k < kMaxNgram; ++k) ngram_mult[k] = splitmix64(static_cast<u64>(k + 1)) | 1;
  }
};
const Tables kTables;

// The lower-case UTF-8 of every code point that str.lower() changes, outside ASCII (ASCII
// is kTables.lower), as the running Python computes it (minhash._lower_table).
class LowerTable {
 public:
  LowerTable(const py::array_t<u32, py::array::c_style | py::array::forcecast>& cps,
             const py::list& lowered) {
    const auto n = static_cast<size_t>(cps.size());
    if (static_cast<size_t>(py::len(lowered)) != n)
      throw std::invalid_argument("minhash: one lowered string per code point");
    u32 top = 0;
    for (size_t k = 0; k < n; ++k) top = std::max(top, cps.data()[k]);
    if (top > 0x10FFFF) throw std::invalid_argument("minhash: code point out of range");
    index_.assign(n ? top + 1 : 0, 0);
    starts_.push_back(0);
    for (size_t k = 0; k < n; ++k) {
      const u32 cp = cps.data()[k];
      if (cp < 0x80) throw std::invalid_argument("minhash: ASCII is lower-cased natively");
      index_[cp] = static_cast<u32>(k + 1);
      data_ += lowered[k].cast<std::string>();
      starts_.push_back(static_cast<u32>(data_.size()));
    }
  }

  // The lower case of cp; empty when lower() leaves it as it is.
  std::string_view map(u32 cp) const {
    if (cp >= index_.size() || index_[cp] == 0) return {};
    const u32 k = index_[cp];
    return std::string_view(data_).substr(starts_[k - 1], starts_[k] - starts_[k - 1]);
  }

  size_t size() const { return starts_.size() - 1; }

 private:
  std::vector<u32> index_;  // code point -> 1 + its entry, 0: unchanged
  std::vector<u32> starts_;
  std::string data_;
};

// The text each document is hashed from: the column's bytes (lower-cased here) or Python's
// replacement (already lower-cased, taken as it is).
struct Docs {
  const TextColumn& col;
  int64_t max_chars;  // < 0: no truncation
  const LowerTable& lower;
  std::vector<int64_t> repl_idx;
  std::vector<std::string_view> repl;

  Docs(const TextColumn& c, int64_t max_chars_, const LowerTable& lower_,
       const py::array_t<int64_t>& idx, const py::list& replacements)
      : col(c), max_chars(max_chars_), lower(lower_) {
    const auto n = static_cast<size_t>(idx.size());
    if (static_cast<size_t>(py::len(replacements)) != n)
      throw std::invalid_argument("minhash: one replacement per replaced document");
    repl_idx.assign(idx.data(), idx.data() + n);
    for (size_t j = 0; j < n; ++j) {
      if (j && repl_idx[j] <= repl_idx[j - 1])
        throw std::invalid_argument("minhash: replaced documents must be in ascending order");
      if (repl_idx[j] < 0 || repl_idx[j] >= col.size())
        throw std::out_of_range("minhash: replaced document out of range");
      // Views into the bytes objects: the list (held by the caller) keeps them alive.
      py::handle b = replacements[j];
      char* p = nullptr;
      Py_ssize_t len = 0;
      if (PyBytes_AsStringAndSize(b.ptr(), &p, &len) != 0) throw py::error_already_set();
      repl.emplace_back(p, static_cast<size_t>(len));
    }
  }
};

inline bool all_ascii(std::string_view s) {
  // Eight bytes at a time: the high bit of any byte marks non-ASCII.
  const char* p = s.data();
  size_t n = s.size(), i = 0;
  u64 acc = 0;
  for (; i + 8 <= n; i += 8) {
    u64 w;
    std::memcpy(&w, p + i, 8);
    acc |= w;
  }
  for (; i < n; ++i) acc |= static_cast<unsigned char>(p[i]);
  return (acc & 0x8080808080808080ULL) == 0;
}

// The first max_chars bytes; for an ASCII text these are its first max_chars characters.
inline std::string_view prefix(std::string_view s, int64_t max_chars) {
  if (max_chars >= 0 && static_cast<int64_t>(s.size()) > max_chars)
    return s.substr(0, static_cast<size_t>(max_chars));
  return s;
}

// Whether lower() of this text needs Python: it holds U+03A3 GREEK CAPITAL LETTER SIGMA
// (UTF-8 CE A3), which lower() maps by context. Anywhere in the text, not only in the
// first max_chars characters: the Python path is exact for every text, so sending it a
// few more costs only time.
inline bool needs_python(std::string_view s) {
  return !all_ascii(s) && s.find("\xCE\xA3") != std::string_view::npos;
}

// str.lower() of the first max_chars characters (all if < 0) of the UTF-8 text s, as
// UTF-8, into out; false if s is not valid UTF-8 or holds a capital sigma.
bool lower_utf8(std::string_view s, int64_t max_chars, const LowerTable& table,
                std::string& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  const auto& lower = kTables.lower;
  out.clear();
  out.reserve(n + n / 2);
  int64_t chars = 0;
  size_t i = 0;
  while (i < n && (max_chars < 0 || chars < max_chars)) {
    const unsigned char c = p[i];
    ++chars;
    if (c < 0x80) {
      out.push_back(static_cast<char>(lower[c]));
      ++i;
      continue;
    }
    // Decode one code point, rejecting what CPython's UTF-8 decoder rejects: stray
    // continuation bytes, overlong forms, surrogates, beyond U+10FFFF, truncation.
    size_t len;
    u32 cp, min;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000) || cp == 0x3A3) return false;
    const std::string_view m = table.map(cp);
    if (m.empty()) {
      out.append(s.data() + i, len);
    } else {
      out.append(m.data(), m.size());
    }
    i += len;
  }
  return true;
}

// P**k mod 2**64 for the first kPowers bytes of a word: with the power looked up rather
// than carried along, a word's bytes are independent multiplies, not one multiply chain.
constexpr size_t kPowers = 64;
struct Powers {
  std::array<u64, kPowers> p{};
  Powers() {
    u64 x = 1;
    for (auto& v : p) v = x, x *= kP;
  }
};
const Powers kPow;

// Appends the hash of every word of `s` to `out`. A word's hash is
// splitmix64(sum_k (byte_k + 1) * P**k ^ length) mod 2**64, what minhash.word_hashes gets
// from its prefix sums once the P**-start factor has cancelled the word's position.
template <bool kLowerCase>
void hash_words(std::string_view s, std::vector<u64>& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  const auto& word = kTables.word;
  const auto& lower = kTables.lower;
  const u64* pw = kPow.p.data();
  size_t i = 0;
  while (i < n) {
    while (i < n && !word[p[i]]) ++i;
    if (i == n) break;
    const size_t start = i;
    u64 h = 0;
    for (; i < n && i - start < kPowers && word[p[i]]; ++i) {
      const u64 c = kLowerCase ? lower[p[i]] : p[i];
      h += (c + 1) * pw[i - start];
    }
    if (i < n && word[p[i]]) {  // a word longer than the table: carry the power along
      u64 pk = pw[kPowers - 1] * kP;
      for (; i < n && word[p[i]]; ++i) {
        const u64 c = kLowerCase ? lower[p[i]] : p[i];
        h += (c + 1) * pk;
        pk *= kP;
      }
    }
    out.push_back(splitmix64(h ^ static_cast<u64>(i - start)));
  }
}

// The word hashes of document i (appended to `out`), from the column or its replacement;
// `next_repl` walks the ascending replacement list along with i; `scratch` holds a
// non-ASCII document's lower case.
void doc_words(const Docs& docs, int64_t i, size_t& next_repl, std::string& scratch,
               std::vector<u64>& out) {
  if (next_repl < docs.repl_idx.size() && docs.repl_idx[next_repl] == i) {
    hash_words<false>(docs.repl[next_repl++], out);
    return;
  }
  const std::string_view s = docs.col[i];
  const std::string_view head = prefix(s, docs.max_chars);
  if (all_ascii(head)) {
    hash_words<true>(head, out);
    return;
  }
  if (!lower_utf8(s, docs.max_chars, docs.lower, scratch))
    throw std::invalid_argument(
        "minhash: document " + std::to_string(i) +
        " is not valid UTF-8 or needs Python's lower() (capital sigma) and has no replacement");
  hash_words<false>(scratch, out);
}

// Sorts u32 keys: LSD radix sort, 8 bits a pass, from 64 keys up (most documents: random
// hashes make std::sort mispredict a branch per compare; from 64 up the radix sort's four
// 256-bucket passes cost less, ~15% of the whole shingling on the scale corpus when the
// cut-off was 256), std::sort for the smaller sets.
void sort_u32(u32* v, size_t n, std::vector<u32>& tmp) {
  if (n < 64) {
    std::sort(v, v + n);
    return;
  }
  size_t count[4][256] = {};
  for (size_t i = 0; i < n; ++i) {
    const u32 x = v[i];
    ++count[0][x & 0xFF];
    ++count[1][(x >> 8) & 0xFF];
    ++count[2][(x >> 16) & 0xFF];
    ++count[3][x >> 24];
  }
  tmp.resize(n);
  u32* src = v;
  u32* dst = tmp.data();
  for (int pass = 0; pass < 4; ++pass) {
    size_t sum = 0;
    for (auto& c : count[pass]) {
      const size_t k = c;
      c = sum;
      sum += k;
    }
    const int shift = 8 * pass;
    for (size_t i = 0; i < n; ++i) dst[count[pass][(src[i] >> shift) & 0xFF]++] = src[i];
    std::swap(src, dst);
  }
  // Four passes: the sorted keys are back in v.
}

// The shingles of one document's words, appended to `out` sorted and unique: the n-gram at
// i is splitmix64(sum_k w[i+k] * C_k) >> 32; fewer words than ngram make one shingle of
// all of them; no words, none (minhash.shingle_hashes). `acc` and `tmp` are scratch.
void doc_shingles(const u64* w, size_t n_words, int ngram, std::vector<u32>& out,
                  std::vector<u64>& acc, std::vector<u32>& tmp) {
  if (n_words == 0) return;
  const u64* mult = kTables.ngram_mult.data();
  const size_t first = out.size();
  const size_t k_max = std::min(n_words, static_cast<size_t>(ngram));
  const size_t n_sh = n_words >= static_cast<size_t>(ngram) ? n_words - ngram + 1 : 1;
  // One multiply-add per word and n-gram position, position by position (as the numpy
  // code): independent multiplies across i, no dependency chain through k.
  acc.assign(n_sh, 0);
  u64* g = acc.data();
  for (size_t k = 0; k < k_max; ++k) {
    const u64 m = mult[k];
    const u64* src = w + k;
    for (size_t i = 0; i < n_sh; ++i) g[i] += src[i] * m;
  }
  out.resize(first + n_sh);
  u32* dst = out.data() + first;
  for (size_t i = 0; i < n_sh; ++i) dst[i] = static_cast<u32>(splitmix64(g[i]) >> 32);
  sort_u32(dst, n_sh, tmp);
  out.resize(first + static_cast<size_t>(std::unique(dst, dst + n_sh) - dst));
}

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

// ---- the Python entry points ----------------------------------------------------------

// Documents whose lower case Python must make (a capital sigma): the replacements.
py::array_t<int64_t> needs_python_docs(const py::tuple& column) {
  const TextColumn col(column);
  std::vector<int64_t> out;
  {
    py::gil_scoped_release nogil;
    for (int64_t i = 0; i < col.size(); ++i)
      if (needs_python(col[i])) out.push_back(i);
  }
  return to_numpy(out);
}

// The lower case the kernel hashes document i from (tests compare it with str.lower()).
py::bytes lowered(const py::tuple& column, int64_t i, int64_t max_chars, const LowerTable& t) {
  const TextColumn col(column);
  if (i < 0 || i >= col.size()) throw std::out_of_range("minhash: document out of range");
  const std::string_view s = col[i];
  const std::string_view head = prefix(s, max_chars);
  std::string out;
  if (all_ascii(head)) {
    for (const char c : head) out.push_back(static_cast<char>(kTables.lower[static_cast<unsigned char>(c)]));
  } else if (!lower_utf8(s, max_chars, t, out)) {
    return py::bytes();
  }
  return py::bytes(out);
}

py::tuple word_hashes(const py::tuple& column, int64_t max_chars, const LowerTable& table,
                      const py::array_t<int64_t>& repl_idx, const py::list& repl) {
  const TextColumn col(column);
  const Docs docs(col, max_chars, table, repl_idx, repl);
  std::vector<u64> hashes;
  std::vector<int64_t> offsets(static_cast<size_t>(col.size()) + 1, 0);
  {
    py::gil_scoped_release nogil;
    size_t next_repl = 0;
    std::string scratch;
    for (int64_t i = 0; i < col.size(); ++i) {
      doc_words(docs, i, next_repl, scratch, hashes);
      offsets[i + 1] = static_cast<int64_t>(hashes.size());
    }
  }
  return py::make_tuple(to_numpy(hashes), to_numpy(offsets));
}

py::tuple shingle_hashes(const py::tuple& column, int ngram, int64_t max_chars,
                         const LowerTable& table, const py::array_t<int64_t>& repl_idx,
                         const py::list& repl) {
  if (ngram < 1 || ngram > kMaxNgram) throw std::invalid_argument("minhash: ngram in 1..32");
  const TextColumn col(column);
  const Docs docs(col, max_chars, table, repl_idx, repl);
  std::vector<u32> shingles;
  std::vector<int64_t> offsets(static_cast<size_t>(col.size()) + 1, 0);
  {
    py::gil_scoped_release nogil;
    std::vector<u64> words, acc;  // one document's, reused
    std::vector<u32> tmp;
    std::string scratch;
    size_t next_repl = 0;
    for (int64_t i = 0; i < col.size(); ++i) {
      words.clear();
      doc_words(docs, i, next_repl, scratch, words);
      doc_shingles(words.data(), words.size(), ngram, shingles, acc, tmp);
      offsets[i + 1] = static_cast<int64_t>(shingles.size());
    }
  }
  return py::make_tuple(to_numpy(shingles), to_numpy(offsets));
}

// ---- signatures -----------------------------------------------------------------------
//
// sig[d, p] = min over the document's shingles x of ((a_p * x + b_p) mod 2**64) >> 32, all
// ones for a document without shingles (minhash.signatures). Two facts make it cheap:
// - x < 2**32, so a_p * x = lo(a_p) * x + (hi(a_p) * x << 32): two 32x32->64 multiplies,
//   which every SIMD level has (a 64x64 multiply is AVX-512DQ only, and slower);
// - the min commutes with >> 32, so only the high halves are compared: a 32-bit unsigned
//   min (AVX2 has no 64-bit one), on the odd 32-bit lanes of the 64-bit products.
// Permutations go in blocks of kBlock, so a block's minima stay in registers while the
// document's shingles stream by.
constexpr int kBlock = 32;

struct Perms {
  // lo(a), hi(a), b, padded to a whole number of blocks (the padding lanes are dropped).
  std::vector<u64> a_lo, a_hi, b;
  int num_perm = 0, padded = 0;
  Perms(const u64* a, const u64* b_, int n) : num_perm(n) {
    padded = (n + kBlock - 1) / kBlock * kBlock;
    a_lo.assign(padded, 0);
    a_hi.assign(padded, 0);
    b.assign(padded, 0);
    for (int p = 0; p < n; ++p) {
      a_lo[p] = a[p] & 0xFFFFFFFFULL;
      a_hi[p] = a[p] >> 32;
      b[p] = b_[p];
    }
  }
};

using SigFn = void (*)(const u32*, const int64_t*, int64_t, const Perms&, u32*);

void sig_scalar(const u32* shingles, const int64_t* offsets, int64_t n_docs, const Perms& perms,
                u32* sig) {
  for (int64_t d = 0; d < n_docs; ++d) {
    u32* row = sig + d * perms.num_perm;
    for (int pb = 0; pb < perms.padded; pb += kBlock) {
      // 64-bit minima here: baseline x86-64 (SSE2) has no 32-bit unsigned min either, and
      // the compiler vectorises this form best.
      u64 mn[kBlock];
      for (auto& v : mn) v = ~0ULL;
      const u64* al = perms.a_lo.data() + pb;
      const u64* ah = perms.a_hi.data() + pb;
      const u64* bb = perms.b.data() + pb;
      for (int64_t s = offsets[d]; s < offsets[d + 1]; ++s) {
        const u64 x = shingles[s];
        for (int j = 0; j < kBlock; ++j) {
          const u64 v = al[j] * x + ((ah[j] * x) << 32) + bb[j];
          mn[j] = v < mn[j] ? v : mn[j];
        }
      }
      const int end = std::min(kBlock, perms.num_perm - pb);
      for (int j = 0; j < end; ++j) row[pb + j] = static_cast<u32>(mn[j] >> 32);
    }
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BALLAST_MINHASH_X86 1

// The SIMD levels: the same arithmetic, W 64-bit lanes at a time. The low 32-bit lane of
// each pair takes part in the min too but is never read (the padding's start at ~0 too).
__attribute__((target("avx2"))) void sig_avx2(const u32* shingles, const int64_t* offsets,
                                               int64_t n_docs, const Perms& perms, u32* sig) {
  constexpr int W = 4, R = kBlock / W;
  for (int64_t d = 0; d < n_docs; ++d) {
    u32* row = sig + d * perms.num_perm;
    for (int pb = 0; pb < perms.padded; pb += kBlock) {
      __m256i mn[R];
      for (auto& v : mn) v = _mm256_set1_epi32(-1);
      const auto* al = reinterpret_cast<const __m256i*>(perms.a_lo.data() + pb);
      const auto* ah = reinterpret_cast<const __m256i*>(perms.a_hi.data() + pb);
      const auto* bb = reinterpret_cast<const __m256i*>(perms.b.data() + pb);
      for (int64_t s = offsets[d]; s < offsets[d + 1]; ++s) {
        const __m256i x = _mm256_set1_epi64x(static_cast<long long>(shingles[s]));
        for (int r = 0; r < R; ++r) {
          __m256i v = _mm256_add_epi64(_mm256_mul_epu32(_mm256_loadu_si256(al + r), x),
                                       _mm256_loadu_si256(bb + r));
          v = _mm256_add_epi64(v, _mm256_slli_epi64(
                                      _mm256_mul_epu32(_mm256_loadu_si256(ah + r), x), 32));
          mn[r] = _mm256_min_epu32(mn[r], v);
        }
      }
      alignas(32) u64 out[kBlock];
      for (int r = 0; r < R; ++r) _mm256_store_si256(reinterpret_cast<__m256i*>(out) + r, mn[r]);
      const int end = std::min(kBlock, perms.num_perm - pb);
      for (int j = 0; j < end; ++j) row[pb + j] = static_cast<u32>(out[j] >> 32);
    }
  }
}

__attribute__((target("avx512f"))) void sig_avx512(const u32* shingles, const int64_t* offsets,
                                                   int64_t n_docs, const Perms& perms,
                                                   u32* sig) {
  constexpr int W = 8, R = kBlock / W;
  for (int64_t d = 0; d < n_docs; ++d) {
    u32* row = sig + d * perms.num_perm;
    for (int pb = 0; pb < perms.padded; pb += kBlock) {
      __m512i mn[R];
      for (auto& v : mn) v = _mm512_set1_epi32(-1);
      const u64* al = perms.a_lo.data() + pb;
      const u64* ah = perms.a_hi.data() + pb;
      const u64* bb = perms.b.data() + pb;
      for (int64_t s = offsets[d]; s < offsets[d + 1]; ++s) {
        const __m512i x = _mm512_set1_epi64(static_cast<long long>(shingles[s]));
        for (int r = 0; r < R; ++r) {
          __m512i v = _mm512_add_epi64(_mm512_mul_epu32(_mm512_loadu_si512(al + W * r), x),
                                       _mm512_loadu_si512(bb + W * r));
          v = _mm512_add_epi64(
              v, _mm512_slli_epi64(_mm512_mul_epu32(_mm512_loadu_si512(ah + W * r), x), 32));
          mn[r] = _mm512_min_epu32(mn[r], v);
        }
      }
      alignas(64) u64 out[kBlock];
      for (int r = 0; r < R; ++r) _mm512_store_si512(out + W * r, mn[r]);
      const int end = std::min(kBlock, perms.num_perm - pb);
      for (int j = 0; j < end; ++j) row[pb + j] = static_cast<u32>(out[j] >> 32);
    }
  }
}
#endif

// Instruction-set levels: 0 scalar (baseline), 1 AVX2, 2 AVX-512. All give the same bits.
int best_level() {
#ifdef BALLAST_MINHASH_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2")) return 1;
#endif
  return 0;
}

SigFn sig_fn(int level) {
#ifdef BALLAST_MINHASH_X86
  if (level >= 2) return sig_avx512;
  if (level == 1) return sig_avx2;
#endif
  return sig_scalar;
}

py::array_t<u32> signatures(const py::array_t<u32, py::array::c_style | py::array::forcecast>& sh,
                            const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& off,
                            const py::array_t<u64, py::array::c_style | py::array::forcecast>& a,
                            const py::array_t<u64, py::array::c_style | py::array::forcecast>& b,
                            int level) {
  if (a.ndim() != 1 || b.ndim() != 1 || a.size() != b.size() || a.size() == 0)
    throw std::invalid_argument("minhash: a and b must be equal-length 1-d arrays");
  if (off.ndim() != 1 || off.size() < 1) throw std::invalid_argument("minhash: bad offsets");
  const int64_t n_docs = off.size() - 1;
  const int64_t* o = off.data();
  for (int64_t d = 0; d < n_docs; ++d)
    if (o[d] < 0 || o[d + 1] < o[d] || o[d + 1] > sh.size())
      throw std::invalid_argument("minhash: offsets must ascend within the shingles");
  const int best = best_level();
  if (level < 0 || level > best) level = best;
  const Perms perms(a.data(), b.data(), static_cast<int>(a.size()));
  py::array_t<u32> out({n_docs, static_cast<int64_t>(perms.num_perm)});
  {
    py::gil_scoped_release nogil;
    sig_fn(level)(sh.data(), o, n_docs, perms, out.mutable_data());
  }
  return out;
}

// (n_docs, bands) keys: acc = splitmix64(acc ^ sig[d, j*rows + k]) over a band's rows.
py::array_t<u64> band_keys(const py::array_t<u32, py::array::c_style | py::array::forcecast>& sig,
                           int bands, int rows) {
  if (sig.ndim() != 2) throw std::invalid_argument("minhash: signatures must be 2-d");
  const int64_t n = sig.shape(0), np_ = sig.shape(1);
  if (bands < 0 || rows < 0 || static_cast<int64_t>(bands) * rows > np_)
    throw std::invalid_argument("minhash: bands * rows exceeds the permutations");
  py::array_t<u64> out({n, static_cast<int64_t>(bands)});
  const u32* s = sig.data();
  u64* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    for (int64_t d = 0; d < n; ++d) {
      const u32* row = s + d * np_;
      for (int j = 0; j < bands; ++j) {
        u64 acc = 0;
        for (int k = 0; k < rows; ++k) acc = splitmix64(acc ^ row[j * rows + k]);
        dst[d * bands + j] = acc;
      }
    }
  }
  return out;
}

}  // namespace

void register_minhash(py::module_& m) {
  py::class_<LowerTable>(m, "MinhashLowerTable",
                         "str.lower() of every non-ASCII code point it changes.")
      .def(py::init<const py::array_t<u32, py::array::c_style | py::array::forcecast>&,
                    const py::list&>(),
           py::arg("code_points"), py::arg("lowered"))
      .def("__len__", &LowerTable::size);
  m.def("minhash_needs_python", &needs_python_docs, py::arg("column"),
        "Indices of the documents whose lower case Python must make (capital sigma).");
  m.def("minhash_lowered", &lowered, py::arg("column"), py::arg("i"), py::arg("max_chars"),
        py::arg("table"), "The lower-case UTF-8 the kernel hashes document i from.");
  m.def("minhash_word_hashes", &word_hashes, py::arg("column"), py::arg("max_chars"),
        py::arg("table"), py::arg("repl_idx"), py::arg("repl"),
        "(hashes uint64, offsets int64) as minhash.word_hashes_python.");
  m.def("minhash_shingle_hashes", &shingle_hashes, py::arg("column"), py::arg("ngram"),
        py::arg("max_chars"), py::arg("table"), py::arg("repl_idx"), py::arg("repl"),
        "(shingles uint32, offsets int64) as minhash.shingle_hashes_python.");
  m.def("minhash_signatures", &signatures, py::arg("shingles"), py::arg("offsets"), py::arg("a"),
        py::arg("b"), py::arg("level") = -1,
        "(n_docs, num_perm) uint32 as minhash.signatures_python; level: instruction set "
        "(0 scalar, 1 AVX2, 2 AVX-512, -1 the best this CPU has).");
  m.def("minhash_band_keys", &band_keys, py::arg("sig"), py::arg("bands"), py::arg("rows"),
        "(n_docs, bands) uint64 as minhash.band_keys_python.");
  m.def("minhash_simd_level", &best_level, "The best instruction-set level this CPU runs.");
}

}  // namespace ballast
