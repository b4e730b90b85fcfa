// Kernel: the counters of the web quality chain (char_repetition, length, gopher_quality,
// gopher_repetition, c4, fineweb) for a whole text column in one pass, without a Python
// object per document.
//
// The kernel measures; it does not judge. For each rule of the chain, in chain order, it
// writes integer counters per document (words, duplicate line characters, the top
// n-gram's count, ...), runs C4's line cleaning (whose output the rules after it see) and
// returns the cleaned texts. dataprep/quality/native_chain.py turns the counters into the
// same decisions, drop reasons, details and statistics as the Python rules, with the same
// integer-over-integer divisions, so the thresholds are compared in one place only.
//
// English words are spaCy's (dataprep/quality/spacy_en.py): a whitespace-free chunk's
// tokens come from a cache the Python reference fills once per distinct chunk, and the
// few chunks whose tokens depend on their neighbours (special cases spelt across affix
// splits, spacy_en._MERGED) are merged in context here, as the reference does. A
// document the kernel cannot measure exactly is marked for the Python path: text in a
// script written without spaces (words come from ICU there) and the two characters whose
// lower case holds ASCII letters (U+0130, U+212A; C4 matches lower-cased phrases).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <array>
#include <cstring>
#include <deque>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "arrow_text.h"
#include "quality_text.h"
#include "quality_words.h"

namespace py = pybind11;

namespace ballast {
namespace {

uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Open addressing over 64-bit keys (n-gram hashes): count and first position per key.
class NGramTable {
 public:
  void reset(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 2) cap <<= 1;
    if (keys_.size() < cap || keys_.size() > 4 * cap) {
      keys_.assign(cap, 0);
      counts_.assign(cap, 0);
      firsts_.assign(cap, 0);
    } else {
      cap = keys_.size();
      std::fill(keys_.begin(), keys_.end(), 0);
    }
    mask_ = cap - 1;
  }
  // Returns the slot of `key` (0 is reserved as empty: remapped to 1).
  size_t slot(uint64_t key, bool& fresh) {
    if (key == 0) key = 1;
    size_t i = mix64(key) & mask_;
    while (keys_[i] != 0 && keys_[i] != key) i = (i + 1) & mask_;
    fresh = keys_[i] == 0;
    if (fresh) keys_[i] = key;
    return i;
  }
  std::vector<uint64_t> keys_;
  std::vector<int64_t> counts_;
  std::vector<int64_t> firsts_;

 private:
  size_t mask_ = 0;
};

// dup_count_and_chars: items that repeat an earlier one, and their code points. An
// open-addressing set of (hash, item) reused across documents: no allocation per item.
class DupCounter {
 public:
  std::pair<int64_t, int64_t> count(const std::vector<std::string_view>& items) {
    size_t cap = 16;
    while (cap < 2 * items.size() + 2) cap <<= 1;
    hashes_.assign(cap, 0);
    views_.resize(cap);
    const size_t mask = cap - 1;
    int64_t n = 0, chars = 0;
    for (auto s : items) {
      uint64_t h = hash_bytes(s);
      if (h == 0) h = 1;  // 0 marks an empty slot
      size_t i = h & mask;
      bool dup = false;
      while (hashes_[i] != 0) {
        if (hashes_[i] == h && views_[i].size() == s.size() &&
            same_bytes(views_[i].data(), s.data(), s.size())) {
          dup = true;
          break;
        }
        i = (i + 1) & mask;
      }
      if (dup) {
        ++n;
        chars += cp_len(s);
      } else {
        hashes_[i] = h;
        views_[i] = s;
      }
    }
    return {n, chars};
  }

 private:
  std::vector<uint64_t> hashes_;
  std::vector<std::string_view> views_;
};

bool starts_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// str.count(p): non-overlapping occurrences.
int64_t count_sub(std::string_view s, std::string_view p) {
  int64_t n = 0;
  size_t i = 0;
  while ((i = s.find(p, i)) != std::string_view::npos) {
    ++n;
    i += p.size();
  }
  return n;
}

enum class Kind { kCharRepetition, kLength, kGopherQuality, kGopherRepetition, kC4, kFineWeb };

struct RuleSpec {
  Kind kind;
  std::string prefix;  // counters are named "<position>.<name>"
  // char_repetition
  int64_t max_run = -1;  // -1: off
  // length
  bool count_words = false;
  // gopher_quality
  std::vector<std::string> stop_words;
  std::vector<uint64_t> stop_hashes;  // hash_bytes of each, compared before the bytes
  uint64_t stop_filter = 0;           // bit (hash & 63) set for each stop word's hash
  // gopher_repetition
  std::vector<int64_t> top_n, dup_n;
  // c4
  bool remove_citations = true, filter_no_terminal_punct = true, filter_lorem_ipsum = true,
       filter_javascript = true, filter_curly_bracket = true, filter_policy = true,
       count_sentences = true;
  int64_t min_words_per_line = 0, max_word_length = -1;
  // fineweb
  int64_t short_line_length = 30;
  double new_line_ratio = -1;  // -1: off
  // Counter names built from n ("top2_count"), made once so their addresses are stable.
  std::map<std::string, std::string> names;
  // Chain::set's cache: counter name address -> its column (for the current run).
  mutable std::vector<std::pair<const char*, std::vector<int64_t>*>> cols;
};

const char* const kPolicy[] = {"terms of use", "privacy policy", "cookie policy",
                               "uses cookies", "use of cookies", "use cookies"};

// Counters of one rule for every document, by name; -1 marks "not measured".
using Columns = std::map<std::string, std::vector<int64_t>>;

class Fallback : public std::exception {};

// One document's state while the chain runs over it.
struct DocState {
  std::string_view text;
  std::string owned;  // C4's cleaned text, once it edits
  bool words_ready = false;
  std::vector<Token> words;
  bool script_checked = false;

  void reset(std::string_view t) {
    text = t;
    owned.clear();
    words_ready = false;
    words.clear();
    script_checked = false;
  }
};

class Chain {
 public:
  Chain(Tables tables, py::function resolver, std::vector<std::string> special,
        const py::list& matcher, size_t run_max, std::vector<RuleSpec> rules, size_t cache_max)
      : t_(std::move(tables)),
        words_(t_, std::move(resolver), std::move(special), matcher, run_max, cache_max),
        rules_(std::move(rules)) {}

  py::dict run(const py::tuple& column) {
    const TextColumn col(column);
    const int64_t n = col.size();
    cols_.clear();
    for (const auto& r : rules_) r.cols.clear();
    std::vector<uint8_t> fallback(n, 0);
    std::vector<int64_t> edited_off{0};
    std::string edited_bytes;
    std::vector<uint8_t> edited(n, 0);
    excerpts_.clear();
    doc_count_ = n;
    // One DocState for the whole column, reset per document: its words vector keeps its
    // capacity (a fresh one grew by reallocation in every document: 6% of the kernel).
    DocState d;
    for (int64_t i = 0; i < n; ++i) {
      row_ = i;
      d.reset(col[i]);
      words_.forget();
      try {
        check_characters(d.text);
        for (size_t r = 0; r < rules_.size(); ++r) apply(rules_[r], d);
      } catch (const Fallback&) {
        fallback[i] = 1;
      }
      if (!fallback[i] && !d.owned.empty() && d.text.data() == d.owned.data()) {
        edited[i] = 1;
        edited_bytes.append(d.owned);
      }
      edited_off.push_back(static_cast<int64_t>(edited_bytes.size()));
    }
    py::dict out;
    for (auto& [name, v] : cols_) out[py::str(name)] = py::array_t<int64_t>(v.size(), v.data());
    out["fallback"] = py::array_t<uint8_t>(fallback.size(), fallback.data());
    out["edited"] = py::array_t<uint8_t>(edited.size(), edited.data());
    out["edited_offsets"] = py::array_t<int64_t>(edited_off.size(), edited_off.data());
    out["edited_bytes"] = py::bytes(edited_bytes);
    py::list ex;
    for (auto& s : excerpts_) ex.append(py::str(s.data(), s.size()));
    out["excerpts"] = ex;
    out["cache_misses"] = words_.misses();
    out["doc_resolves"] = words_.in_context();
    return out;
  }

 private:
  // One counter of the current document. The column is found by the name's address (the
  // names are literals or strings owned by the rule), so no string is built per call.
  void set(const RuleSpec& r, const char* name, int64_t v) {
    for (auto& [n, col] : r.cols) {
      if (n == name) {
        (*col)[row_] = v;
        return;
      }
    }
    auto& c = cols_[r.prefix + name];
    if (c.empty()) c.assign(doc_count_, -1);
    r.cols.emplace_back(name, &c);
    c[row_] = v;
  }

  // Characters that the kernel leaves to Python, anywhere in the document.
  static void check_characters(std::string_view s) {
    // U+0130 is C4 B0, U+212A is E2 84 AA.
    if (s.find("\xC4\xB0") != std::string_view::npos) throw Fallback();
    if (s.find("\xE2\x84\xAA") != std::string_view::npos) throw Fallback();
  }

  // Words and sentences follow the English rules only where segment.script_language sees
  // no script written without spaces in the first 2,000 characters.
  void check_script(DocState& d) {
    if (d.script_checked) return;
    d.script_checked = true;
    size_t i = 0;
    int k = 0;
    while (i < d.text.size() && k < 2000) {
      const uint32_t cp = next_cp(d.text, i);
      if (cp >= 0x80 && t_.no_space.has(cp)) throw Fallback();
      ++k;
    }
  }

  // str.split()'s length: the words' split has the chunks of the text it split (an
  // earlier rule's, when C4 left the text as it was), else one pass counts them.
  int64_t chunk_count(std::string_view text) {
    const int64_t known = words_.chunk_count(text);
    if (known >= 0) return known;
    int64_t n = 0;
    for_each_chunk(t_, text, [&](std::string_view) { ++n; });
    return n;
  }

  const std::vector<Token>& words(DocState& d) {
    if (d.words_ready) return d.words;
    check_script(d);
    words_.split(d.text, d.words);
    d.words_ready = true;
    return d.words;
  }

  void apply(const RuleSpec& r, DocState& d) {
    switch (r.kind) {
      case Kind::kCharRepetition: return char_repetition(r, d);
      case Kind::kLength: return length(r, d);
      case Kind::kGopherQuality: return gopher_quality(r, d);
      case Kind::kGopherRepetition: return gopher_repetition(r, d);
      case Kind::kC4: return c4(r, d);
      case Kind::kFineWeb: return fineweb(r, d);
    }
  }

  void char_repetition(const RuleSpec& r, DocState& d) {
    const std::string_view s = d.text;
    auto& cps = cps_;
    cps.resize(s.size());
    size_t len = 0;
    int64_t n_chars = 0;
    for (size_t i = 0; i < s.size();) {
      const uint32_t c = next_cp(s, i);
      cps[len++] = c;
      n_chars += !is_space(t_, c);
    }
    cps.resize(len);
    // The first run of one non-space character longer than max_run (simple._long_run).
    int64_t run_len = 0, run_cp = 0;
    if (r.max_run >= 0) {
      size_t i = 0;
      while (i < len) {
        size_t j = i + 1;
        while (j < len && cps[j] == cps[i]) ++j;
        if (static_cast<int64_t>(j - i) > r.max_run && !is_space(t_, cps[i])) {
          run_len = static_cast<int64_t>(j - i);
          run_cp = cps[i];
          break;
        }
        i = j;
      }
    }
    set(r, "run_len", run_len);
    set(r, "run_cp", run_cp);
    set(r, "n_chars", n_chars);
    // simple._most_common_char: candidates from two strided samples, the four most common
    // (ties in order of first appearance: Counter.most_common), each counted exactly.
    const size_t k = len / 256 + 1;
    sample_.clear();  // (character, count) in order of first appearance
    ascii_slot_.fill(-1);
    auto add = [&](uint32_t c) {
      if (c < 128) {
        int32_t& at = ascii_slot_[c];
        if (at < 0) {
          at = static_cast<int32_t>(sample_.size());
          sample_.emplace_back(c, 0);
        }
        ++sample_[at].second;
        return;
      }
      for (auto& p : sample_) {
        if (p.first == c) {
          ++p.second;
          return;
        }
      }
      sample_.emplace_back(c, 1);
    };
    for (size_t i = 0; i < len; i += k) add(cps[i]);
    if (k > 1) {
      for (size_t i = k / 2; i < len; i += k + 1) add(cps[i]);
    }
    std::stable_sort(sample_.begin(), sample_.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
    // Four candidate slots, the unused ones holding a value no code point has, so the
    // count below is one fixed-width loop the compiler vectorises (a loop over `nc`
    // candidates per character was 15% of this function's time).
    constexpr uint32_t kNone = 0xFFFFFFFFu;
    uint32_t cand[4] = {kNone, kNone, kNone, kNone};
    int64_t counts[4] = {0, 0, 0, 0};
    size_t nc = 0;
    for (size_t q = 0; q < sample_.size() && q < 4; ++q) {
      if (!is_space(t_, sample_[q].first)) cand[nc++] = sample_[q].first;
    }
    if (nc) {
      const uint32_t c0 = cand[0], c1 = cand[1], c2 = cand[2], c3 = cand[3];
      int64_t n0 = 0, n1 = 0, n2 = 0, n3 = 0;
      for (size_t i = 0; i < len; ++i) {
        const uint32_t c = cps[i];
        n0 += c == c0;
        n1 += c == c1;
        n2 += c == c2;
        n3 += c == c3;
      }
      counts[0] = n0, counts[1] = n1, counts[2] = n2, counts[3] = n3;
    }
    int64_t best_count = 0;
    uint32_t best = 0;
    for (size_t q = 0; q < nc; ++q) {
      if (counts[q] > best_count) {
        best_count = counts[q];
        best = cand[q];
      }
    }
    set(r, "top_count", best_count);
    set(r, "top_cp", best);
  }

  void length(const RuleSpec& r, DocState& d) {
    set(r, "chars", cp_len(strip(t_, d.text)));
    if (r.count_words) {
      set(r, "words", chunk_count(d.text));
    }
  }

  void gopher_quality(const RuleSpec& r, DocState& d) {
    const auto& w = words(d);
    int64_t content = 0, content_len = 0, alpha = 0;
    uint64_t stops = 0;
    for (const auto& tk : w) {
      if (tk.flags & kContent) {
        ++content;
        content_len += tk.cps;
      }
      alpha += (tk.flags & kHasAlpha) != 0;
      if ((r.stop_filter >> (tk.hash & 63)) & 1) {  // most words are no stop word
        for (size_t q = 0; q < r.stop_words.size(); ++q) {
          if (tk.hash == r.stop_hashes[q] && tk.text == r.stop_words[q]) stops |= uint64_t{1} << q;
        }
      }
    }
    set(r, "words", static_cast<int64_t>(w.size()));
    set(r, "content", content);
    set(r, "content_len", content_len);
    set(r, "alpha", alpha);
    set(r, "stop", __builtin_popcountll(stops));
    set(r, "hashes", count_sub(d.text, "#"));
    set(r, "ellipses", count_sub(d.text, "...") + count_sub(d.text, "\xE2\x80\xA6"));
    int64_t lines = 0, bullets = 0, ellipsis_lines = 0;
    for_each_line(d.text, [&](std::string_view line) {
      ++lines;
      const auto l = lstrip(t_, line);
      bullets += starts_with(l, "\xE2\x80\xA2") || starts_with(l, "-");
      const auto rs = rstrip(t_, line);
      ellipsis_lines += ends_with(rs, "...") || ends_with(rs, "\xE2\x80\xA6");
    });
    set(r, "lines", lines);
    set(r, "bullet_lines", bullets);
    set(r, "ellipsis_lines", ellipsis_lines);
  }

  void gopher_repetition(const RuleSpec& r, DocState& d) {
    const std::string_view text = d.text;
    set(r, "size", cp_len(text));
    if (text.empty()) return;
    // Paragraphs: re.split(r"\n{2,}", text.strip()); lines: re.split(r"\n+", text).
    auto split_newlines = [](std::string_view s, size_t min_run, std::vector<std::string_view>& out) {
      out.clear();
      size_t start = 0, i = 0;
      while (i < s.size()) {
        if (s[i] != '\n') {
          ++i;
          continue;
        }
        size_t j = i;
        while (j < s.size() && s[j] == '\n') ++j;
        if (j - i >= min_run) {
          out.push_back(s.substr(start, i - start));
          start = j;
        }
        i = j;
      }
      out.push_back(s.substr(start));
      return out;
    };
    const auto& paras = split_newlines(strip(t_, text), 2, paras_);
    auto [pd, pc] = dups_.count(paras);
    set(r, "paras", static_cast<int64_t>(paras.size()));
    set(r, "para_dups", pd);
    set(r, "para_dup_chars", pc);
    const auto& lines = split_newlines(text, 1, lines_);
    auto [ld, lc] = dups_.count(lines);
    set(r, "lines", static_cast<int64_t>(lines.size()));
    set(r, "line_dups", ld);
    set(r, "line_dup_chars", lc);

    const auto& w = words(d);
    const size_t nw = w.size();
    auto& cum = cum_;
    cum.assign(nw + 1, 0);
    for (size_t i = 0; i < nw; ++i) cum[i + 1] = cum[i] + w[i].cps;
    int64_t max_n = 0, min_n = INT64_MAX;
    for (auto n : r.top_n) max_n = std::max(max_n, n), min_n = std::min(min_n, n);
    for (auto n : r.dup_n) max_n = std::max(max_n, n), min_n = std::min(min_n, n);
    // Only n-grams that occur more than once matter (the most frequent one when any
    // repeats, and the repeats the greedy count adds), and a repeated n-gram starts with a
    // repeated (n-1)-gram: so each n hashes and counts only the positions where the
    // (n-1)-gram repeats, a few percent of a typical document after the first n.
    auto& pos = pos_;  // candidate start positions, ascending
    auto& hv = hv_;    // the n-gram hash at each
    pos.resize(nw);
    hv.resize(nw);
    for (size_t i = 0; i < nw; ++i) {
      pos[i] = static_cast<uint32_t>(i);
      hv[i] = w[i].hash;
    }
    for (int64_t n = 1; n <= max_n && static_cast<int64_t>(nw) >= n; ++n) {
      if (n > 1) {
        // Extend the repeated (n-1)-grams that have a word after them.
        size_t k = 0;
        for (size_t q = 0; q < pos.size(); ++q) {
          if (pos[q] + static_cast<size_t>(n) > nw) continue;
          pos[k] = pos[q];
          hv[k] = mix64(hv[q] * 0x9E3779B97F4A7C15ULL ^ w[pos[q] + n - 1].hash);
          ++k;
        }
        pos.resize(k);
        hv.resize(k);
      }
      // Below the smallest n asked for, every position is kept: nothing filters yet.
      if (n < min_n) continue;
      table_.reset(pos.size());
      slot_of_.resize(pos.size());
      for (size_t q = 0; q < pos.size(); ++q) {
        bool fresh;
        const size_t sl = table_.slot(hv[q], fresh);
        if (fresh) {
          table_.counts_[sl] = 0;
          table_.firsts_[sl] = pos[q];
        }
        ++table_.counts_[sl];
        slot_of_[q] = sl;
      }
      const bool want_top = std::find(r.top_n.begin(), r.top_n.end(), n) != r.top_n.end();
      const bool want_dup = std::find(r.dup_n.begin(), r.dup_n.end(), n) != r.dup_n.end();
      if (want_top) {
        // Counter.most_common(1): the most frequent, the first seen among equals; with no
        // repeat, every n-gram counts 1 and the first is at position 0.
        int64_t top = 1, first = 0;
        for (size_t q = 0; q < pos.size(); ++q) {
          const int64_t c = table_.counts_[slot_of_[q]];
          const int64_t f = table_.firsts_[slot_of_[q]];
          if (c > top || (c == top && c > 1 && f < first)) {
            top = c;
            first = f;
          }
        }
        set(r, r.names.at("top" + std::to_string(n) + "_count").c_str(), top);
        set(r, r.names.at("top" + std::to_string(n) + "_len").c_str(),
            cum[first + n] - cum[first] + n - 1);
      }
      // Keep the repeated ones (count >= 2) as the next n's candidates.
      size_t k = 0;
      for (size_t q = 0; q < pos.size(); ++q) {
        if (table_.counts_[slot_of_[q]] < 2) continue;
        pos[k] = pos[q];
        hv[k] = hv[q];
        ++k;
      }
      pos.resize(k);
      hv.resize(k);
      if (want_dup) {
        // gopher._greedy_dup_chars: scanning left to right, an n-gram seen before adds its
        // characters and the scan jumps past it. An n-gram that occurs once is never "seen
        // before", so only the repeated positions need visiting.
        int64_t repeated = 0;
        seen_.reset(pos.size());
        size_t next = 0;  // the scan's position
        for (size_t q = 0; q < pos.size(); ++q) {
          if (pos[q] < next) continue;
          bool fresh;
          seen_.slot(hv[q], fresh);
          if (fresh) {
            next = pos[q] + 1;
          } else {
            repeated += cum[pos[q] + n] - cum[pos[q]];
            next = pos[q] + n;
          }
        }
        set(r, r.names.at("dup" + std::to_string(n) + "_chars").c_str(), repeated);
      }
    }
    // An n longer than the text: no n-gram, so no top statistic and no repeats.
    for (auto n : r.dup_n) {
      if (static_cast<int64_t>(nw) < n) {
        set(r, r.names.at("dup" + std::to_string(n) + "_chars").c_str(), 0);
      }
    }
  }

  // re.sub(r"\[\d*]|\[edit]|\[citation needed]", "", line)
  std::string remove_citations(std::string_view line) const {
    std::string out;
    size_t i = 0, copied = 0;
    while (i < line.size()) {
      if (line[i] != '[') {
        ++i;
        continue;
      }
      size_t j = i + 1;
      while (j < line.size()) {
        size_t k = j;
        const uint32_t cp = next_cp(line, k);
        if (!(cp >= '0' && cp <= '9') && !(cp >= 0x80 && t_.decimal.has(cp))) break;
        j = k;
      }
      size_t end = 0;
      if (j < line.size() && line[j] == ']') {
        end = j + 1;
      } else if (starts_with(line.substr(i), "[edit]")) {
        end = i + 6;
      } else if (starts_with(line.substr(i), "[citation needed]")) {
        end = i + 17;
      }
      if (end) {
        out.append(line.substr(copied, i - copied));
        copied = i = end;
      } else {
        ++i;
      }
    }
    out.append(line.substr(copied));
    return out;
  }

  void c4(const RuleSpec& r, DocState& d) {
    int64_t verdict = 0, sentences_total = 0, kept_n = 0;
    // The kept lines: views of the text, or of citation-free copies in cleaned_.
    kept_views_.clear();
    cleaned_.clear();
    raw_lines_.clear();
    for_each_line(d.text, [&](std::string_view l) { raw_lines_.push_back(l); });
    const auto lines_n = static_cast<int64_t>(raw_lines_.size());
    // Lines are processed in order; C4 drops the page at the first 'lorem ipsum' or '{'.
    // The tests that only skip a line run cheapest first: skipping has no other effect,
    // so their order does not change the outcome.
    for (auto raw : raw_lines_) {
      const std::string_view line = strip(t_, raw);
      std::string_view cur = line;
      if (r.remove_citations && line.find('[') != std::string_view::npos) {
        cleaned_.push_back(remove_citations(line));
        cur = cleaned_.back();
      }
      if (r.filter_no_terminal_punct) {
        // (Not strchr: it would find a final NUL byte in the pattern's terminator.)
        const char last = cur.empty() ? 0 : cur.back();
        const bool end_ok =
            last == '.' || last == '?' || last == '!' || last == '"' || last == '\'';
        if (!end_ok || ends_with(cur, "...")) continue;
      }
      // Words are counted before citation removal, as datatrove does. A line no longer
      // than the limit (in bytes, so in characters too) cannot hold a longer word.
      int64_t n_words = 0;
      bool too_long = false;
      const bool check_len = r.max_word_length >= 0 &&
                             static_cast<int64_t>(line.size()) > r.max_word_length &&
                             cp_len(line) > r.max_word_length;
      for_each_chunk(t_, line, [&](std::string_view w) {
        ++n_words;
        if (check_len && cp_len(w) > r.max_word_length) too_long = true;
      });
      if (too_long || n_words < r.min_words_per_line) continue;
      lower_.assign(cur);
      for (auto& c : lower_) {
        if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      }
      if (r.filter_lorem_ipsum && lower_.find("lorem ipsum") != std::string::npos) {
        verdict = 1;
        excerpt(r, cur);
        break;
      }
      if (r.filter_javascript && lower_.find("javascript") != std::string::npos) continue;
      if (r.filter_curly_bracket && cur.find('{') != std::string_view::npos) {
        verdict = 2;
        excerpt(r, cur);
        break;
      }
      if (r.filter_policy) {
        bool policy = false;
        for (const char* p : kPolicy) policy = policy || lower_.find(p) != std::string::npos;
        if (policy) continue;
      }
      if (r.count_sentences) {
        check_script(d);  // spaCy's sentencizer applies to English text only
        sentences_total += words_.sentences(cur);
      }
      kept_views_.push_back(cur);
      ++kept_n;
    }
    set(r, "verdict", verdict);
    set(r, "sentences", sentences_total);
    set(r, "kept_lines", kept_n);
    set(r, "lines", lines_n);
    if (verdict != 0) return;
    joined_.clear();
    for (size_t q = 0; q < kept_views_.size(); ++q) {
      if (q) joined_.push_back('\n');
      joined_.append(kept_views_[q]);
    }
    const std::string_view cleaned = strip(t_, joined_);
    set(r, "empty", cleaned.empty() ? 1 : 0);
    if (!cleaned.empty() && cleaned != d.text) {
      d.owned = std::string(cleaned);
      d.text = d.owned;
      words_.forget();
      d.words_ready = false;
      d.script_checked = false;
    }
  }

  // The first 60 characters of a line, for C4's drop detail.
  void excerpt(const RuleSpec& r, std::string_view line) {
    size_t i = 0;
    for (int k = 0; k < 60 && i < line.size(); ++k) next_cp(line, i);
    excerpts_.emplace_back(line.substr(0, i));
    set(r, "excerpt", static_cast<int64_t>(excerpts_.size() - 1));
  }

  void fineweb(const RuleSpec& r, DocState& d) {
    const std::string_view text = d.text;
    int64_t n = 0, punct = 0, shorts = 0, newlines = 0;
    auto& lines = lines_;
    lines.clear();
    size_t start = 0;
    while (start <= text.size()) {
      const void* nl =
          start < text.size() ? std::memchr(text.data() + start, '\n', text.size() - start) : nullptr;
      const size_t i = nl ? static_cast<size_t>(static_cast<const char*>(nl) - text.data()) : text.size();
      if (nl) ++newlines;
      const std::string_view line = text.substr(start, i - start);
      start = i + 1;
      if (strip(t_, line).empty()) continue;
      lines.push_back(line);
      ++n;
      size_t e = line.size();
      if (t_.terminal.has(prev_cp(line, e))) ++punct;
      if (cp_len(line) <= r.short_line_length) ++shorts;
    }
    set(r, "lines", n);
    set(r, "punct", punct);
    set(r, "short", shorts);
    set(r, "newlines", newlines);
    set(r, "dup_chars", dups_.count(lines).second);
    set(r, "chars", cp_len(text));
    if (r.new_line_ratio >= 0 && newlines && n) {
      // Chunks first: each holds at least one word, so when newlines per chunk stay under
      // the limit so do newlines per word, and the words need not be split.
      const int64_t chunks = chunk_count(text);
      if (static_cast<double>(newlines) / static_cast<double>(chunks) > r.new_line_ratio) {
        set(r, "words", static_cast<int64_t>(words(d).size()));
      } else {
        set(r, "words", chunks);
      }
    }
  }

  Tables t_;
  EnglishWords words_;
  std::vector<RuleSpec> rules_;
  NGramTable table_, seen_;
  DupCounter dups_;
  std::vector<uint32_t> cps_;
  std::vector<std::string_view> paras_, lines_;  // a document's paragraphs and lines
  std::vector<std::pair<uint32_t, int64_t>> sample_;
  std::array<int32_t, 128> ascii_slot_;
  std::vector<std::string_view> raw_lines_, kept_views_;
  std::deque<std::string> cleaned_;  // a deque: its strings stay put as it grows
  std::string lower_, joined_;
  std::vector<int64_t> cum_;
  std::vector<uint32_t> pos_;
  std::vector<uint64_t> hv_;
  std::vector<size_t> slot_of_;
  Columns cols_;
  std::vector<std::string> excerpts_;
  int64_t doc_count_ = 0, row_ = 0;
};

RuleSpec parse_rule(const py::tuple& spec) {
  RuleSpec r;
  const auto name = spec[0].cast<std::string>();
  const auto p = spec[1].cast<py::dict>();
  r.prefix = spec[2].cast<std::string>();
  auto get_int = [&](const char* k, int64_t none) {
    return p.contains(k) && !p[k].is_none() ? p[k].cast<int64_t>() : none;
  };
  auto get_bool = [&](const char* k) { return p[k].cast<bool>(); };
  if (name == "char_repetition") {
    r.kind = Kind::kCharRepetition;
    r.max_run = get_int("max_run", -1);
  } else if (name == "length") {
    r.kind = Kind::kLength;
    r.count_words = p.contains("min_words") && !p["min_words"].is_none();
  } else if (name == "gopher_quality") {
    r.kind = Kind::kGopherQuality;
    r.stop_words = p["stop_words"].cast<std::vector<std::string>>();
    if (r.stop_words.size() > 64) throw std::invalid_argument("gopher_quality: > 64 stop words");
    for (const auto& w : r.stop_words) {
      r.stop_hashes.push_back(hash_bytes(w));
      r.stop_filter |= uint64_t{1} << (r.stop_hashes.back() & 63);
    }
  } else if (name == "gopher_repetition") {
    r.kind = Kind::kGopherRepetition;
    for (auto item : p["top_n_grams"]) r.top_n.push_back(item.cast<py::tuple>()[0].cast<int64_t>());
    for (auto item : p["dup_n_grams"]) r.dup_n.push_back(item.cast<py::tuple>()[0].cast<int64_t>());
    for (auto n : r.top_n) {
      for (const char* part : {"_count", "_len"}) {
        const std::string name = "top" + std::to_string(n) + part;
        r.names[name] = name;
      }
    }
    for (auto n : r.dup_n) {
      const std::string name = "dup" + std::to_string(n) + "_chars";
      r.names[name] = name;
    }
  } else if (name == "c4") {
    r.kind = Kind::kC4;
    r.remove_citations = get_bool("remove_citations");
    r.filter_no_terminal_punct = get_bool("filter_no_terminal_punct");
    r.filter_lorem_ipsum = get_bool("filter_lorem_ipsum");
    r.filter_javascript = get_bool("filter_javascript");
    r.filter_curly_bracket = get_bool("filter_curly_bracket");
    r.filter_policy = get_bool("filter_policy");
    r.count_sentences = !p["min_num_sentences"].is_none();
    r.min_words_per_line = get_int("min_words_per_line", 0);
    r.max_word_length = get_int("max_word_length", -1);
  } else if (name == "fineweb") {
    r.kind = Kind::kFineWeb;
    r.short_line_length = get_int("short_line_length", 30);
    r.new_line_ratio = p["new_line_ratio"].is_none() ? -1.0 : p["new_line_ratio"].cast<double>();
  } else {
    throw std::invalid_argument("quality kernel: no native rule " + name);
  }
  return r;
}

}  // namespace

void register_quality(py::module_& m) {
  py::class_<Chain>(m, "QualityChain")
      .def(py::init([](const py::dict& tables, py::function resolver,
                       std::vector<std::string> special,
                       const py::list& matcher, size_t run_max, const py::list& rules,
                       size_t cache_max) {
             Tables t{CodePointSet(tables["space"].cast<std::vector<uint32_t>>()),
                      CodePointSet(tables["decimal"].cast<std::vector<uint32_t>>()),
                      CodePointSet(tables["terminal"].cast<std::vector<uint32_t>>()),
                      CodePointSet(tables["no_space"].cast<std::vector<uint32_t>>())};
             std::vector<RuleSpec> specs;
             for (auto r : rules) specs.push_back(parse_rule(r.cast<py::tuple>()));
             return new Chain(std::move(t), std::move(resolver), std::move(special), matcher,
                              run_max, std::move(specs), cache_max);
           }),
           py::arg("tables"), py::arg("resolver"), py::arg("special"), py::arg("matcher"), py::arg("run_max"), py::arg("rules"),
           py::arg("cache_max"))
      .def("run", &Chain::run, py::arg("column"),
           "Counters of every rule for every document of a text column (see quality.cpp).");
}

}  // namespace ballast
