"""Scoring: the log-likelihood of token sequences under the model, batched and shared out
over ranks, and the metrics made from it.

A multiple-choice item is scored by ranked classification, as OLMo's in-loop evaluator and
lm-evaluation-harness do: each choice is a continuation of its context, and the choice with
the highest log-likelihood wins (`acc`), or the highest per character of the continuation
(`acc_per_char`: OLMo's len_norm, lm-eval's acc_norm) or per token (`acc_per_token`).
`bpb` is the gold continuation's bits per UTF-8 byte. A context and its continuation are
tokenized as lm-eval does (`_encode_pair`): trailing spaces of the context move to the
continuation, the pair is encoded whole and the continuation's tokens are what follows
the context's own encoding; the sequence keeps its last seq_len + 1 tokens.

A text set is scored as bits per byte: each document, after an EOS, is cut into
non-overlapping windows of seq_len predicted tokens (lm-eval's rolling log-likelihood with
no overlap); bpb = the set's bits / its UTF-8 bytes (a ratio estimator, with its standard
error).

Sharing out: the sequences, longest first, go round-robin to the ranks, each rank's share
padded to the same count (FSDP needs every rank in every forward pass); each rank fills in
its sequences' sums and one all-reduce adds them up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from training.evals.tasks import EvalDataError, Item, Task, TextSet
from training.evals.tokenizer import EvalTokenizer

LN2 = math.log(2.0)
Forward = Callable[[torch.Tensor], torch.Tensor]  # input ids (B, T) -> logits (B, T, V)


@dataclass(frozen=True)
class Seq:
    """Token ids (the input and the targets: ids[1:]) and how many final targets count."""

    ids: list[int]
    scored: int


def encode_pair(tok: EvalTokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair`: (context ids, continuation ids)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    return ctx, whole[len(ctx) :]


def pair_seq(ctx: list[int], cont: list[int], eos_id: int, seq_len: int) -> Seq:
    if not cont:
        raise ValueError("an empty continuation")
    if len(cont) > seq_len:
        raise ValueError(f"a continuation of {len(cont)} tokens is longer than seq_len {seq_len}")
    ids = (ctx or [eos_id]) + cont  # an empty context is conditioned on EOS, as lm-eval does
    return Seq(ids[-(seq_len + 1) :], len(cont))


@dataclass
class EncodedTask:
    task: Task
    items: list[Item]  # those scored: every choice fits the model's context
    seqs: list[Seq]  # every scored item's choices, in order
    offsets: np.ndarray  # item i's choices are seqs[offsets[i]:offsets[i + 1]]
    chars: np.ndarray  # each continuation's characters (after _encode_pair's move)
    bytes_: np.ndarray  # ... and UTF-8 bytes
    skipped: int = 0  # items left out: a choice longer than seq_len tokens


def encode_task(task: Task, tok: EvalTokenizer, seq_len: int) -> EncodedTask:
    """The task's items as sequences. An item with a choice of more than seq_len tokens
    cannot be scored whole (its first tokens would have no room to be predicted from the
    context), and cutting it would compare choices on different text: it is left out and
    counted, as the same items are at every evaluation."""
    items: list[Item] = []
    seqs, chars, nbytes, offsets = [], [], [], [0]
    for item in task.items:
        pairs = [encode_pair(tok, c, cont) for c, cont in item.choices]
        if any(len(cont) > seq_len for _, cont in pairs):
            continue
        items.append(item)
        for (ctx, cont), (_, continuation) in zip(pairs, item.choices, strict=True):
            seqs.append(pair_seq(ctx, cont, tok.eos_id, seq_len))
            # OLMo and lm-eval normalise by the continuation string as given.
            chars.append(len(continuation))
            nbytes.append(len(continuation.encode("utf-8")))
        offsets.append(len(seqs))
    if not items:
        raise EvalDataError(
            f"evals task {task.name}: no item fits the model's context: every one has a "
            f"choice longer than seq_len {seq_len} tokens"
        )
    return EncodedTask(
        task,
        items,
        seqs,
        np.asarray(offsets, np.int64),
        np.asarray(chars, np.float64),
        np.asarray(nbytes, np.float64),
        len(task.items) - len(items),
    )


@dataclass
class EncodedText:
    text: TextSet
    seqs: list[Seq]
    doc_of: np.ndarray  # the document of each window
    bytes_: np.ndarray  # UTF-8 bytes per document
    tokens: int


def encode_text(text: TextSet, tok: EvalTokenizer, seq_len: int) -> EncodedText:
    seqs, doc_of = [], []
    tokens = 0
    for d, ids in enumerate(tok.encode_batch(text.docs)):
        ids = [tok.eos_id, *ids]
        tokens += len(ids) - 1
        for start in range(0, len(ids) - 1, seq_len):
            w = ids[start : start + seq_len + 1]
            seqs.append(Seq(w, len(w) - 1))
            doc_of.append(d)
    nbytes = np.asarray([len(t.encode("utf-8")) for t in text.docs], np.float64)
    return EncodedText(text, seqs, np.asarray(doc_of, np.int64), nbytes, tokens)


# -- the forward passes ------------------------------------------------------------------


def _rank_share(lengths: Sequence[int], rank: int, size: int) -> list[int]:
    """This rank's sequence indices (longest first, round-robin), padded with -1 to the
    count every rank gets."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    mine = order[rank::size]
    per_rank = -(-len(order) // size) if order else 0
    return mine + [-1] * (per_rank - len(mine))


@torch.no_grad()
def logprob_sums(
    forward: Forward,
    seqs: Sequence[Seq],
    batch_size: int,
    device: torch.device,
    rank: int = 0,
    size: int = 1,
    group: Any = None,
) -> np.ndarray:
    """Each sequence's summed log-probability of its scored targets (float64), the same on
    every rank. `rank`/`size`: this rank's data-parallel position (the ranks of one
    tensor-parallel group share it and run the same batches together); `group`: the
    data-parallel process group the sums are added over (None: every rank)."""
    out = torch.zeros(len(seqs), dtype=torch.float64, device=device)
    share = _rank_share([len(s.ids) for s in seqs], rank, size)
    pad = seqs[min(range(len(seqs)), key=lambda i: len(seqs[i].ids))] if seqs else None
    for b in range(0, len(share), batch_size):
        idx = share[b : b + batch_size]
        batch = [seqs[i] if i >= 0 else pad for i in idx]
        assert all(s is not None for s in batch)
        width = max(len(s.ids) for s in batch if s is not None) - 1
        # Right padding: causal attention keeps every real position blind to it.
        inp = torch.zeros(len(batch), width, dtype=torch.long)
        tgt = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        for r, s in enumerate(batch):
            assert s is not None
            n = len(s.ids) - 1
            inp[r, :n] = torch.tensor(s.ids[:-1])
            tgt[r, :n] = torch.tensor(s.ids[1:])
            mask[r, n - s.scored : n] = True
        inp, tgt, mask = inp.to(device), tgt.to(device), mask.to(device)
        logits = forward(inp).float()
        lp = logits.gather(-1, tgt[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
        sums = (lp.double() * mask).sum(dim=1)
        real = torch.tensor([i >= 0 for i in idx], device=device)
        where = torch.tensor([max(i, 0) for i in idx], device=device)
        out.index_add_(0, where[real], sums[real])
    if size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.cpu().numpy()


# -- metrics -----------------------------------------------------------------------------


def stderr(values: np.ndarray) -> float:
    """The standard error of a mean (lm-eval's: sample stddev / sqrt(n))."""
    n = len(values)
    return float(np.std(values, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")


@dataclass
class Scores:
    """One task's or text set's numbers: metric -> value and its standard error, and the
    per-item values regressions are judged on (the same items at every evaluation)."""

    name: str
    values: dict[str, float]
    stderrs: dict[str, float]
    per_item: dict[str, np.ndarray]
    n: int

    def record_fields(self) -> dict[str, float]:
        out: dict[str, float] = {f"{self.name}/n": float(self.n)}
        for k, v in self.values.items():
            out[f"{self.name}/{k}"] = v
            out[f"{self.name}/{k}_stderr"] = self.stderrs[k]
        return out


def task_scores(enc: EncodedTask, sums: np.ndarray) -> Scores:
    ntok = np.asarray([s.scored for s in enc.seqs], np.float64)
    per: dict[str, list[float]] = {"acc": [], "acc_per_char": [], "acc_per_token": [], "bpb": []}
    for i, item in enumerate(enc.items):
        a, b = enc.offsets[i], enc.offsets[i + 1]
        ll = sums[a:b]
        per["acc"].append(float(np.argmax(ll) == item.gold))
        per["acc_per_char"].append(float(np.argmax(ll / enc.chars[a:b]) == item.gold))
        per["acc_per_token"].append(float(np.argmax(ll / ntok[a:b]) == item.gold))
        per["bpb"].append(-ll[item.gold] / enc.bytes_[a + item.gold] / LN2)
    arrays = {k: np.asarray(v) for k, v in per.items()}
    return Scores(
        enc.task.name,
        {k: float(v.mean()) for k, v in arrays.items()},
        {k: stderr(v) for k, v in arrays.items()},
        arrays,
        len(enc.items),
    )


def text_scores(enc: EncodedText, sums: np.ndarray) -> Scores:
    bits = np.zeros(len(enc.text.docs))
    np.add.at(bits, enc.doc_of, -sums / LN2)
    n = len(bits)
    bpb = float(bits.sum() / enc.bytes_.sum())
    mean_bytes = float(enc.bytes_.mean())
    # The ratio estimator's standard error: residuals of each document's bits against
    # bpb x its bytes.
    resid = bits - bpb * enc.bytes_
    se = float(math.sqrt((resid**2).sum() / (n * (n - 1))) / mean_bytes) if n > 1 else float("nan")
    # Per document, scaled so that their mean is the set's bpb: a paired difference of two
    # evaluations then averages to the difference of their bpb.
    return Scores(enc.text.name, {"bpb": bpb}, {"bpb": se}, {"bpb": bits / mean_bytes}, n)
