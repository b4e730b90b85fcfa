// The spaCy English words of a text for the quality kernel (native/quality.cpp), as
// dataprep/quality/spacy_en.py makes them: whitespace-free chunks whose tokens come from
// a cache the Python reference fills once per distinct chunk (ChunkCache), the chunks
// whose tokens depend on their neighbours merged in context, and a line's sentence count
// from its chunks' sentencizer classes.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "quality_text.h"

namespace ballast {

namespace py = pybind11;

class EnglishWords {
 public:
  // `matcher` is spacy_en._MATCHER flattened (dataprep/quality/native_chain.py _matcher):
  // each run of tokens that spells a special case, with the special case's own tokens.
  EnglishWords(const Tables& t, py::function resolver, std::vector<std::string> special,
               const py::list& matcher, size_t run_max, size_t cache_max)
      : t_(t), cache_(std::move(resolver), std::move(special), cache_max), run_max_(run_max) {
    for (auto item : matcher) {
      auto tup = item.cast<py::tuple>();
      auto run = tup[0].cast<std::vector<std::string>>();
      auto lens = tup[1].cast<std::vector<uint32_t>>();
      auto cps = tup[2].cast<std::vector<uint32_t>>();
      auto flags = tup[3].cast<std::vector<uint8_t>>();
      const int m = static_cast<int>(runs_.size());
      matcher_[run.at(0)].push_back(m);
      std::vector<ChunkCache::Tok> sp;
      for (size_t q = 0; q < lens.size(); ++q) sp.push_back({lens[q], cps[q], flags[q], 0});
      runs_.push_back(std::move(run));
      specials_.push_back(std::move(sp));
    }
  }

  // The text split last is no longer the one sentences() may read lines of.
  void forget() { words_text_ = {}; }
  // How many whitespace-separated chunks `text` has, when it is the text split last
  // (the same bytes in the same place); -1 otherwise.
  int64_t chunk_count(std::string_view text) const {
    if (words_text_.empty() || text.data() != words_text_.data() || text.size() != words_text_.size()) {
      return -1;
    }
    return static_cast<int64_t>(chunk_views_.size());
  }
  size_t misses() const { return cache_.misses(); }
  size_t in_context() const { return in_context_; }

  // The tokens of `text` into `toks` (views of it), remembered for sentences().
  void split(std::string_view text, std::vector<Token>& toks) {
    // Each chunk's tokens (copied out of the cache at once: a later miss may empty it),
    // and for each chunk where its tokens start, whether they are the tokens before
    // special cases are merged (a _MERGED chunk) and whether a single " " precedes it.
    toks.clear();
    refs_.clear();
    chunk_views_.clear();
    chunk_hashes_.clear();
    chunk_cls_.clear();
    cls_buf_.clear();
    words_text_ = text;
    for_each_chunk(t_, text, [&](std::string_view chunk) {
      chunk_views_.push_back(chunk);
      chunk_hashes_.push_back(hash_bytes(chunk));
    });
    for (uint64_t h : chunk_hashes_) cache_.prefetch_slot(h);
    for (uint64_t h : chunk_hashes_) cache_.prefetch_entry(h);
    for (uint64_t h : chunk_hashes_) cache_.prefetch_data(h);
    bool any_merged = false;
    const char* prev_end = text.data();
    for (size_t c = 0; c < chunk_views_.size(); ++c) {
      const std::string_view chunk = chunk_views_[c];
      const ChunkCache::Entry* e = cache_.get(chunk, chunk_hashes_[c]);
      if (e == nullptr) throw std::runtime_error("quality kernel: chunk tokens do not cover it");
      const bool single_space = chunk.data() - prev_end == 1 && *prev_end == ' ';
      prev_end = chunk.data() + chunk.size();
      refs_.push_back(ChunkRef{static_cast<uint32_t>(toks.size()), e->count, e->merged, single_space});
      any_merged = any_merged || e->merged;
      // Its sentencizer classes, for C4's sentence counts over this text's lines.
      const std::string_view cls = cache_.classes(*e);
      chunk_cls_.push_back({static_cast<uint32_t>(cls_buf_.size()), static_cast<uint32_t>(cls.size())});
      cls_buf_.append(cls);
      size_t off = 0;
      for (uint32_t k = 0; k < e->count; ++k) {
        const auto& tk = cache_.tok(e->first + k);
        toks.push_back(Token{chunk.substr(off, tk.bytes), tk.cps, tk.flags, tk.hash});
        off += tk.bytes;
      }
    }
    if (any_merged) merge_in_context(toks);
  }

  // spacy_en.count_sentences of one line: 1 + the "PW"s in the joined classes of its
  // chunks and whitespace runs (a single " " has none, any other run is "W").
  int64_t sentences(std::string_view line) {
    if (line.empty()) return 0;
    char prev = 0;
    int64_t pw = 0;
    auto feed = [&](std::string_view cls) {
      for (char c : cls) {
        if (prev == 'P' && c == 'W') ++pw;
        prev = c;
      }
    };
    // A stripped line of the text whose words are split already: its chunks are a run of
    // that split's chunks, with their classes at hand (no lookup).
    const char* text0 = words_text_.data();
    if (!words_text_.empty() && line.data() >= text0 &&
        line.data() + line.size() <= text0 + words_text_.size()) {
      auto it = std::lower_bound(
          chunk_views_.begin(), chunk_views_.end(), line.data(),
          [](std::string_view c, const char* p) { return c.data() < p; });
      size_t c = static_cast<size_t>(it - chunk_views_.begin());
      const char* end = line.data() + line.size();
      bool first = true;
      for (; c < chunk_views_.size() && chunk_views_[c].data() < end; ++c) {
        if (refs_[c].merged) return sentences_in_context(line);
        if (!first && !refs_[c].single_space) feed("W");
        first = false;
        feed(std::string_view(cls_buf_).substr(chunk_cls_[c].first, chunk_cls_[c].second));
      }
      return 1 + pw;
    }
    bool merged = false;
    for_each_piece(t_, line, [&](std::string_view piece, bool sp) {
      if (sp) {
        if (piece != " ") feed("W");
        return true;
      }
      const ChunkCache::Entry* e = cache_.get(piece);
      if (e == nullptr) throw std::runtime_error("quality kernel: chunk tokens do not cover it");
      if (e->merged) {  // its sentences need the whole line's tokens
        merged = true;
        return false;
      }
      const std::string cls(cache_.classes(*e));  // copied: a later miss may move it
      feed(cls);
      return true;
    });
    if (merged) return sentences_in_context(line);
    return 1 + pw;
  }

 private:
  // spacy_en._find then _select over n tokens (text_at(q) is token q): every run that
  // spells a special case with affixes, then longest first, leftmost first, kept when
  // neither end token was in a run looked at before. kept_ holds them by start.
  template <class TextAt>
  void select_specials(size_t n, TextAt text_at) {
    found_.clear();
    for (size_t a = 0; a < n; ++a) {
      auto it = matcher_.find(std::string(text_at(a)));
      if (it == matcher_.end()) continue;
      for (int m : it->second) {
        const auto& run = runs_[m];
        if (a + run.size() > n) continue;
        bool same = true;
        for (size_t q = 0; q < run.size() && same; ++q) same = text_at(a + q) == run[q];
        if (same) found_.push_back({a, a + run.size(), m});
      }
    }
    std::stable_sort(found_.begin(), found_.end(), [](const Found& x, const Found& y) {
      const auto lx = x.b - x.a, ly = y.b - y.a;
      return lx != ly ? lx > ly : x.a < y.a;
    });
    seen_tok_.assign(n, 0);
    kept_.clear();
    for (const Found& f : found_) {
      if (!seen_tok_[f.a] && !seen_tok_[f.b - 1]) kept_.push_back(f);
      for (size_t q = f.a; q < f.b; ++q) seen_tok_[q] = 1;
    }
    std::sort(kept_.begin(), kept_.end(), [](const Found& x, const Found& y) { return x.a < y.a; });
  }

  // spacy_en.tokenize for a text holding chunks whose tokens depend on their neighbours:
  // each such chunk's tokens are what spaCy's special-case matching over the whole text
  // makes of them, decided over a window of the chunks around it (spacy_en._in_context,
  // whose docstring says why the window decides it as the whole text would).
  void merge_in_context(std::vector<Token>& out) {
    const std::vector<Token> pre = out;  // every chunk's tokens before merging
    out.clear();
    const auto n = static_cast<int64_t>(refs_.size());
    for (int64_t k = 0; k < n; ++k) {
      const ChunkRef& c = refs_[k];
      if (!c.merged) {
        out.insert(out.end(), pre.begin() + c.begin, pre.begin() + c.begin + c.count);
        continue;
      }
      int64_t lo = k, hi = k;
      size_t left = 0, right = 0;
      while (lo > 0 && refs_[lo].single_space && left < run_max_ - 1) {
        --lo;
        left += refs_[lo].count;
      }
      while (hi + 1 < n && refs_[hi + 1].single_space && right < run_max_ - 1) {
        ++hi;
        right += refs_[hi].count;
      }
      const size_t w0 = refs_[lo].begin;
      const size_t w1 = refs_[hi].begin + refs_[hi].count;
      const size_t start = c.begin - w0, end = start + c.count;
      // _find: every run of the window's tokens that spells a special case with affixes.
      select_specials(w1 - w0, [&](size_t q) { return pre[w0 + q].text; });
      size_t i = start;
      for (const Found& f : kept_) {
        if (f.a < start || f.b > end) continue;  // runs across a space spell no special case
        out.insert(out.end(), pre.begin() + w0 + i, pre.begin() + w0 + f.a);
        // The special case's own tokens spell the same bytes as the run they replace.
        const char* p = pre[w0 + f.a].text.data();
        for (const auto& st : specials_[f.m]) {
          const std::string_view piece(p, st.bytes);
          out.push_back(Token{piece, st.cps, st.flags, hash_bytes(piece)});
          p += st.bytes;
        }
        i = f.b;
      }
      out.insert(out.end(), pre.begin() + w0 + i, pre.begin() + w0 + end);
    }
  }

  // spacy_en.count_sentences of a line holding a chunk whose tokens depend on its
  // neighbours: sentencize(doc_tokens(line)). The line's tokens with its whitespace
  // tokens (a run less the one " " that belongs to the token before it), special cases
  // matched over all of them and applied within one chunk, then 1 + each sentence-final
  // token followed, past punctuation, by another token.
  int64_t sentences_in_context(std::string_view line) {
    ++in_context_;
    line_toks_.clear();
    int chunk = 0;
    for_each_piece(t_, line, [&](std::string_view piece, bool sp) {
      if (sp) {
        if (chunk > 0 && piece[0] == ' ') piece.remove_prefix(1);
        if (!piece.empty()) line_toks_.push_back({piece, 0, -1});  // whitespace: a word
        return true;
      }
      const ChunkCache::Entry* e = cache_.get(piece);
      if (e == nullptr) throw std::runtime_error("quality kernel: chunk tokens do not cover it");
      size_t off = 0;
      for (uint32_t k = 0; k < e->count; ++k) {
        const auto& tk = cache_.tok(e->first + k);
        line_toks_.push_back({piece.substr(off, tk.bytes), tk.flags, chunk});
        off += tk.bytes;
      }
      ++chunk;
      return true;
    });
    const size_t n = line_toks_.size();
    select_specials(n, [&](size_t q) { return line_toks_[q].text; });
    int64_t sentences = n ? 1 : 0;
    bool seen_end = false;
    auto feed = [&](uint8_t flags) {
      if (flags & kFinal) {
        seen_end = true;
      } else if (seen_end && !(flags & kPunctOnly)) {
        ++sentences;
        seen_end = false;
      }
    };
    size_t a = 0;
    for (const Found& f : kept_) {
      const int owner = line_toks_[f.a].owner;
      if (owner < 0 || owner != line_toks_[f.b - 1].owner) continue;  // across whitespace
      for (; a < f.a; ++a) feed(line_toks_[a].flags);
      for (const auto& st : specials_[f.m]) feed(st.flags);
      a = f.b;
    }
    for (; a < n; ++a) feed(line_toks_[a].flags);
    return sentences;
  }

  struct ChunkRef {
    uint32_t begin;  // its first token in the split
    uint32_t count;
    bool merged;
    bool single_space;  // exactly " " before it
  };
  struct Found {
    size_t a, b;  // token range within the window
    int m;        // which run
  };

  const Tables& t_;
  ChunkCache cache_;
  size_t run_max_;
  size_t in_context_ = 0;
  std::unordered_map<std::string, std::vector<int>> matcher_;  // first token -> runs
  std::vector<std::vector<std::string>> runs_;
  std::vector<std::vector<ChunkCache::Tok>> specials_;
  std::vector<ChunkRef> refs_;
  std::vector<std::string_view> chunk_views_;
  std::vector<uint64_t> chunk_hashes_;
  std::vector<std::pair<uint32_t, uint32_t>> chunk_cls_;  // classes of each, in cls_buf_
  std::string cls_buf_;
  std::string_view words_text_;  // the text chunk_views_ split (empty: none)
  std::vector<Found> found_, kept_;
  struct LineTok {
    std::string_view text;
    uint8_t flags;
    int owner;  // its chunk in the line; -1 for whitespace
  };
  std::vector<LineTok> line_toks_;
  std::vector<uint8_t> seen_tok_;
};

}  // namespace ballast
