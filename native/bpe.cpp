// Kernel: bpe. Byte-level BPE encoding of a whole Arrow text column, with the token ids
// HF `tokenizers` gives for a byte-level BPE (GPT-2 split regex, no normalizer), so the
// tokenize stage gets one flat int32 array and its offsets without a Python object per
// document or per token.
//
// Per document: the GPT-2 split regex, hand-written (below), cuts the text into
// pre-tokens; each pre-token is looked up in a cache of pre-token bytes -> ids, and on a
// miss its bytes are merged the way HF's BPE model merges them: repeatedly the adjacent
// pair with the lowest merge rank, the leftmost of equal ranks (HF pops (rank, position)
// from a heap; for short pre-tokens a linear scan finds the same pair faster).
//
// Python (dataprep/tokenizer.py) checks once per tokenizer that its tokenizer.json means
// exactly this algorithm and hands over only the byte ids and the merges; the character
// classes of the regex come from native/bpe_unicode.h, generated from HF itself. A
// document holding a code point whose class may differ between Unicode versions, or
// bytes that are not UTF-8, is declined (listed back to Python, which encodes it with HF).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "arrow_text.h"
#include "bpe_unicode.h"

namespace py = pybind11;

namespace ballast {
namespace {

// ---- character classes of the split regex ----------------------------------------------

enum : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3, kUnsure = 4 };

inline uint8_t char_class(uint32_t cp) {
  const uint8_t packed = bpe_unicode::kBpeBlocks[bpe_unicode::kBpeBlockIndex[cp >> 8]]
                                                [(cp & 0xFF) >> 1];
  return (cp & 1) ? (packed >> 4) : (packed & 0x0F);
}

// ASCII classes without the two-level lookup: most text is mostly ASCII.
struct AsciiClasses {
  uint8_t c[128];
  AsciiClasses() {
    for (uint32_t i = 0; i < 128; ++i) c[i] = char_class(i);
  }
};
const AsciiClasses kAscii;

// One UTF-8 code point at s[i] (i < n): its length in bytes and, via cls, its class (with
// the kUnsure bit). 0 for bytes that are not well-formed UTF-8 (overlong forms,
// surrogates, past U+10FFFF, truncated): HF could not have been given such a string.
inline int next_char(const uint8_t* s, size_t n, size_t i, uint8_t* cls) {
  const uint8_t c = s[i];
  if (c < 0x80) {
    *cls = kAscii.c[c];
    return 1;
  }
  uint32_t cp;
  int len;
  if (c < 0xC2) return 0;
  if (c < 0xE0) {
    if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
    cp = ((c & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu);
    len = 2;
  } else if (c < 0xF0) {
    if (i + 2 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return 0;
    cp = ((c & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
    if (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    len = 3;
  } else if (c < 0xF5) {
    if (i + 3 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 ||
        (s[i + 3] & 0xC0) != 0x80)
      return 0;
    cp = ((c & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) |
         (s[i + 3] & 0x3Fu);
    if (cp < 0x10000 || cp > 0x10FFFF) return 0;
    len = 4;
  } else {
    return 0;
  }
  *cls = char_class(cp);
  return len;
}

// The GPT-2 split regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// as a scanner: at each position the first alternative that matches wins (leftmost, not
// longest) and takes as much as it can, which is how a backtracking engine (Oniguruma in
// HF) runs it. Every character is a letter, a number, whitespace or other, so some
// alternative always matches and the pieces tile the text. Calls emit(begin, end) per
// piece; returns false on invalid UTF-8. `unsure` collects the kUnsure bits seen.
template <class Emit>
bool split_pretokens(const uint8_t* s, size_t n, uint8_t* unsure, Emit&& emit) {
  uint8_t seen = 0;
  size_t i = 0;
  while (i < n) {
    uint8_t cls;
    const int len = next_char(s, n, i, &cls);
    if (len == 0) return false;
    seen |= cls;
    cls &= 3;
    size_t j = i + len;  // after the first character
    const uint8_t c = s[i];
    if (c == '\'' && j < n) {
      // The contractions, case-sensitive; "'sam" gives "'s" + "am" (GPT-2's quirk).
      const uint8_t d = s[j];
      if (d == 's' || d == 't' || d == 'm' || d == 'd') {
        emit(i, j + 1);
        i = j + 1;
        continue;
      }
      if (j + 1 < n && ((d == 'r' && s[j + 1] == 'e') || (d == 'v' && s[j + 1] == 'e') ||
                        (d == 'l' && s[j + 1] == 'l'))) {
        emit(i, j + 2);
        i = j + 2;
        continue;
      }
    }
    uint8_t run = cls;  // the class of the run ` ?X+` takes, if any
    if (c == ' ' && j < n) {
      // " ?" joins the space to a following letter, number or other run; before more
      // whitespace it is left to the whitespace alternatives.
      uint8_t next;
      const int nlen = next_char(s, n, j, &next);
      if (nlen == 0) return false;
      seen |= next;
      next &= 3;
      if (next != kSpace) {
        run = next;
        j += nlen;
      }
    }
    if (run != kSpace) {
      while (j < n) {
        uint8_t k;
        const int klen = next_char(s, n, j, &k);
        if (klen == 0) return false;
        if ((k & 3) != run) break;
        seen |= k;
        j += klen;
      }
      emit(i, j);
      i = j;
      continue;
    }
    // Whitespace: \s+(?!\S) takes the run when it ends the text; before a non-space it
    // backs off one character (leaving that one to start the next piece, where a space
    // joins the word after it); a single whitespace character before a non-space is
    // taken by the last alternative \s+ alone.
    size_t last = i;  // start of the run's last character
    while (j < n) {
      uint8_t k;
      const int klen = next_char(s, n, j, &k);
      if (klen == 0) return false;
      if ((k & 3) != kSpace) break;
      seen |= k;
      last = j;
      j += klen;
    }
    if (j < n && last > i) j = last;
    emit(i, j);
    i = j;
  }
  *unsure = seen & kUnsure;
  return true;
}

// ---- the merges ------------------------------------------------------------------------

constexpr uint32_t kNoRank = UINT32_MAX;

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// (left id, right id) -> (rank, merged id), open addressing. std::unordered_map's node
// per entry and modulo cost more than the whole merge loop on short pre-tokens.
class PairTable {
 public:
  struct Hit {
    uint32_t rank;
    int32_t id;
  };

  void build(const int32_t* merges, size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    mask_ = cap - 1;
    slots_.assign(cap, Slot{kEmpty, kNoRank, -1});
    for (size_t r = 0; r < n; ++r) {
      const uint64_t key = pack(merges[3 * r], merges[3 * r + 1]);
      size_t h = mix64(key) & mask_;
      while (slots_[h].key != kEmpty && slots_[h].key != key) h = (h + 1) & mask_;
      // Python refuses duplicate pairs; keep the first rank anyway.
      if (slots_[h].key == kEmpty) slots_[h] = Slot{key, static_cast<uint32_t>(r), merges[3 * r + 2]};
    }
  }

  Hit find(int32_t a, int32_t b) const {
    const uint64_t key = pack(a, b);
    size_t h = mix64(key) & mask_;
    for (;;) {
      const Slot& s = slots_[h];
      if (s.key == key) return {s.rank, s.id};
      if (s.key == kEmpty) return {kNoRank, -1};
      h = (h + 1) & mask_;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ULL;
  struct Slot {
    uint64_t key;
    uint32_t rank;
    int32_t id;
  };
  static uint64_t pack(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

// Pre-token bytes -> ids. Natural text repeats its words, so most pre-tokens are hits;
// entries are only added for short pre-tokens and the whole cache is dropped when full
// (simpler than an eviction order, and refilling is cheap).
class PieceCache {
 public:
  static constexpr size_t kMaxKey = 64;  // longer pre-tokens are merged every time

  const int32_t* find(const uint8_t* key, size_t len, uint64_t h, uint32_t* count) const {
    if (slots_.empty()) return nullptr;
    size_t i = h & mask_;
    for (;;) {
      const Slot& s = slots_[i];
      if (s.hash == 0) return nullptr;
      if (s.hash == h && s.key_len == len && std::memcmp(keys_.data() + s.key_off, key, len) == 0) {
        *count = s.tok_len;
        return toks_.data() + s.tok_off;
      }
      i = (i + 1) & mask_;
    }
  }

  void insert(const uint8_t* key, size_t len, uint64_t h, const int32_t* ids, size_t count) {
    if (size_ + 1 > (slots_.size() >> 1)) grow();
    size_t i = h & mask_;
    while (slots_[i].hash != 0) i = (i + 1) & mask_;
    slots_[i] = Slot{h, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(len),
                     static_cast<uint32_t>(toks_.size()), static_cast<uint32_t>(count)};
    keys_.insert(keys_.end(), key, key + len);
    toks_.insert(toks_.end(), ids, ids + count);
    ++size_;
  }

  static uint64_t hash(const uint8_t* p, size_t len) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (len * 0xff51afd7ed558ccdULL);
    while (len >= 8) {
      uint64_t w;
      std::memcpy(&w, p, 8);
      h = (h ^ w) * 0x9FB21C651E98DF25ULL;
      h ^= h >> 29;
      p += 8;
      len -= 8;
    }
    if (len) {
      uint64_t w = 0;
      std::memcpy(&w, p, len);
      h = (h ^ w) * 0x9FB21C651E98DF25ULL;
    }
    h = mix64(h);
    return h | 1;  // 0 marks an empty slot
  }

 private:
  // At most 512k entries (half the slots) of <= 64 bytes: about 24 MB of slots plus the
  // keys, per worker process; more than the distinct words of a shard of natural text.
  static constexpr size_t kMaxSlots = size_t{1} << 20;
  struct Slot {
    uint64_t hash;
    uint32_t key_off, key_len, tok_off, tok_len;
  };

  void grow() {
    size_t cap = slots_.empty() ? 4096 : slots_.size() * 2;
    if (cap > kMaxSlots) {  // full: start over
      slots_.assign(kMaxSlots, Slot{0, 0, 0, 0, 0});
      mask_ = kMaxSlots - 1;
      keys_.clear();
      toks_.clear();
      size_ = 0;
      return;
    }
    std::vector<Slot> old(cap, Slot{0, 0, 0, 0, 0});
    old.swap(slots_);
    mask_ = cap - 1;
    for (const Slot& s : old) {
      if (s.hash == 0) continue;
      size_t i = s.hash & mask_;
      while (slots_[i].hash != 0) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
  std::vector<uint8_t> keys_;
  std::vector<int32_t> toks_;
};

class BpeEncoder {
 public:
  // byte_ids: the token id of each byte value (its GPT-2 alphabet character);
  // merges: (left id, right id, merged id) per merge, in rank order.
  BpeEncoder(py::array_t<int32_t, py::array::c_style | py::array::forcecast> byte_ids,
             py::array_t<int32_t, py::array::c_style | py::array::forcecast> merges) {
    if (byte_ids.ndim() != 1 || byte_ids.shape(0) != 256)
      throw std::invalid_argument("bpe: byte_ids must have 256 entries");
    if (merges.ndim() != 2 || merges.shape(1) != 3)
      throw std::invalid_argument("bpe: merges must be an (n, 3) array");
    std::memcpy(byte_ids_, byte_ids.data(), sizeof(byte_ids_));
    pairs_.build(merges.data(), static_cast<size_t>(merges.shape(0)));
  }

  // Encodes every document of the column: (values, offsets, declined). Document i's ids
  // are values[offsets[i]:offsets[i+1]], followed by append_id when it is >= 0. A
  // declined document (listed in `declined`) gets nothing at all, not even append_id:
  // the caller encodes it with HF and splices it in.
  py::tuple encode(const py::tuple& column, int32_t append_id) {
    const TextColumn col(column);
    std::vector<int32_t> values;
    std::vector<int64_t> offsets;
    std::vector<int64_t> declined;
    {
      py::gil_scoped_release release;
      // One encoder may be shared by threads (a thread pool over shards): the cache
      // is not thread-safe, so calls take turns.
      std::lock_guard<std::mutex> lock(mutex_);
      const int64_t n = col.size();
      offsets.reserve(static_cast<size_t>(n) + 1);
      offsets.push_back(0);
      int64_t bytes = 0;
      for (int64_t d = 0; d < n; ++d) bytes += static_cast<int64_t>(col[d].size());
      values.reserve(static_cast<size_t>(bytes / 3 + n + 16));
      for (int64_t d = 0; d < n; ++d) {
        const std::string_view text = col[d];
        const size_t mark = values.size();
        if (!encode_doc(reinterpret_cast<const uint8_t*>(text.data()), text.size(), values)) {
          values.resize(mark);
          declined.push_back(d);
        } else if (append_id >= 0) {
          values.push_back(append_id);
        }
        offsets.push_back(static_cast<int64_t>(values.size()));
      }
    }
    return py::make_tuple(to_numpy(std::move(values)), to_numpy(std::move(offsets)),
                          to_numpy(std::move(declined)));
  }

  // The pre-tokens of one UTF-8 string as (start, end) byte offsets, and whether it holds
  // an UNSURE code point: for tests, next to HF's pre_tokenize_str. None on bad UTF-8.
  py::object split(const py::bytes& text) const {
    const std::string_view s = text;
    py::list out;
    uint8_t unsure = 0;
    const bool ok = split_pretokens(reinterpret_cast<const uint8_t*>(s.data()), s.size(),
                                    &unsure, [&](size_t a, size_t b) {
                                      out.append(py::make_tuple(a, b));
                                    });
    if (!ok) return py::none();
    return py::make_tuple(out, unsure != 0);
  }

 private:
  template <class T>
  static py::array_t<T> to_numpy(std::vector<T>&& v) {
    if (v.empty()) return py::array_t<T>(0);
    // Hand the vector's buffer to numpy instead of copying it (tens of MB per shard).
    auto* owned = new std::vector<T>(std::move(v));
    py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
    return py::array_t<T>(static_cast<py::ssize_t>(owned->size()), owned->data(), owner);
  }

  bool encode_doc(const uint8_t* s, size_t n, std::vector<int32_t>& out) {
    uint8_t unsure = 0;
    const bool ok = split_pretokens(s, n, &unsure, [&](size_t a, size_t b) {
      encode_piece(s + a, b - a, out);
    });
    return ok && !unsure;
  }

  void encode_piece(const uint8_t* p, size_t len, std::vector<int32_t>& out) {
    if (len == 1) {
      out.push_back(byte_ids_[p[0]]);
      return;
    }
    if (len <= PieceCache::kMaxKey) {
      const uint64_t h = PieceCache::hash(p, len);
      uint32_t count;
      if (const int32_t* ids = cache_.find(p, len, h, &count)) {
        out.insert(out.end(), ids, ids + count);
        return;
      }
      const size_t mark = out.size();
      merge(p, len, out);
      cache_.insert(p, len, h, out.data() + mark, out.size() - mark);
      return;
    }
    merge(p, len, out);
  }

  void merge(const uint8_t* p, size_t len, std::vector<int32_t>& out) {
    if (len <= kLinearMax) {
      merge_linear(p, len, out);
    } else {
      merge_heap(p, len, out);
    }
  }

  // Short pre-tokens: rescan for the lowest (rank, position) pair after each merge.
  // O(len^2) but over a few dozen entries in cache, faster than a heap.
  static constexpr size_t kLinearMax = 128;
  void merge_linear(const uint8_t* p, size_t len, std::vector<int32_t>& out) const {
    int32_t ids[kLinearMax];
    uint32_t ranks[kLinearMax];  // ranks[i]: rank of the pair (ids[i], ids[i+1])
    int32_t merged[kLinearMax];  // merged[i]: its merged id
    size_t m = len;
    for (size_t i = 0; i < m; ++i) ids[i] = byte_ids_[p[i]];
    for (size_t i = 0; i + 1 < m; ++i) {
      const auto hit = pairs_.find(ids[i], ids[i + 1]);
      ranks[i] = hit.rank;
      merged[i] = hit.id;
    }
    ranks[m - 1] = kNoRank;
    while (m > 1) {
      size_t best = 0;
      uint32_t best_rank = ranks[0];
      for (size_t i = 1; i + 1 < m; ++i) {
        if (ranks[i] < best_rank) {  // strict: the leftmost of equal ranks wins
          best_rank = ranks[i];
          best = i;
        }
      }
      if (best_rank == kNoRank) break;
      ids[best] = merged[best];
      const size_t tail = m - best - 2;  // entries after best + 1
      std::memmove(ids + best + 1, ids + best + 2, tail * sizeof(int32_t));
      std::memmove(ranks + best + 1, ranks + best + 2, tail * sizeof(uint32_t));
      std::memmove(merged + best + 1, merged + best + 2, tail * sizeof(int32_t));
      --m;
      if (best + 1 < m) {
        const auto hit = pairs_.find(ids[best], ids[best + 1]);
        ranks[best] = hit.rank;
        merged[best] = hit.id;
      } else {
        ranks[best] = kNoRank;
      }
      if (best > 0) {
        const auto hit = pairs_.find(ids[best - 1], ids[best]);
        ranks[best - 1] = hit.rank;
        merged[best - 1] = hit.id;
      }
    }
    out.insert(out.end(), ids, ids + m);
  }

  // Long pre-tokens (a run of spaces, a base64 blob): HF's own scheme, a heap of
  // (rank, position) over a linked list of symbols; stale entries (a side already
  // merged away) are skipped when popped. Same order of merges as merge_linear.
  void merge_heap(const uint8_t* p, size_t len, std::vector<int32_t>& out) const {
    struct Sym {
      int32_t id;
      int32_t prev, next;  // -1 at the ends
      bool alive;
    };
    struct Entry {
      uint32_t rank;
      uint32_t pos;
      int32_t merged;
      bool operator>(const Entry& o) const {
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::vector<Sym> sym(len);
    for (size_t i = 0; i < len; ++i)
      sym[i] = Sym{byte_ids_[p[i]], static_cast<int32_t>(i) - 1,
                   i + 1 < len ? static_cast<int32_t>(i + 1) : -1, true};
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    for (size_t i = 0; i + 1 < len; ++i) {
      const auto hit = pairs_.find(sym[i].id, sym[i + 1].id);
      if (hit.rank != kNoRank) heap.push(Entry{hit.rank, static_cast<uint32_t>(i), hit.id});
    }
    while (!heap.empty()) {
      const Entry top = heap.top();
      heap.pop();
      Sym& left = sym[top.pos];
      if (!left.alive || left.next < 0) continue;
      const Sym& right = sym[left.next];
      const auto hit = pairs_.find(left.id, right.id);
      if (hit.rank != top.rank || hit.id != top.merged) continue;  // stale
      left.id = top.merged;
      const int32_t gone = left.next;
      left.next = right.next;
      sym[gone].alive = false;
      if (left.next >= 0) sym[left.next].prev = static_cast<int32_t>(top.pos);
      if (left.prev >= 0) {
        const auto h = pairs_.find(sym[left.prev].id, left.id);
        if (h.rank != kNoRank) heap.push(Entry{h.rank, static_cast<uint32_t>(left.prev), h.id});
      }
      if (left.next >= 0) {
        const auto h = pairs_.find(left.id, sym[left.next].id);
        if (h.rank != kNoRank) heap.push(Entry{h.rank, top.pos, h.id});
      }
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
  }

  int32_t byte_ids_[256];
  PairTable pairs_;
  PieceCache cache_;
  std::mutex mutex_;
};

// The class table (one byte per code point, as bpe_unicode.h holds it) for the tests to
// compare with HF's own splitting.
py::bytes char_classes() {
  std::string out(0x110000, '\0');
  for (uint32_t cp = 0; cp < 0x110000; ++cp) out[cp] = static_cast<char>(char_class(cp));
  return py::bytes(out);
}

}  // namespace

void register_bpe(py::module_& m) {
  py::class_<BpeEncoder>(m, "BpeEncoder",
                         "Byte-level BPE over Arrow text columns (see native/bpe.cpp).")
      .def(py::init<py::array_t<int32_t, py::array::c_style | py::array::forcecast>,
                    py::array_t<int32_t, py::array::c_style | py::array::forcecast>>(),
           py::arg("byte_ids"), py::arg("merges"))
      .def("encode", &BpeEncoder::encode, py::arg("column"), py::arg("append_id") = -1,
           "(values int32, offsets int64, declined int64) for a text column.")
      .def("split", &BpeEncoder::split, py::arg("text"),
           "Pre-tokens of UTF-8 bytes as (start, end) offsets, and whether any is unsure.");
  m.def("bpe_char_classes", &char_classes,
        "The split regex's class of every code point (0 other, 1 L, 2 N, 3 space, |4 unsure).");
}

}  // namespace ballast
