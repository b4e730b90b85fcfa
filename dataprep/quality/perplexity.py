"""`perplexity`: score each document with a small causal language model trained on
reference text, record the score as `perplexity` in the kept document's metadata, and
drop documents whose perplexity is above `max` (or below `min`).

This is the "small reference model" method of data selection: a model trained on text you
trust (Wikipedia for CCNet and Gopher, WebText for GPT-3's filter, the kept data of an
earlier run) finds text unlike it surprising. CCNet scores with a KenLM 5-gram model on
Wikipedia and buckets by perplexity; here the model is a transformer, so Ballast's own
trainer makes it: `ballast train` on a reference dataset, `ballast export hf` on its
checkpoint, then point `model:` at the export. Any causal LM directory that transformers
loads offline (`AutoModelForCausalLM` + `AutoTokenizer`) works the same way.

Perplexity is exp(mean negative log-likelihood) of the document's tokens after the first,
over its first `max_tokens` tokens, and never more than the model's context (the sequence
length it was trained at): a long page is judged by its opening, and the cost per
document stays bounded. Documents are
scored in batches of `batch_size`, sorted by length to waste little on padding, on CUDA
when present (`device: auto`), else on the CPU. A document of fewer than two tokens has
no score and is kept.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dataprep.quality.base import Drop, Rule, RuleParams, Verdict, fmt
from dataprep.quality.text import Doc


class PerplexityParams(RuleParams):
    model: str = Field(
        min_length=1,
        description=(
            "A transformers model directory (config.json, weights, tokenizer), e.g. the "
            "output of `ballast export hf CHECKPOINT DIR` (a checkpoint itself is refused with "
            "that hint)."
        ),
    )
    max: float | None = Field(
        default=None,
        gt=1,
        description=(
            "Drop above (`perplexity:too_high`: surprising, unlike the reference); off by default."
        ),
    )
    min: float | None = Field(
        default=None,
        ge=1,
        description=(
            "Drop below (`perplexity:too_low`): CCNet's lowest buckets are often repeated "
            "boilerplate the model has seen; off by default."
        ),
    )
    max_tokens: int = Field(
        default=512,
        ge=2,
        description=(
            "Tokens scored per document, from its start (never more than the model's context)."
        ),
    )
    batch_size: int = Field(
        default=16, ge=1, description=("Documents scored at a time, sorted by length.")
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description=("`auto`: CUDA when present.")
    )

    @field_validator("model")
    @classmethod
    def _loadable(cls, v: str) -> str:
        p = Path(v)
        if not (p / "config.json").is_file():
            hint = (
                f" (a Ballast checkpoint: export it first with `ballast export hf {v} DIR`)"
                if (p / "latest").exists()
                or p.name.startswith("step-")
                or (p / "checkpoints").is_dir()
                else ""
            )
            raise ValueError(f"{v} is not a transformers model directory (no config.json)" + hint)
        return v

    @model_validator(mode="after")
    def _range(self) -> PerplexityParams:
        if self.max is not None and self.min is not None and self.min >= self.max:
            raise ValueError(f"min {self.min} must be below max {self.max}")
        return self


@lru_cache(maxsize=2)
def load(path: str, device: str, stamp: float) -> tuple[Any, Any, Any]:
    """(model, tokenizer, torch device), loaded once per process and model file version
    (`stamp`: config.json's mtime)."""
    del stamp
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ValueError(
            "the `perplexity` rule needs torch and transformers (pip install 'ballast-lm[hf]')"
        ) from None
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.to(dev).eval()
    return model, tok, dev


def context(model: Any) -> int:
    """The longest sequence the model was trained for (its position limit)."""
    c = model.config
    n = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
    return int(n) if n else 1 << 30


def perplexities(
    texts: list[str],
    model_dir: str,
    max_tokens: int = 512,
    batch_size: int = 16,
    device: str = "auto",
) -> list[float | None]:
    """The perplexity of each text (None for fewer than two tokens), batched."""
    import torch

    stamp = os.stat(Path(model_dir) / "config.json").st_mtime
    model, tok, dev = load(model_dir, device, stamp)
    limit = min(max_tokens, context(model))
    ids = tok(texts, add_special_tokens=False, truncation=True, max_length=limit)["input_ids"]
    out: list[float | None] = [None] * len(texts)
    order = sorted((i for i in range(len(ids)) if len(ids[i]) >= 2), key=lambda i: len(ids[i]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    with torch.inference_mode():
        for k in range(0, len(order), batch_size):
            batch = order[k : k + batch_size]
            width = len(ids[batch[-1]])
            x = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):
                x[r, : len(ids[i])] = torch.tensor(ids[i])
                mask[r, : len(ids[i])] = 1
            x, mask = x.to(dev), mask.to(dev)
            logits = model(input_ids=x, attention_mask=mask).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none"
            )
            m = mask[:, 1:].float()
            mean = ((nll * m).sum(1) / m.sum(1)).tolist()  # one copy per batch
            for r, i in enumerate(batch):
                out[i] = math.exp(mean[r])
    return out


class Perplexity(Rule[PerplexityParams]):
    """Records `perplexity` (4 significant digits) in `doc.annotations`; drops with
    `perplexity:too_high` above `max` and `perplexity:too_low` below `min`."""

    name = "perplexity"
    Params = PerplexityParams

    def apply(self, doc: Doc) -> Verdict:
        return self.apply_batch([doc])[0]

    def apply_batch(self, docs: list[Doc]) -> list[Verdict]:
        p = self.params
        scores = perplexities([d.text for d in docs], p.model, p.max_tokens, p.batch_size, p.device)
        return [self._verdict(d, s) for d, s in zip(docs, scores, strict=True)]

    def _verdict(self, doc: Doc, ppl: float | None) -> Verdict:
        if ppl is None:
            return None
        doc.annotations["perplexity"] = float(f"{ppl:.4g}")
        if self.params.max is not None and ppl > self.params.max:
            return Drop("too_high", f"perplexity={fmt(ppl)} > {self.params.max}")
        if self.params.min is not None and ppl < self.params.min:
            return Drop("too_low", f"perplexity={fmt(ppl)} < {self.params.min}")
        return None
