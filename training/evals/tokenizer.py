"""Text -> token ids with the dataset's own tokenizer (the file its manifest names): what
the model was trained on is what it is evaluated with. `training` does not import
`dataprep`, so this reads the file itself: Ballast's byte tokenizer (id = UTF-8 byte) or a
HF `tokenizer.json` through `tokenizers`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Ballast's byte tokenizer file says so (dataprep/tokenizer.py writes it).
_BYTES_MARKER = "ballast_tokenizer"


@dataclass(frozen=True)
class EvalTokenizer:
    eos_id: int
    _hf: Any = None  # tokenizers.Tokenizer; None: bytes

    def encode(self, text: str) -> list[int]:
        if self._hf is None:
            return list(text.encode("utf-8"))
        return list(self._hf.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._hf is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [list(e.ids) for e in self._hf.encode_batch(texts, add_special_tokens=False)]


def from_json(text: str, eos_id: int) -> EvalTokenizer:
    if _BYTES_MARKER in json.loads(text):
        return EvalTokenizer(eos_id)
    from tokenizers import Tokenizer

    return EvalTokenizer(eos_id, Tokenizer.from_str(text))


def dataset_tokenizer(root: Path, manifest: dict[str, Any]) -> EvalTokenizer:
    """The tokenizer of the local dataset version at `root`."""
    info = manifest["tokenizer"]
    path = root / info["file"]
    try:
        return from_json(path.read_text(encoding="utf-8"), int(info["eos_id"]))
    except (OSError, ValueError) as e:
        raise ValueError(f"the dataset's tokenizer {path} cannot be read: {e}") from None
