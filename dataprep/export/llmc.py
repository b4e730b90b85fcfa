"""llm.c's token shards (dev/data/data_common.py `write_datafile`, read by
llmc/dataloader.h and modded-nanogpt): a header of 256 int32 (magic, version, token
count), then the tokens, uint16 for a vocabulary that fits ("gpt-2": magic 20240520,
version 1) else uint32 ("llama-3": magic 20240801, version 7).

llm.c's tokenizing scripts put the end-of-text token *before* each document (fineweb.py:
`tokens = [eot]; tokens.extend(encode(text))`), where Ballast's tokenizer puts EOS after
it; each sequence is written as EOS followed by its tokens without their final EOS, so a
split of whole documents is exactly the stream llm.c's own scripts make of them. Shards
are cut at `shard_tokens` (fineweb.py's 10**8), mid-document as fineweb.py cuts them.
nanoGPT's `np.memmap(path, dtype=np.uint16, mode="r")` reads the same tokens with
`offset=1024` (its own prepare scripts write no header)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dataprep.export.rows import Sequences

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# model_desc -> (magic, version, token dtype), as data_common.py's HEADERS_INFO.
HEADERS = {
    "gpt-2": (20240520, 1, np.dtype(np.uint16)),
    "llama-3": (20240801, 7, np.dtype(np.uint32)),
}
SHARD_TOKENS = 10**8
MAX_SHARD_TOKENS = 2**31 - 1  # the header's count is an int32
# llm.c's split names (fineweb_train_000001.bin, fineweb_val_000000.bin).
SPLIT_NAMES = {"train": "train", "validation": "val"}


def model_desc(vocab_size: int) -> str:
    return "gpt-2" if vocab_size <= 1 << 16 else "llama-3"


def header(desc: str, ntok: int) -> bytes:
    magic, version, _ = HEADERS[desc]
    h = np.zeros(HEADER_INTS, dtype=np.int32)
    h[0], h[1], h[2] = magic, version, ntok
    return h.tobytes()


def llmc_stream(s: Sequences, eos_id: int) -> np.ndarray:
    """The tokens of `s` as llm.c lays documents out: EOS, then each sequence without the
    EOS it ends with (a cut piece, which has none, keeps all its tokens)."""
    ends = np.cumsum(s.lengths)
    starts = ends - s.lengths
    drop = np.zeros(s.tokens.size, dtype=bool)
    last = ends[s.tokens[ends - 1] == eos_id] - 1
    drop[last] = True
    kept = s.tokens[~drop]
    # Where each sequence starts in `kept`: its start less the EOS dropped before it.
    dropped_before = np.cumsum(drop)[starts] - drop[starts]
    return np.insert(kept, starts - dropped_before, eos_id)


class _Shards:
    """Writes a token stream into numbered shards of at most `limit` tokens, the header's
    count filled in when a shard is closed."""

    def __init__(self, out: Path, name: str, desc: str, limit: int):
        self.out, self.name, self.desc, self.limit = out, name, desc, limit
        self.dtype = HEADERS[desc][2]
        self.files: list[str] = []
        self._f: BinaryIO | None = None
        self._n = 0

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self._f is None:
                rel = f"{self.name}_{len(self.files):06d}.bin"
                self.files.append(rel)
                self._f = open(self.out / rel, "wb")  # noqa: SIM115 (closed in close())
                self._f.write(header(self.desc, 0))
                self._n = 0
            take = min(tokens.size, self.limit - self._n)
            self._f.write(tokens[:take].astype(self.dtype).tobytes())
            self._n += take
            tokens = tokens[take:]
            if self._n == self.limit:
                self.close()

    def close(self) -> None:
        if self._f is not None:
            self._f.seek(0)
            self._f.write(header(self.desc, self._n))
            self._f.close()
            self._f = None


def write_split(
    out: Path,
    split: str,
    seqs: Iterator[Sequences],
    vocab_size: int,
    eos_id: int,
    shard_tokens: int = SHARD_TOKENS,
) -> dict[str, Any]:
    """OUT/<train|val>_NNNNNN.bin from the split's sequences (no file for an empty split:
    llm.c's loader refuses a shard without tokens)."""
    if not 0 < shard_tokens <= MAX_SHARD_TOKENS:
        raise ValueError(f"shard_tokens must be in 1..{MAX_SHARD_TOKENS}, got {shard_tokens}")
    desc = model_desc(vocab_size)
    shards = _Shards(out, SPLIT_NAMES.get(split, split), desc, shard_tokens)
    count = tokens = cut = 0
    try:
        for s in seqs:
            stream = llmc_stream(s, eos_id)
            shards.write(stream)
            count += s.lengths.size
            tokens += stream.size
            cut += s.cut
    finally:
        shards.close()
    magic, version, dtype = HEADERS[desc]
    return {
        "files": shards.files,
        "model_desc": desc,
        "magic": magic,
        "version": version,
        "dtype": dtype.name,
        "documents": count,
        "cut_pieces": cut,
        "tokens": tokens,
    }
