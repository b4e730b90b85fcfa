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
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
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

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """One int32 array per text, without any special tokens."""
        if self._hf is None:
            return _encode_bytes(texts)
        # encode_batch_fast (newer tokenizers) skips offset tracking, which we never use.
        enc = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        return [np.asarray(e.ids, dtype=np.int32) for e in enc(texts, add_special_tokens=False)]

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
    return Tokenizer(kind, vocab_size, eos_id, pad_id, hf, text)


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
