// UTF-8 text as Python's str methods see it, for the quality kernel (native/quality.cpp):
// code points, Python's whitespace (str.isspace, strip, split), splitlines, and the
// spaCy-English word split through a cache of whitespace-free chunks whose tokens the
// Python reference (dataprep/quality/spacy_en.py) computes once per distinct chunk.
//
// Every Unicode property comes from Python at setup (CodePointSet, filled from the
// tables dataprep/quality/native_chain.py builds with unicodedata and str methods), so
// the native answers follow the same Unicode version as the reference they are tested
// against.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace ballast {

namespace py = pybind11;

// A set of code points as a bitmap over the whole Unicode range (136 KiB).
class CodePointSet {
 public:
  CodePointSet() : bits_((0x110000 + 63) / 64, 0) {}
  explicit CodePointSet(const std::vector<uint32_t>& cps) : CodePointSet() {
    for (uint32_t c : cps) {
      if (c < 0x110000) bits_[c >> 6] |= uint64_t{1} << (c & 63);
    }
  }
  bool has(uint32_t c) const { return c < 0x110000 && (bits_[c >> 6] >> (c & 63)) & 1; }

 private:
  std::vector<uint64_t> bits_;
};

// The code point starting at s[i] (valid UTF-8, as Arrow strings from Python are); i moves
// past it.
inline uint32_t next_cp(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F); };
  uint32_t cp;
  if (b0 < 0xE0) {
    cp = ((b0 & 0x1Fu) << 6) | b(1);
    i += 2;
  } else if (b0 < 0xF0) {
    cp = ((b0 & 0x0Fu) << 12) | (b(1) << 6) | b(2);
    i += 3;
  } else {
    cp = ((b0 & 0x07u) << 18) | (b(1) << 12) | (b(2) << 6) | b(3);
    i += 4;
  }
  return cp;
}

// The code point ending just before s[end]; end moves to its first byte.
inline uint32_t prev_cp(std::string_view s, size_t& end) {
  size_t j = end - 1;
  while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
  size_t k = j;
  const uint32_t cp = next_cp(s, k);
  end = j;
  return cp;
}

// len(str): code points are the bytes that are not UTF-8 continuation bytes.
inline int64_t cp_len(std::string_view s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

struct Tables {
  CodePointSet space;     // str.isspace()
  CodePointSet decimal;   // re's \d (Unicode decimal digits)
  CodePointSet terminal;  // FineWeb's TERMINAL_PUNCTUATION
  CodePointSet no_space;  // scripts written without spaces (segment._SCRIPTS)
};

// Python's ASCII whitespace (\t \n \v \f \r, \x1c-\x1f, space) as a table: one load
// instead of a chain of compares in the loops that test every byte.
struct AsciiSpace {
  bool is[128] = {};
  constexpr AsciiSpace() {
    for (int c : {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x1F, 0x20}) is[c] = true;
  }
};
inline constexpr AsciiSpace kAsciiSpace{};

inline bool ascii_space(unsigned char c) { return kAsciiSpace.is[c & 0x7F]; }

inline bool is_space(const Tables& t, uint32_t cp) {
  if (cp < 0x80) return ascii_space(static_cast<unsigned char>(cp));
  return t.space.has(cp);
}

// Whether the character at s[i] is whitespace; i moves past it. ASCII without decoding.
inline bool space_at(const Tables& t, std::string_view s, size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    ++i;
    return ascii_space(c);
  }
  return t.space.has(next_cp(s, i));
}

// memcmp for the short strings compared here (chunks, tokens), without a call.
inline bool same_bytes(const char* a, const char* b, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x, y;
    std::memcpy(&x, a + i, 8);
    std::memcpy(&y, b + i, 8);
    if (x != y) return false;
  }
  for (; i < n; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// str.strip()
inline std::string_view strip(const Tables& t, std::string_view s) {
  size_t a = 0;
  while (a < s.size()) {
    size_t k = a;
    if (!is_space(t, next_cp(s, k))) break;
    a = k;
  }
  size_t b = s.size();
  while (b > a) {
    size_t k = b;
    if (!is_space(t, prev_cp(s, k))) break;
    b = k;
  }
  return s.substr(a, b - a);
}

inline std::string_view lstrip(const Tables& t, std::string_view s) {
  size_t a = 0;
  while (a < s.size()) {
    size_t k = a;
    if (!is_space(t, next_cp(s, k))) break;
    a = k;
  }
  return s.substr(a);
}

inline std::string_view rstrip(const Tables& t, std::string_view s) {
  size_t b = s.size();
  while (b > 0) {
    size_t k = b;
    if (!is_space(t, prev_cp(s, k))) break;
    b = k;
  }
  return s.substr(0, b);
}

// str.split(): the maximal runs of non-whitespace.
template <class F>
inline void for_each_chunk(const Tables& t, std::string_view s, F&& f) {
  // Two tight loops (skip a whitespace run, then scan a chunk) rather than one loop with
  // a state flag: the branches follow the text's runs, and ASCII needs no decoding.
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  // Whether the character at i is whitespace (wanted == true) or not; moves i past it
  // only when it is what is wanted.
  auto take = [&](bool wanted) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      if (kAsciiSpace.is[c] != wanted) return false;
      ++i;
      return true;
    }
    size_t k = i;
    if (t.space.has(next_cp(s, k)) != wanted) return false;
    i = k;
    return true;
  };
  while (i < n) {
    while (i < n && take(true)) {
    }
    if (i >= n) break;
    const size_t start = i;
    while (i < n && take(false)) {
    }
    f(s.substr(start, i - start));
  }
}

// The maximal runs of whitespace and of non-whitespace of s, in order, as (piece,
// whether it is whitespace): re.split(r"(\s+)") without its empty ends.
template <class F>
inline void for_each_piece(const Tables& t, std::string_view s, F&& f) {
  size_t i = 0;
  while (i < s.size()) {
    const size_t at = i;
    const bool sp = is_space(t, next_cp(s, i));
    size_t j = i;
    while (j < s.size()) {
      size_t k = j;
      if (is_space(t, next_cp(s, k)) != sp) break;
      j = k;
    }
    i = j;
    if (!f(s.substr(at, j - at), sp)) return;
  }
}

// str.splitlines(): \n, \r, \r\n, \v, \f, \x1c-\x1e, \x85, U+2028, U+2029 end a line; a
// final line break does not start an empty line.
template <class F>
inline void for_each_line(std::string_view s, F&& f) {
  // Byte by byte: the ASCII breaks directly, U+0085 as C2 85, U+2028/9 as E2 80 A8/A9.
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0, start = 0;
  while (i < n) {
    const unsigned char c = p[i];
    size_t brk = 0;  // bytes of the line break at i
    if (c < 0x20) {
      if (c == '\r') {
        brk = (i + 1 < n && p[i + 1] == '\n') ? 2 : 1;
      } else if (c == '\n' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E) {
        brk = 1;
      }
    } else if (c == 0xC2) {
      if (i + 1 < n && p[i + 1] == 0x85) brk = 2;
    } else if (c == 0xE2) {
      if (i + 2 < n && p[i + 1] == 0x80 && (p[i + 2] == 0xA8 || p[i + 2] == 0xA9)) brk = 3;
    }
    if (brk) {
      f(s.substr(start, i - start));
      i += brk;
      start = i;
    } else {
      ++i;
    }
  }
  if (start < n) f(s.substr(start));
}

// A fast 64-bit hash of short byte strings (chunks and tokens are a few bytes): 8 bytes
// at a time, mixed by multiplication, finished by splitmix64's finaliser.
inline uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ (s.size() * 0xC2B2AE3D27D4EB4FULL);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 29;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0x94D049BB133111EBULL;
  h ^= h >> 32;
  h *= 0xBF58476D1CE4E5B9ULL;
  return h ^ (h >> 29);
}

// A token's properties, computed by the Python reference when its chunk is first seen.
enum TokenFlag : uint8_t {
  kAlpha = 1,    // str.isalpha()
  kContent = 2,  // isalpha() or strip(SYMBOLS) leaves something: a word, not a symbol
  kHasAlpha = 4, // HAS_ALPHA: holds a letter
  kFinal = 8,       // in spacy_en.SENTENCE_PUNCT: ends a sentence
  kPunctOnly = 16,  // only punctuation: neither ends nor starts a sentence
};

struct Token {
  std::string_view text;
  uint32_t cps;
  uint8_t flags;
  uint64_t hash;
};

// chunk -> its spaCy tokens (as byte lengths, code point lengths and flags) and its
// sentencizer classes ("W", "P", "WP", ...). Filled through the Python resolver on a miss;
// a chunk whose tokens depend on its neighbours (spacy_en._MERGED) is remembered as
// such. An open-addressing table over one key arena: a lookup is one hash, one probe
// sequence and one memcmp, with no allocation.
class ChunkCache {
 public:
  struct Entry {
    uint64_t hash = 0;
    uint64_t key_off = 0;  // the chunk's bytes in keys_
    uint32_t key_len = 0;
    uint32_t first = 0;  // index of its first token in toks_
    uint32_t count = 0;
    uint32_t cls_off = 0;  // its sentencizer classes in classes_
    uint32_t cls_len = 0;
    bool merged = false;
  };
  struct Tok {
    uint32_t bytes;
    uint32_t cps;
    uint8_t flags;
    uint64_t hash;
  };

  ChunkCache(py::function resolver, std::vector<std::string> special, size_t max_entries)
      : resolver_(std::move(resolver)), max_entries_(max_entries) {
    for (auto& s : special) special_.insert(std::move(s));
    clear();
  }

  // The entry of `chunk`, resolved through Python when new. nullptr when the resolver
  // failed to account for the chunk's bytes (a bug the caller reports).
  const Entry* get(std::string_view chunk) { return get(chunk, hash_bytes(chunk)); }

  // A lookup is a chain of dependent loads (slot, entry, key bytes, tokens), each a likely
  // cache miss in a table of millions of chunks. A document's chunks are independent, so
  // the caller issues these prefetches for all of them, stage by stage, before the gets.
  void prefetch_slot(uint64_t h) const { __builtin_prefetch(&slots_[h & mask_]); }
  void prefetch_entry(uint64_t h) const {
    const uint32_t k = slots_[h & mask_];
    if (k != kEmpty) __builtin_prefetch(&entries_[k]);
  }
  void prefetch_data(uint64_t h) const {
    const uint32_t k = slots_[h & mask_];
    if (k == kEmpty) return;
    const Entry& e = entries_[k];
    __builtin_prefetch(keys_.data() + e.key_off);
    if (e.count) __builtin_prefetch(&toks_[e.first]);
  }

  const Entry* get(std::string_view chunk, uint64_t h) {
    size_t i = h & mask_;
    while (slots_[i] != kEmpty) {
      const Entry& e = entries_[slots_[i]];
      if (e.hash == h && e.key_len == chunk.size() &&
          same_bytes(keys_.data() + e.key_off, chunk.data(), chunk.size())) {
        return &e;
      }
      i = (i + 1) & mask_;
    }
    if (entries_.size() >= max_entries_) clear();
    return resolve(chunk, h);
  }

  const Tok& tok(uint32_t i) const { return toks_[i]; }
  // Valid until the next get().
  std::string_view classes(const Entry& e) const { return {classes_.data() + e.cls_off, e.cls_len}; }
  size_t misses() const { return misses_; }

 private:
  static constexpr uint32_t kEmpty = 0xFFFFFFFFu;

  void clear() {
    entries_.clear();
    toks_.clear();
    keys_.clear();
    classes_.clear();
    slots_.assign(1 << 16, kEmpty);
    mask_ = slots_.size() - 1;
  }

  void grow() {
    slots_.assign(slots_.size() * 2, kEmpty);
    mask_ = slots_.size() - 1;
    for (uint32_t k = 0; k < entries_.size(); ++k) place(k);
  }

  void place(uint32_t k) {
    size_t i = entries_[k].hash & mask_;
    while (slots_[i] != kEmpty) i = (i + 1) & mask_;
    slots_[i] = k;
  }

  // ASCII letters only and no special case: one word token, as spacy_en._tokens_of's own
  // shortcut for letters-only chunks decides without the affix rules.
  bool plain_word(std::string_view chunk) const {
    for (char c : chunk) {
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))) return false;
    }
    return special_.find(std::string(chunk)) == special_.end();
  }

  const Entry* resolve(std::string_view chunk, uint64_t h) {
    Entry e;
    e.first = static_cast<uint32_t>(toks_.size());
    if (plain_word(chunk)) {
      const auto n = static_cast<uint32_t>(chunk.size());
      toks_.push_back(Tok{n, n, kAlpha | kContent | kHasAlpha, hash_bytes(chunk)});
      e.count = 1;
      return remember(chunk, h, e, "W");
    }
    ++misses_;
    std::string classes;
    py::object r = resolver_(py::str(chunk.data(), chunk.size()));
    {
      auto t = r.cast<py::tuple>();
      // A _MERGED chunk comes with its tokens before special cases are merged back.
      e.merged = t[4].cast<bool>();
      auto lens = t[0].cast<std::vector<uint32_t>>();
      auto cps = t[1].cast<std::vector<uint32_t>>();
      auto flags = t[2].cast<std::vector<uint8_t>>();
      classes = t[3].cast<std::string>();
      size_t off = 0;
      for (size_t k = 0; k < lens.size(); ++k) {
        toks_.push_back(Tok{lens[k], cps[k], flags[k], hash_bytes(chunk.substr(off, lens[k]))});
        off += lens[k];
      }
      if (off != chunk.size()) return nullptr;
      e.count = static_cast<uint32_t>(lens.size());
    }
    return remember(chunk, h, e, classes);
  }

  const Entry* remember(std::string_view chunk, uint64_t h, Entry e, std::string_view classes) {
    e.hash = h;
    e.cls_off = static_cast<uint32_t>(classes_.size());
    e.cls_len = static_cast<uint32_t>(classes.size());
    classes_.append(classes);
    e.key_off = keys_.size();
    e.key_len = static_cast<uint32_t>(chunk.size());
    keys_.append(chunk);
    entries_.push_back(e);
    const auto k = static_cast<uint32_t>(entries_.size() - 1);
    if (entries_.size() * 2 > slots_.size()) {
      grow();
    } else {
      place(k);
    }
    return &entries_[k];
  }

  py::function resolver_;
  std::unordered_set<std::string> special_;  // spacy_en.SPECIAL's chunks
  size_t max_entries_;
  size_t misses_ = 0;
  std::string keys_;  // every cached chunk's bytes, one after another
  std::string classes_;  // every cached chunk's classes, one after another
  std::vector<Entry> entries_;
  std::vector<Tok> toks_;
  std::vector<uint32_t> slots_;
  size_t mask_ = 0;
};

}  // namespace ballast
