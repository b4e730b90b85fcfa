"""Recipe options, each a config switch that is off by default: the extra LR schedules,
value and adaptive gradient clipping, label smoothing, early stopping on the validation loss
and an EMA of the weights. Each test checks that the switch does what it says, and that
the default leaves today's behaviour as it is."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.factories import train_config
from tests.support.host_sync import BUDGET, reads_per_step
from tests.support.host_sync import trainer as sync_trainer
from tests.support.trainer import config_error, train
from training import checkpoint as ckpt
from training.components.ema import Ema
from training.config import ScheduleConfig, parse_train_config
from training.loss import lm_loss, shift_targets
from training.metrics import read
from training.optim import agc_params, clip_grad_agc_
from training.schedule import lr_multiplier
from training.trainer import Trainer


# ---------------------------------------------------------------- schedules
def _sched(kind: str, **kw: Any) -> ScheduleConfig:
    return ScheduleConfig(kind=kind, **kw)


def test_default_schedule_is_todays_warmup_and_cosine_bit_for_bit():
    c, total = ScheduleConfig(), 1000
    assert c.kind == "cosine" and c.warmup_steps == 100 and c.min_lr_ratio == 0.1
    for step in [*range(0, 120), 500, 999, 1000, 1500]:
        if step < 100:
            want = (step + 1) / 100
        else:
            p = min(1.0, max(0.0, (step - 100) / (total - 100)))
            want = 0.1 + 0.5 * (1.0 + math.cos(math.pi * p)) * (1.0 - 0.1)
        assert lr_multiplier(step, total, c) == want, step


def test_step_decay():
    c = _sched("step", warmup_steps=4, gamma=0.5, step_size=10)
    assert [lr_multiplier(s, 100, c) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    for step in (4, 13, 14, 23, 24, 57, 100, 200):
        assert lr_multiplier(step, 100, c) == 0.5 ** ((step - 4) // 10), step
    assert lr_multiplier(13, 100, c) == 1.0 and lr_multiplier(14, 100, c) == 0.5


def test_exponential_decay_reaches_the_floor_geometrically():
    c = _sched("exponential", warmup_steps=10, min_lr_ratio=0.01)
    assert lr_multiplier(4, 110, c) == pytest.approx(0.5)  # warmup: (4 + 1) / 10
    for step in (10, 35, 60, 109):
        assert lr_multiplier(step, 110, c) == pytest.approx(0.01 ** ((step - 10) / 100))
    assert lr_multiplier(60, 110, c) == pytest.approx(0.1)  # halfway: sqrt(0.01)
    assert lr_multiplier(110, 110, c) == pytest.approx(0.01)
    assert lr_multiplier(500, 110, c) == pytest.approx(0.01)
    assert "schedule.min_lr_ratio: Value error, must be > 0 for kind exponential" in config_error(
        schedule={"kind": "exponential", "min_lr_ratio": 0.0}
    )


@pytest.mark.parametrize("power", [1.0, 2.0, 0.5])
def test_polynomial_decay(power):
    c = _sched("polynomial", warmup_steps=10, min_lr_ratio=0.1, power=power)
    assert lr_multiplier(9, 110, c) == 1.0
    for step in (10, 35, 60, 85, 110, 300):
        p = min(1.0, (step - 10) / 100)
        assert lr_multiplier(step, 110, c) == pytest.approx(0.1 + 0.9 * (1 - p) ** power)
    if power == 1.0:  # power 1 is the linear kind
        lin = _sched("linear", warmup_steps=10, min_lr_ratio=0.1)
        assert all(
            lr_multiplier(s, 110, c) == pytest.approx(lr_multiplier(s, 110, lin))
            for s in range(0, 120, 7)
        )


def test_onecycle_ramps_by_cosine_from_one_over_div_factor_then_anneals():
    c = _sched("onecycle", warmup_steps=10, min_lr_ratio=0.0, div_factor=25.0)
    for step in range(10):
        want = 0.04 + 0.96 * 0.5 * (1 - math.cos(math.pi * (step + 1) / 10))
        assert lr_multiplier(step, 110, c) == pytest.approx(want)
    assert lr_multiplier(0, 110, c) == pytest.approx(
        0.04 + 0.96 * 0.5 * (1 - math.cos(0.1 * math.pi))
    )
    assert lr_multiplier(9, 110, c) == pytest.approx(1.0)
    assert lr_multiplier(10, 110, c) == 1.0
    assert lr_multiplier(60, 110, c) == pytest.approx(0.5)
    assert lr_multiplier(110, 110, c) == pytest.approx(0.0)
    # The warmup is the only difference from cosine.
    cos = _sched("cosine", warmup_steps=10, min_lr_ratio=0.0)
    assert all(lr_multiplier(s, 110, c) == lr_multiplier(s, 110, cos) for s in range(10, 120))
    assert lr_multiplier(0, 110, c) != lr_multiplier(0, 110, cos)


NEW_KINDS = ("step", "exponential", "polynomial", "onecycle")


def test_new_kinds_stay_in_range():
    for kind in NEW_KINDS:
        for total in (1, 7, 100):
            c = _sched(kind, warmup_steps=3, min_lr_ratio=0.2, step_size=2, gamma=0.5, power=2.0)
            assert all(0.0 < lr_multiplier(s, total, c) <= 1.0 for s in range(total + 5))


@pytest.mark.parametrize(
    "schedule",
    [{}, *({"kind": k, "step_size": 2, "gamma": 0.5} for k in NEW_KINDS)],
    ids=["default", *NEW_KINDS],
)
def test_the_trainer_follows_the_schedule(train_dataset, tmp_path, schedule):
    """The logged LR of each step is the peak LR times lr_multiplier, the default's
    included (today's warmup + cosine, bit for bit)."""
    assert train(train_dataset, tmp_path, schedule=schedule) == 0
    c = parse_train_config(train_config(train_dataset, tmp_path, schedule=schedule)).schedule
    lrs = [r["lr"] for r in read(tmp_path / "metrics.jsonl") if r.get("kind") == "train"]
    assert lrs == [1e-3 * lr_multiplier(k, 6, c) for k in range(6)]
    if not schedule:
        want = [1e-3 * (k + 1) / 2 for k in range(2)] + [
            1e-3 * (0.1 + 0.5 * (1.0 + math.cos(math.pi * (k - 2) / 4)) * 0.9) for k in range(2, 6)
        ]
        assert lrs == want


# ---------------------------------------------------------------- clipping
def test_agc_clips_rows_above_the_unit_wise_limit_and_leaves_the_rest():
    lin = nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 1e-5]]))
    grad = torch.tensor([[0.3, 0.0, 0.4], [1e-4, 0.0, 0.0]])
    lin.weight.grad = grad.clone()
    clip_grad_agc_([lin.weight], clip=0.05, eps=1e-3)
    g = lin.weight.grad
    # Row 0: ||g|| = 0.5 > 0.05 * ||w|| = 0.25, so it is scaled to norm 0.25.
    assert torch.allclose(g[0], grad[0] * 0.5)
    assert g[0].norm().item() == pytest.approx(0.25)
    # Row 1: ||w|| is below eps, so the limit is 0.05 * 1e-3 = 5e-5 < 1e-4: clipped to it.
    assert g[1].norm().item() == pytest.approx(5e-5)
    # Below the limit (row 0: 0.05 < 0.5 * 5; row 1: a zero gradient): untouched.
    below = torch.tensor([[0.03, 0.0, 0.04], [0.0, 0.0, 0.0]])
    lin.weight.grad = below.clone()
    clip_grad_agc_([lin.weight], clip=0.5, eps=1e-3)
    assert torch.equal(lin.weight.grad, below)


def _step_grads(dataset: str, run_dir: Path, **over: Any) -> dict[str, torch.Tensor]:
    """The gradients one training step hands the optimizer (after clipping)."""
    t = Trainer(parse_train_config(train_config(dataset, run_dir, **over)))
    names = {p: n for n, p in t.model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def grab(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                seen[names[p]] = p.grad.detach().clone()

    t.optimizer.register_step_pre_hook(grab)
    try:
        t.train_step()
    finally:
        t.loader.close()
        t.ckpts.close()
    return seen


def test_value_and_adaptive_clipping_in_the_training_step(train_dataset, tmp_path):
    free = {"optim": {"grad_clip": None}}
    base = _step_grads(train_dataset, tmp_path / "base", **free)
    value = _step_grads(
        train_dataset, tmp_path / "v", optim={"grad_clip": None, "clip_value": 1e-3}
    )
    for n, g in base.items():
        assert torch.equal(value[n], g.clamp(-1e-3, 1e-3)), n
    assert any((g.abs() > 1e-3).any() for g in base.values())  # it did clip something

    t = Trainer(parse_train_config(train_config(train_dataset, tmp_path / "w")))
    weights = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    hidden = {
        n
        for n, p in t.model.named_parameters()
        if t.model.param_kind(n) == "hidden" and p.ndim == 2
    }
    assert {id(p) for p in agc_params(t.model)} == {
        id(p) for n, p in t.model.named_parameters() if n in hidden
    }
    t.loader.close()
    t.ckpts.close()
    agc = _step_grads(train_dataset, tmp_path / "a", optim={"grad_clip": None, "agc": 0.01})
    clipped_rows = 0
    for n, g in base.items():
        if n not in hidden:  # embeddings, norms, head: untouched
            assert torch.equal(agc[n], g), n
            continue
        limit = 0.01 * weights[n].norm(dim=1).clamp_min(1e-3)
        over = g.norm(dim=1) > limit
        clipped_rows += int(over.sum())
        assert torch.allclose(agc[n].norm(dim=1)[over], limit[over], rtol=1e-5), n
        assert torch.equal(agc[n][~over], g[~over]), n
    assert clipped_rows > 0


def test_clipping_and_recipe_options_add_no_host_reads(train_dataset, tmp_path):
    """The step's one host transfer stays one with every recipe option on."""
    over = {
        "optim": {"agc": 0.01, "clip_value": 0.5},
        "label_smoothing": 0.1,
        "ema": {"decay": 0.9},
        "early_stopping": {"patience": 2},
    }
    one, ours1, _ = reads_per_step(sync_trainer(train_dataset, tmp_path / "1", 1, **over), 4)
    four, ours4, _ = reads_per_step(sync_trainer(train_dataset, tmp_path / "4", 4, **over), 4)
    assert one == four
    assert ours1 == ours4 == [BUDGET] * 4


# ---------------------------------------------------------------- label smoothing
def _tiny_logits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    seg = torch.tensor([[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]])
    targets, valid = shift_targets(ids, seg)
    return logits, targets, valid


def test_label_smoothing_is_the_closed_form():
    logits, targets, valid = _tiny_logits()
    e = 0.1
    total, ce, z = lm_loss(logits, targets, valid, 0.0, label_smoothing=e)
    logp = logits.log_softmax(-1)[valid]
    t = targets[valid]
    want = ((1 - e) * -logp.gather(-1, t[:, None]).squeeze(-1) - e * logp.mean(-1)).mean()
    assert total.item() == pytest.approx(want.item(), rel=1e-6)
    assert total.item() == pytest.approx(
        F.cross_entropy(logits[valid], t, label_smoothing=e).item(), rel=1e-6
    )
    assert ce.item() == pytest.approx(F.cross_entropy(logits[valid], t).item(), rel=1e-6)
    assert z.item() == 0.0
    with_z, _, zz = lm_loss(logits, targets, valid, 1e-4, label_smoothing=e)
    assert with_z.item() == pytest.approx((total + zz).item(), rel=1e-6)


def test_label_smoothing_zero_is_bit_identical():
    logits, targets, valid = _tiny_logits()
    a = lm_loss(logits, targets, valid, 1e-4)
    b = lm_loss(logits, targets, valid, 1e-4, label_smoothing=0.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(a[0], a[1] + a[2])  # today's total = ce + z


def test_label_smoothing_changes_the_training_loss_only(train_dataset, tmp_path):
    assert train(train_dataset, tmp_path / "a", steps=1, eval_every=1) == 0
    assert train(train_dataset, tmp_path / "b", steps=1, eval_every=1, label_smoothing=0.2) == 0
    a, b = (read(tmp_path / r / "metrics.jsonl") for r in "ab")
    ta, tb = (next(r for r in recs if r.get("kind") == "train") for recs in (a, b))
    assert ta["ce"] == tb["ce"]  # the same weights at step 0: the plain CE is the same
    assert ta["loss"] != tb["loss"]
    config_error(label_smoothing=1.0)  # must be < 1


# ---------------------------------------------------------------- early stopping
def test_early_stopping_ends_the_run_with_exit_0_and_says_why(train_dataset, tmp_path):
    """min_delta 10 nats: no evaluation after the first can count as an improvement, so
    with patience 2 and an evaluation every 2 steps the run stops at step 6 of 30."""
    run = tmp_path / "run"
    over = {
        "steps": 30,
        "eval_every": 2,
        "checkpoint": {"every": 10},
        "early_stopping": {"patience": 2, "min_delta": 10.0},
    }
    assert train(train_dataset, run, **over) == 0
    recs = read(run / "metrics.jsonl")
    assert max(r["step"] for r in recs if r.get("kind") == "train") == 6
    stops = [r for r in recs if r.get("event") == "early_stop"]
    assert len(stops) == 1
    assert stops[0]["step"] == 6 and stops[0]["best_step"] == 2
    assert stops[0]["reason"] == "early_stopping" and stops[0]["patience"] == 2
    final = json.loads((run / "final.json").read_text())
    assert final["step"] == 6
    assert final["early_stopping"]["best_step"] == 2
    assert final["checkpoint"].endswith(ckpt.step_name(6))
    assert ckpt.latest_step(run / "checkpoints") == 6
    # Launched again (a restart), it resumes at the stop and ends at once.
    assert train(train_dataset, run, **over) == 0
    again = read(run / "metrics.jsonl")
    assert max(r["step"] for r in again if r.get("kind") == "train") == 6
    # Off by default: the same run trains all 30 steps.
    assert train(train_dataset, tmp_path / "off", **{**over, "early_stopping": None}) == 0
    off = read(tmp_path / "off" / "metrics.jsonl")
    assert max(r["step"] for r in off if r.get("kind") == "train") == 30
    assert not any(r.get("event") == "early_stop" for r in off)
    assert "early_stopping" not in json.loads((tmp_path / "off" / "final.json").read_text())
    assert "early_stopping.patience: " in config_error(early_stopping={"min_delta": 0.1})


# ---------------------------------------------------------------- EMA
def test_ema_follows_the_lerp_after_each_step(train_dataset, tmp_path):
    decay = 0.8
    t = Trainer(parse_train_config(train_config(train_dataset, tmp_path, ema={"decay": decay})))
    try:
        params = list(t.model.parameters())
        want = [p.detach().clone() for p in params]
        ema = t.component("ema")
        assert isinstance(ema, Ema)
        assert all(torch.equal(e, w) for e, w in zip(ema.shadow, want, strict=True))
        for _ in range(3):
            out = t.train_step()
            assert out.decision is not None and out.decision.action == "ok"
            want = [w + (1 - decay) * (p.detach() - w) for w, p in zip(want, params, strict=True)]
            t.state.step += 1
            t.state.samples_seen += out.samples
        for e, w in zip(ema.shadow, want, strict=True):
            assert torch.allclose(e, w, rtol=0, atol=1e-7)
        assert any(not torch.equal(e, p) for e, p in zip(ema.shadow, params, strict=True))
        # Evaluating the EMA leaves the training weights as they were, bit for bit.
        before = [p.detach().clone() for p in params]
        ema_val, val = ema.evaluate(), t.evaluate()
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        assert ema_val != val and math.isfinite(ema_val)
    finally:
        t.loader.close()
        t.ckpts.close()


def test_ema_is_evaluated_checkpointed_and_resumed_exactly(train_dataset, tmp_path):
    over = {"ema": {"decay": 0.9}, "schedule": {"kind": "constant"}}
    assert train(train_dataset, tmp_path / "a", steps=3, **over) == 0
    assert train(train_dataset, tmp_path / "a", steps=6, **over) == 0
    assert train(train_dataset, tmp_path / "b", steps=6, **over) == 0
    sa = ckpt.load(tmp_path / "a" / "checkpoints", 6)
    sb = ckpt.load(tmp_path / "b" / "checkpoints", 6)
    assert sa["ema"] and all(isinstance(t, torch.Tensor) for t in sa["ema"])
    assert all(torch.equal(x, y) for x, y in zip(sa["ema"], sb["ema"], strict=True))
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
    evals = [r for r in read(tmp_path / "b" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(
        math.isfinite(r["ema_val_loss"]) and r["ema_val_loss"] != r["val_loss"] for r in evals
    )
    # Off by default: no EMA in the checkpoint or the log.
    assert train(train_dataset, tmp_path / "c", steps=3) == 0
    assert "ema" not in ckpt.load(tmp_path / "c" / "checkpoints", 3)
    assert all("ema_val_loss" not in r for r in read(tmp_path / "c" / "metrics.jsonl"))
    assert "ema.decay: " in config_error(ema={"decay": 1.0})
