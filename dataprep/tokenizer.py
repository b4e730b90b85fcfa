"""Tokenizers for the tokenize stage: raw UTF-8 bytes, a byte-level BPE trained here, or an
existing HF `tokenizer.json`.

All three sit behind one small `Tokenizer` object so the later stages (tokenize, mixture,
pack) only ever see int32 id arrays plus `eos_id`/`pad_id`/`vocab_size`. The tokenizer is
saved next to the dataset as `to_json()` and identified by `sha256()`, so a resumed run can
check that it is still tokenizing with the same vocabulary.

Conventions that hold for every kind:
- `encode_batch` never adds special tokens (no BOS, no EOS); the caller appends `eos_id`
  between documents. Text that happens to contain "<|endoftext|>" is encoded as plain text,
  never as the EOS id, so a document cannot forge a document boundary.
- `decode` renders special tokens as their text ("<|endoftext|>"), which is what one wants
  when eyeballing a packed row; bytes that do not form valid UTF-8 (a row cut mid-character)
  become U+FFFD instead of raising.

HF `tokenizers` is imported lazily: the bytes tokenizer needs nothing beyond numpy.

`encode_column` encodes a whole Arrow text column (the tokenize stage's path). For a
byte-level BPE that native/bpe.cpp can encode exactly (checked once per tokenizer by
`_native_bpe_plan`, see there), it runs the native encoder; otherwise, and whenever the
native module is missing or BALLAST_NATIVE=0, it runs HF. HF stays the reference: both give
the same ids, which tests/e2e/test_bpe_native.py checks on the shared corpora and
on random text.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice, pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa
    import tokenizers

    from dataprep.config import TokenizerConfig

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# What a foreign tokenizer.json may call its end-of-text / padding token, in order of
# preference (GPT-2 style first, then SentencePiece/Llama style).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>")
PAD_CANDIDATES = ("<|pad|>", "<pad>")

BYTES_VOCAB = 258  # 256 byte values + EOS + PAD
_BYTES_EOS = 256
_BYTES_PAD = 257
_BYTES_MARKER = "ballast_tokenizer"


@dataclass(frozen=True, eq=False)
class Tokenizer:
    kind: str  # "bytes" | "bpe" | "file"
    vocab_size: int  # includes the special tokens
    eos_id: int
    pad_id: int
    # The HF tokenizer for "bpe"/"file"; None for "bytes".
    _hf: Any = field(default=None, repr=False)
    # Serialised once at construction: sha256() is called per shard/manifest, and for HF
    # tokenizers the JSON is large enough (hundreds of KB) that re-serialising adds up.
    _json: str = field(default="", repr=False)
    # The native BPE encoder's inputs when the tokenizer passed the check, else the reason
    # it did not (a str); decided once, when the tokenizer is built or loaded.
    _native: _NativeBpe | str = field(default="not a BPE tokenizer", repr=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """One int32 array per text, without any special tokens."""
        if self._hf is None:
            return _encode_bytes(texts)
        # encode_batch_fast (newer tokenizers) skips offset tracking, which we never use.
        enc = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        return [np.asarray(e.ids, dtype=np.int32) for e in enc(texts, add_special_tokens=False)]

    def encode_column(
        self, texts: pa.Array | pa.ChunkedArray, append_id: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every text of an Arrow string column, flat: (ids int32, offsets int64 of length
        len(texts) + 1), document i's ids being ids[offsets[i]:offsets[i+1]], each followed
        by `append_id` when given. The same ids as `encode_batch`, by the native encoder
        when `native_status()` is "native"."""
        import pyarrow as pa

        chunks = texts.chunks if isinstance(texts, pa.ChunkedArray) else [texts]
        parts = [self._encode_chunk(c, append_id) for c in chunks if len(c)]
        if not parts:
            return np.zeros(0, np.int32), np.zeros(1, np.int64)
        if len(parts) == 1:
            return parts[0]
        starts = np.cumsum([0] + [len(v) for v, _ in parts[:-1]])
        offsets = np.concatenate(
            [np.zeros(1, np.int64)] + [o[1:] + s for (_, o), s in zip(parts, starts, strict=True)]
        )
        return np.concatenate([v for v, _ in parts]), offsets

    def native_status(self) -> str:
        """ "native" when `encode_column` runs native/bpe.cpp in this process, else why not."""
        from dataprep import native

        if isinstance(self._native, str):
            return self._native
        if native.module() is None:
            return "native module not built or BALLAST_NATIVE=0"
        return self._native.status(self._hf)

    def _encode_chunk(self, arr: pa.Array, append_id: int | None) -> tuple[np.ndarray, np.ndarray]:
        from dataprep import native

        mod = native.module()
        encoder = None
        # A null text has no str for HF; the HF path raises on it, as it always did.
        if mod is not None and not isinstance(self._native, str) and not arr.null_count:
            encoder = self._native.encoder(mod, self._hf)
        if encoder is None:
            return self._encode_with_batches(arr, append_id)
        values, offsets, declined = encoder.encode(
            native.text_column(arr), -1 if append_id is None else append_id
        )
        if len(declined):
            values, offsets = self._splice(arr, values, offsets, declined, append_id)
        return values, offsets

    def _encode_with_batches(
        self, arr: pa.Array, append_id: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The reference path: `encode_batch` over slices of the column."""
        extra = 0 if append_id is None else 1
        chunks: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        for start in range(0, len(arr), ENCODE_BATCH):
            enc = self.encode_batch(arr.slice(start, ENCODE_BATCH).to_pylist())
            n = np.fromiter((len(e) + extra for e in enc), dtype=np.int64, count=len(enc))
            flat = np.empty(int(n.sum()), dtype=np.int32)
            ends = np.cumsum(n)
            for e, end, k in zip(enc, ends.tolist(), n.tolist(), strict=True):
                flat[end - k : end - extra] = e
            if append_id is not None:
                flat[ends - 1] = append_id
            chunks.append(flat)
            lengths.append(n)
        offsets = np.zeros(len(arr) + 1, dtype=np.int64)
        if lengths:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        return (np.concatenate(chunks) if chunks else np.zeros(0, np.int32)), offsets

    def _splice(
        self,
        arr: pa.Array,
        values: np.ndarray,
        offsets: np.ndarray,
        declined: np.ndarray,
        append_id: int | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Put HF's ids for the documents the native encoder declined (empty in its
        output) into their places."""
        import pyarrow as pa

        tail = [] if append_id is None else [append_id]
        hf_ids = [
            np.concatenate([e, np.asarray(tail, np.int32)])
            for e in self.encode_batch(arr.take(pa.array(declined)).to_pylist())
        ]
        lengths = np.diff(offsets)
        lengths[declined] = [len(e) for e in hf_ids]
        pieces: list[np.ndarray] = []
        prev = 0
        for d, ids in zip(declined.tolist(), hf_ids, strict=True):
            pieces += [values[offsets[prev] : offsets[d]], ids]
            prev = d + 1
        pieces.append(values[offsets[prev] :])
        new_offsets = np.zeros(len(offsets), np.int64)
        np.cumsum(lengths, out=new_offsets[1:])
        return np.concatenate(pieces).astype(np.int32, copy=False), new_offsets

    def decode(self, ids: Sequence[int]) -> str:
        if self._hf is None:
            return _decode_bytes(ids)
        ids = [int(i) for i in ids]  # HF rejects numpy integer types
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return str(self._hf.decode(ids, skip_special_tokens=False))

    def to_json(self) -> str:
        return self._json

    def sha256(self) -> str:
        return hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Workers get the tokenizer by pickling. Rebuild from our own JSON rather than HF's
        # pickle state, so runtime settings that are not part of tokenizer.json
        # (encode_special_tokens) are set again on the other side.
        return (_unpickle, (self.kind, self._json))


# Documents per HF encode_batch call: HF Encoding objects carry strings and offsets per
# token (tens of bytes each), so a whole shard at once would cost GBs.
ENCODE_BATCH = 1000


def _unpickle(kind: str, text: str) -> Tokenizer:
    tok = load_tokenizer(text)
    return tok if tok.kind == kind else replace(tok, kind=kind)


# ---------------------------------------------------------------------------------------
# bytes


def byte_tokenizer() -> Tokenizer:
    """ids 0..255 are the UTF-8 bytes, 256 is <|endoftext|>, 257 is <|pad|>."""
    body = {
        _BYTES_MARKER: "bytes",
        "vocab_size": BYTES_VOCAB,
        "eos_id": _BYTES_EOS,
        "pad_id": _BYTES_PAD,
        "special_tokens": {EOS_TOKEN: _BYTES_EOS, PAD_TOKEN: _BYTES_PAD},
    }
    # sort_keys + fixed separators: the sha256 must not depend on dict order or a json
    # default that might change.
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return Tokenizer("bytes", BYTES_VOCAB, _BYTES_EOS, _BYTES_PAD, None, text)


def _encode_bytes(texts: list[str]) -> list[np.ndarray]:
    # One uint8->int32 conversion for the whole batch and then views into it: measured on
    # the OWT 1k corpus this is ~1.4 GB/s vs ~1.2 GB/s for a frombuffer+astype per text, and
    # ~2.8x faster on short (200-char) documents, where per-array numpy overhead dominates.
    encoded = [t.encode("utf-8") for t in texts]
    flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int32)
    out: list[np.ndarray] = []
    start = 0
    for b in encoded:
        end = start + len(b)
        out.append(flat[start:end])
        start = end
    return out


def _decode_bytes(ids: Sequence[int]) -> str:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= BYTES_VOCAB):
        bad = arr[(arr < 0) | (arr >= BYTES_VOCAB)][:5].tolist()
        raise ValueError(f"token ids out of range [0, {BYTES_VOCAB}): {bad}")
    special = arr >= 256
    if not special.any():
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    # Decode the byte runs between special tokens separately, so a special token in the
    # middle of a multi-byte character cannot be swallowed into a replacement char.
    parts: list[str] = []
    cut = np.flatnonzero(special)
    start = 0
    for i in cut.tolist():
        parts.append(arr[start:i].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
        parts.append(EOS_TOKEN if arr[i] == _BYTES_EOS else PAD_TOKEN)
        start = i + 1
    parts.append(arr[start:].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
    return "".join(parts)


# ---------------------------------------------------------------------------------------
# HF tokenizers (bpe / file)


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as e:
        raise ValueError(
            "tokenizer kinds 'bpe' and 'file' need the Hugging Face `tokenizers` package, "
            "which is not installed (pip install tokenizers); kind 'bytes' needs nothing"
        ) from e
    return tokenizers


def _wrap_hf(hf: tokenizers.Tokenizer, kind: str, source: str) -> Tokenizer:
    eos_tok = next((t for t in EOS_CANDIDATES if hf.token_to_id(t) is not None), None)
    if eos_tok is None:
        raise ValueError(
            f"tokenizer {source} has no end-of-text token: looked for {', '.join(EOS_CANDIDATES)}"
        )
    eos_id = int(hf.token_to_id(eos_tok))
    pad_tok = next((t for t in PAD_CANDIDATES if hf.token_to_id(t) is not None), None)
    # No pad token (GPT-2, many Llama tokenizers): pad with EOS. Padding positions are
    # masked out of the loss by the trainer, so which id fills them does not matter, and
    # reusing EOS keeps the vocabulary (and the model's embedding table) unchanged.
    pad_id = eos_id if pad_tok is None else int(hf.token_to_id(pad_tok))
    # Treat special-token strings inside documents as plain text: otherwise a web page that
    # quotes "<|endoftext|>" would be encoded as the real EOS id and split a document.
    # This is a runtime flag (not part of the JSON), so it is set on every load.
    hf.encode_special_tokens = True
    # get_vocab_size(with_added_tokens=True) counts tokens, not the largest id; a foreign
    # tokenizer.json can have gaps in its ids, and the model's embedding table must cover
    # every id the encoder can emit, so take whichever is larger.
    vocab = hf.get_vocab(with_added_tokens=True)
    vocab_size = max(int(hf.get_vocab_size(with_added_tokens=True)), max(vocab.values()) + 1)
    # pretty=True matches `Tokenizer.save`'s default, so the file we write next to the
    # dataset looks like any other HF tokenizer.json.
    text = hf.to_str(pretty=True)
    plan = _native_bpe_plan(json.loads(text))
    return Tokenizer(kind, vocab_size, eos_id, pad_id, hf, text, plan)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """A GPT-2 style byte-level BPE: special tokens <|endoftext|>=0, <|pad|>=1, then the 256
    byte symbols, then merges in the order they were learned.

    The result can be smaller than `vocab_size` when no pair reaches `min_frequency` any more.
    Saved with `to_json()` and reloaded with `load_tokenizer`, it comes back as kind "file"
    with the same ids, the same JSON and the same sha256.
    """
    if vocab_size < BYTES_VOCAB:
        raise ValueError(
            f"bpe vocab_size must be at least {BYTES_VOCAB} (2 special tokens + 256 byte "
            f"symbols), got {vocab_size}"
        )
    tk = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tk.Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space is NOT invented, so decode(encode(t)) == t
    # exactly (with True, "hello" would decode as " hello"). No normalizer, for the same
    # reason: the text the model sees is the text in the dataset, byte for byte.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        # Special tokens first, so their ids are 0 and 1 whatever the corpus.
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # All 256 byte symbols even if the sample lacks some, so any text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Determinism: the trainer sums word and pair counts (order-free), numbers the alphabet
    # in sorted order and breaks count ties by pair ids, so thread count and scheduling do
    # not change the result. Checked by tests/unit/dataprep/test_tokenizer.py, in-process and across
    # processes (different hash seeds).
    hf.train_from_iterator(_as_str_iter(texts), trainer=trainer)
    return _wrap_hf(hf, "bpe", "trained bpe")


def _as_str_iter(texts: Iterable[str]) -> Iterable[str]:
    for t in texts:
        if not isinstance(t, str):
            raise ValueError(f"bpe training texts must be str, got {type(t).__name__}")
        yield t


# ---------------------------------------------------------------------------------------
# the native BPE encoder (native/bpe.cpp)

# What the native encoder implements, as tokenizer.json spells it: the byte-level
# pre-tokenizer with its built-in GPT-2 regex and no prefix space (trim_offsets only moves
# offsets), and a plain BPE model. Keys not listed here are options this code does not
# know, so a tokenizer.json that has them is left to HF.
_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_PRE_TOKENIZER_FREE = {"trim_offsets"}
# Each option's accepted values. An empty prefix/suffix (GPT-2's own tokenizer.json) adds
# nothing to any token, so it is the same algorithm as none.
_MODEL: dict[str, tuple[Any, ...]] = {
    "type": ("BPE",),
    "dropout": (None,),
    "continuing_subword_prefix": (None, ""),
    "end_of_word_suffix": (None, ""),
    "byte_fallback": (False,),
    "ignore_merges": (False,),
}
# unk_token / fuse_unk only matter for a character missing from the vocabulary, and the
# check requires all 256 byte symbols, so no character is ever missing.
_MODEL_FREE = {"unk_token", "fuse_unk", "vocab", "merges"}
_TOP_LEVEL = {
    "version",
    "truncation",
    "padding",
    "added_tokens",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
    "model",
}
# Text that exercises every branch of the split regex, checked against HF once per process
# before the native encoder is trusted (a last guard against a tokenizers release whose
# splitting changed).
_CANARY = [
    "",
    " ",
    "Hello, world! It's they're we've I'm you'll he'd 'sam' 'S  ",
    "  two   spaces\tand\ttabs\r\n\r\nCRLF \n\n  \u00a0nbsp\u2028ls\u3000ideo  ",
    "digits 123 4567.89 \u0661\u0662 \u00bd x2 2x",
    "日本語のテキスト，한국어 emoji 👩\u200d👩\u200d👧 🇩🇪 e\u0301 \ufffd",
    "a <|endoftext|> b<|pad|>c <|endoftext|>",
    "trailing whitespace \t \n",
]


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte alphabet: byte value -> the character byte-level BPE writes for it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


class _NativeBpe:
    """What native/bpe.cpp needs for a tokenizer that passed `_native_bpe_plan`: the id of
    every byte and the merges as (left, right, merged) ids in rank order. The encoder itself
    is built on first use in each process (a worker gets the tokenizer by pickling) and
    checked against HF on _CANARY before it is used."""

    def __init__(self, byte_ids: np.ndarray, merges: np.ndarray) -> None:
        self.byte_ids = byte_ids
        self.merges = merges
        self._encoder: Any = None
        self._failed = ""

    def encoder(self, mod: Any, hf: Any) -> Any:
        """The native encoder, or None when it disagreed with HF on the canary."""
        if self._encoder is None and not self._failed:
            import pyarrow as pa

            from dataprep import native

            enc = mod.BpeEncoder(self.byte_ids, self.merges)
            values, offsets, declined = enc.encode(native.text_column(pa.array(_CANARY)), -1)
            fast = getattr(hf, "encode_batch_fast", hf.encode_batch)
            want = [e.ids for e in fast(_CANARY, add_special_tokens=False)]
            got = [values[a:b].tolist() for a, b in pairwise(offsets)]
            if len(declined) or got != want:
                self._failed = "native encoder disagrees with HF on the canary texts"
            else:
                self._encoder = enc
        return self._encoder

    def status(self, hf: Any) -> str:
        from dataprep import native

        mod = native.module()
        if mod is None:
            return "native module not built or BALLAST_NATIVE=0"
        return "native" if self.encoder(mod, hf) is not None else self._failed


def _native_bpe_plan(body: dict[str, Any]) -> _NativeBpe | str:
    """Whether native/bpe.cpp encodes this tokenizer.json exactly as HF does: the inputs it
    needs when it does, else the reason (a str), in which case HF encodes.

    It does when the pipeline is only the byte-level pre-tokenizer (GPT-2 regex, no prefix
    space) and a plain BPE model: no normalizer, truncation or padding, no post-processor
    beyond ByteLevel (which only moves offsets), no added tokens but special ones (which
    `encode_special_tokens` keeps out of the way), and a model without dropout, subword
    prefix/suffix, byte fallback or ignore_merges. Its vocabulary must map tokens to
    distinct ids and hold all 256 byte symbols; every merge's two parts and result must be
    tokens, each part a byte symbol or the result of an earlier merge (ranks consistent
    with merge order), and no pair merged twice.
    """
    extra = set(body) - _TOP_LEVEL
    if extra:
        return f"unknown tokenizer.json fields {sorted(extra)}"
    for key in ("normalizer", "truncation", "padding"):
        if body.get(key) is not None:
            return f"has a {key}"
    pre = body.get("pre_tokenizer")
    if not isinstance(pre, dict) or set(pre) - _PRE_TOKENIZER_FREE != set(_PRE_TOKENIZER):
        return f"pre-tokenizer is not ByteLevel alone: {json.dumps(pre)[:200]}"
    if any(pre[k] != v for k, v in _PRE_TOKENIZER.items()):
        return f"pre-tokenizer options differ from the GPT-2 byte level: {json.dumps(pre)}"
    post = body.get("post_processor")
    if post is not None and (not isinstance(post, dict) or post.get("type") != "ByteLevel"):
        return "has a post-processor other than ByteLevel"
    for t in body.get("added_tokens") or []:
        if not t.get("special"):
            return f"has a non-special added token {t.get('content')!r}"
    model = body.get("model")
    if not isinstance(model, dict) or set(model) - _MODEL_FREE != set(_MODEL):
        return "model is not a BPE with the options this encoder knows"
    for k, accepted in _MODEL.items():
        if model[k] not in accepted:
            return f"BPE option {k}={model[k]!r} changes the algorithm"
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(
        isinstance(i, int) and 0 <= i < 2**31 for i in vocab.values()
    ):
        return "vocabulary is not a map of tokens to ids"
    if len(set(vocab.values())) != len(vocab):
        return "vocabulary gives two tokens the same id"
    alphabet = _bytes_to_unicode()
    if any(c not in vocab for c in alphabet.values()):
        return "vocabulary lacks some of the 256 byte symbols"
    byte_ids = np.array([vocab[alphabet[b]] for b in range(256)], dtype=np.int32)
    made = set(alphabet.values())
    merges = np.empty((len(model.get("merges") or []), 3), dtype=np.int32)
    seen: set[tuple[str, str]] = set()
    for rank, m in enumerate(model.get("merges") or []):
        parts = m.split(" ") if isinstance(m, str) else m
        if not isinstance(parts, list) or len(parts) != 2:
            return f"merge {rank} is not a pair: {m!r}"
        a, b = parts
        if a not in made or b not in made:
            return f"merge {rank} ({a!r}, {b!r}) uses a token no earlier merge made"
        if (a, b) in seen:
            return f"merge {rank} ({a!r}, {b!r}) repeats an earlier one"
        if a + b not in vocab:
            return f"merge {rank} makes {a + b!r}, which is not in the vocabulary"
        seen.add((a, b))
        made.add(a + b)
        merges[rank] = (vocab[a], vocab[b], vocab[a + b])
    return _NativeBpe(byte_ids, merges)


# ---------------------------------------------------------------------------------------
# loading and building


def load_tokenizer(path_or_json: str) -> Tokenizer:
    """Load a tokenizer.json (HF format) or the bytes tokenizer's JSON, from a path (a file,
    or a directory holding tokenizer.json) or from the JSON text itself."""
    if path_or_json.lstrip().startswith("{"):
        text, source = path_or_json, "(inline JSON)"
    else:
        path = Path(path_or_json)
        if path.is_dir():
            path = path / "tokenizer.json"
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"tokenizer file {source} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read tokenizer file {source}: {e}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"tokenizer file {source} is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError(f"tokenizer file {source} is not a JSON object")
    if _BYTES_MARKER in body:
        return _load_bytes(body, source)
    tk = _import_tokenizers()
    try:
        hf = tk.Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises a bare Exception on any schema error
        raise ValueError(
            f"tokenizer file {source} is not a Hugging Face tokenizer.json: {e}"
        ) from None
    return _wrap_hf(hf, "file", source)


def _load_bytes(body: dict[str, Any], source: str) -> Tokenizer:
    tok = byte_tokenizer()
    if body.get(_BYTES_MARKER) != "bytes" or json.loads(tok.to_json()) != body:
        # Anything but the exact JSON we write would mean ids this code does not produce.
        raise ValueError(
            f"tokenizer file {source} is a ballast tokenizer this version does not know: "
            f"{json.dumps(body, sort_keys=True)[:200]}"
        )
    return tok


def build_tokenizer(
    cfg: TokenizerConfig, train_texts: Callable[[], Iterable[str]] | None
) -> Tokenizer:
    """The tokenizer a run's config asks for. `train_texts` yields the training sample for
    kind bpe (it is only called for bpe, so other kinds can pass None)."""
    if cfg.kind == "bytes":
        return byte_tokenizer()
    if cfg.kind == "file":
        assert cfg.path is not None  # enforced by TokenizerConfig
        return load_tokenizer(os.fspath(cfg.path))
    if cfg.kind == "bpe":
        assert cfg.vocab_size is not None  # enforced by TokenizerConfig
        if train_texts is None:
            raise ValueError("tokenizer kind bpe needs training texts, and none were given")
        # The caller spreads its sample over all shards; islice is only a hard cap so a
        # caller that hands over everything cannot blow past train_docs.
        texts = islice(train_texts(), cfg.train_docs)
        return train_bpe(texts, cfg.vocab_size, cfg.min_frequency)
    raise ValueError(f"unknown tokenizer kind {cfg.kind!r} (expected bytes, bpe or file)")
