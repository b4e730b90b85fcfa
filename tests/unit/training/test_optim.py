"""Optimizers and schedules: parameter grouping (weight decay, muP lr scales), every optimizer
actually trains, Lion's update against a hand computation, Muon+AdamW as one optimizer (split,
GradScaler, state_dict), bitwise-exact resume, and the schedule/batch-warmup formulas."""

from __future__ import annotations

import copy
import io
import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.nn import functional as F

from training.config import OptimConfig, ScheduleConfig
from training.optim import (
    OPTIMIZERS,
    Lion,
    MuonWithAdamW,
    build_optimizer,
    param_groups,
    register,
)
from training.schedule import accum_steps_at, lr_multiplier, set_lr

VOCAB, D, HIDDEN = 32, 16, 32
NAMES = ("adamw", "lion", "adafactor", "muon")
# Per-optimizer lrs that train the tiny model in ~100 steps (Lion's is ~3x below AdamW's,
# Adafactor's lr caps a step relative to RMS(param)).
TRAIN_CFG: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-2},
    "lion": {"lr": 3e-3},
    "adafactor": {"lr": 1e-2},
    "muon": {"lr": 1e-2, "muon_lr": 0.02},
}


class TinyLM(nn.Module):
    """Stand-in for training.model: one pre-norm MLP block, untied head, and the two attributes
    the optimizers read (`param_kind`, `width_mult`)."""

    def __init__(self, width_mult: float = 1.0) -> None:
        super().__init__()
        self.width_mult = width_mult
        self.emb = nn.Embedding(VOCAB, D)
        self.norm1 = nn.RMSNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D)
        self.norm_f = nn.RMSNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def param_kind(self, name: str) -> str:
        if name.startswith("emb."):
            return "embedding"
        if name.startswith("norm"):
            return "norm"
        if name.endswith(".bias"):
            return "bias"
        if name.startswith("head."):
            return "output"
        return "hidden"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        return self.head(self.norm_f(x))


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # The tensors are tiny: extra intra-op threads only add barriers, which stall badly when
    # another process holds a core (seen: 40x slower). Restored for the other test modules.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed, learnable task: predict a fixed permutation of the input token."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (8, 12), generator=g)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
    return ids, perm[ids]


def _loss(model: TinyLM, step: int) -> torch.Tensor:
    ids, tgt = _batch(step)
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), tgt.reshape(-1))


SCHED = ScheduleConfig(kind="cosine", warmup_steps=2, min_lr_ratio=0.1)


def _train_step(
    model: TinyLM, opt: torch.optim.Optimizer, step: int, batch: int | None = None, total: int = 100
) -> float:
    set_lr(opt, step, total, SCHED)
    opt.zero_grad(set_to_none=True)
    loss = _loss(model, step if batch is None else batch)
    loss.backward()
    opt.step()
    return loss.item()


def _model(seed: int = 0, width_mult: float = 1.0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(width_mult)


# ---------------------------------------------------------------- grouping


def test_groups_weight_decay_and_partition() -> None:
    model = _model()
    cfg = OptimConfig(weight_decay=0.05)
    groups = param_groups(model, cfg)
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each exactly once
    kinds = {n: model.param_kind(n) for n, _ in model.named_parameters()}
    by_id = {id(p): kinds[n] for n, p in model.named_parameters()}
    assert {g["kind"] for g in groups} == {"embedding", "norm", "bias", "hidden", "output"}
    for g in groups:
        assert {by_id[id(p)] for p in g["params"]} == {g["kind"]}
        assert g["weight_decay"] == (0.05 if g["kind"] in ("hidden", "output") else 0.0)
        assert g["lr_scale"] == 1.0 and g["initial_lr"] == g["lr"] == cfg.lr
        assert isinstance(g["name"], str)
    assert groups[0]["kind"] == "embedding"  # set_lr logs group 0: an unscaled group


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_groups_keep_decay(name: str) -> None:
    opt = build_optimizer(_model(), OptimConfig(name=name, weight_decay=0.07))
    for g in opt.param_groups:
        assert g["weight_decay"] == (0.07 if g["kind"] in ("hidden", "output") else 0.0)
        assert {"lr", "initial_lr", "lr_scale", "kind", "name"} <= g.keys()
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(_model().parameters()))


def test_mup_lr_scale_hidden_only() -> None:
    model = _model(width_mult=4.0)
    cfg = OptimConfig(lr=1e-3)
    for g in param_groups(model, cfg):
        want = 0.25 if g["kind"] == "hidden" else 1.0
        assert g["lr_scale"] == want
        assert g["initial_lr"] == pytest.approx(1e-3 * want)
    # Muon's hidden matrices keep scale 1 (width-independent spectral update); the untied
    # head keeps 1 too (its width dependence is the model's logit multiplier).
    scales = {g["name"]: g["lr_scale"] for g in param_groups(model, OptimConfig(name="muon"))}
    assert scales["hidden_muon"] == 1.0 and scales["output"] == 1.0
    assert scales["embedding"] == scales["norm"] == scales["bias"] == 1.0
    # The schedule applies the scale: lr = base * lr_scale * multiplier.
    opt = build_optimizer(model, cfg)
    set_lr(opt, 0, 100, ScheduleConfig(warmup_steps=4))
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(1e-3 * g["lr_scale"] * 0.25)


def test_bad_param_kind_is_named() -> None:
    model = _model()
    model.param_kind = lambda name: "weird"  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="weird"):
        param_groups(model, OptimConfig())


# ---------------------------------------------------------------- every optimizer trains


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_reduces_loss(name: str) -> None:
    model = _model()
    opt = build_optimizer(model, OptimConfig(name=name, **TRAIN_CFG[name]))
    with torch.no_grad():
        first = float(_loss(model, 0))
    for step in range(100):
        _train_step(model, opt, step, batch=step % 4)  # 4 fixed batches: a memorisation task
    with torch.no_grad():
        last = sum(float(_loss(model, s)) for s in range(4)) / 4
    assert last < 0.5 * first, (name, first, last)


def test_build_optimizer_types() -> None:
    assert isinstance(build_optimizer(_model(), OptimConfig(name="adamw")), torch.optim.AdamW)
    assert isinstance(
        build_optimizer(_model(), OptimConfig(name="adafactor")), torch.optim.Adafactor
    )
    lion = build_optimizer(_model(), OptimConfig(name="lion"))
    assert isinstance(lion, Lion)
    assert lion.param_groups[0]["betas"] == (0.9, 0.99)  # config default is AdamW's: not used
    lion = build_optimizer(_model(), OptimConfig(name="lion", betas=(0.95, 0.98)))
    assert lion.param_groups[0]["betas"] == (0.95, 0.98)  # set explicitly: used
    adamw = build_optimizer(_model(), OptimConfig(name="adamw", betas=(0.9, 0.99), eps=1e-6))
    assert adamw.param_groups[0]["betas"] == (0.9, 0.99) and adamw.param_groups[0]["eps"] == 1e-6
    assert adamw.param_groups[0]["foreach"] is True and adamw.param_groups[0]["fused"] is False


def test_registry_is_the_list_of_choices() -> None:
    """`optim.name` accepts exactly the registered optimizers and names them when refused;
    registering a builder is all a new optimizer takes."""
    assert list(OPTIMIZERS) == ["adamw", "lion", "adafactor", "muon"]
    with pytest.raises(ValidationError) as err:
        OptimConfig(name="sgd")
    assert "Input should be 'adamw', 'lion', 'adafactor' or 'muon'" in str(err.value)

    @register("sgd")
    def _sgd(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
        return torch.optim.SGD(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)

    try:
        opt = build_optimizer(_model(), OptimConfig(name="sgd", lr=0.05))
        assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.05
        with pytest.raises(ValueError, match="registered twice"):
            register("sgd")(_sgd)
    finally:
        del OPTIMIZERS["sgd"]
    with pytest.raises(ValidationError):
        OptimConfig(name="sgd")


# ---------------------------------------------------------------- Lion by hand


def test_lion_matches_hand_computed_steps() -> None:
    lr, wd, b1, b2 = 0.1, 0.5, 0.9, 0.99
    p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0]))
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    g1 = [100.0, -100.0, 0.25, 0.0]
    g2 = [-1.0, 1.0, -0.5, 2.0]  # opposite sign to g1 but small: sign(c) follows the momentum

    def sign(x: float) -> float:
        return float((x > 0) - (x < 0))

    exp_p = [1.0, -2.0, 0.5, 3.0]
    exp_m = [0.0] * 4
    for g in (g1, g2):
        p.grad = torch.tensor(g)
        opt.step()
        for i in range(4):
            c = b1 * exp_m[i] + (1 - b1) * g[i]
            exp_p[i] = exp_p[i] - lr * wd * exp_p[i] - lr * sign(c)
            exp_m[i] = b2 * exp_m[i] + (1 - b2) * g[i]
    torch.testing.assert_close(p.detach(), torch.tensor(exp_p), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg"], torch.tensor(exp_m), rtol=1e-6, atol=0)
    # The data discriminates: at step 2, sign(c) follows the momentum, not the gradient, on
    # coordinate 0, so an update of sign(g) fails the parameter check; swapped betas fail the
    # exp_avg check (m1 would be 0.1 * g1, not 0.01 * g1).
    assert b1 * (1 - b2) * g1[0] + (1 - b1) * g2[0] > 0 > g2[0]


# ---------------------------------------------------------------- Muon + AdamW


def test_muon_split_and_optimizer_api() -> None:
    model = _model()
    opt = build_optimizer(model, OptimConfig(name="muon"))
    assert isinstance(opt, MuonWithAdamW) and isinstance(opt, torch.optim.Optimizer)
    assert opt.muon is not None and opt.adamw is not None
    hidden_2d = {
        id(p)
        for n, p in model.named_parameters()
        if model.param_kind(n) == "hidden" and p.ndim == 2
    }
    assert hidden_2d == {id(model.fc1.weight), id(model.fc2.weight)}
    muon_ids = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    adamw_ids = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert muon_ids == hidden_2d
    assert adamw_ids == {id(p) for p in model.parameters()} - hidden_2d
    # One concatenated list of the inner optimizers' own group dicts (AdamW's first).
    assert opt.param_groups == opt.adamw.param_groups + opt.muon.param_groups
    assert all(
        a is b
        for a, b in zip(
            opt.param_groups, opt.adamw.param_groups + opt.muon.param_groups, strict=True
        )
    )
    muon_group = next(g for g in opt.param_groups if g["muon"])
    assert muon_group["initial_lr"] == 0.02 and muon_group["momentum"] == 0.95
    assert muon_group["lr_scale"] == 1.0
    assert all(g["initial_lr"] == 1e-3 for g in opt.param_groups if not g["muon"])

    _train_step(model, opt, 0)
    for n, p in model.named_parameters():
        keys = set(opt.state[p])
        assert keys == (
            {"momentum_buffer"} if id(p) in hidden_2d else {"step", "exp_avg", "exp_avg_sq"}
        ), n
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    # set_lr reaches both inner optimizers through the shared group dicts.
    set_lr(opt, 50, 100, ScheduleConfig(warmup_steps=0, min_lr_ratio=0.0))
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5)
    assert opt.adamw.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5)


def test_muon_relinks_after_load_state_dict() -> None:
    model = _model()
    opt = build_optimizer(model, OptimConfig(name="muon"))
    _train_step(model, opt, 0)
    sd = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(sd)  # replaces param_groups and state with new objects
    assert opt.muon is not None and opt.adamw is not None
    assert opt.muon.state is opt.state and opt.adamw.state is opt.state
    assert all(
        a is b
        for a, b in zip(
            opt.param_groups, opt.adamw.param_groups + opt.muon.param_groups, strict=True
        )
    )
    set_lr(opt, 1, 100, SCHED)
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.02 * lr_multiplier(1, 100, SCHED))


@pytest.mark.parametrize("name", NAMES)
def test_grad_scaler_unscale_and_inf_skip(name: str) -> None:
    model = _model()
    opt = build_optimizer(model, OptimConfig(name=name, **TRAIN_CFG[name]))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    params = list(model.parameters())

    # Reference (unscaled) gradients.
    opt.zero_grad(set_to_none=True)
    _loss(model, 0).backward()
    ref = [p.grad.clone() for p in params]

    # A finite step: unscale_ restores the true gradients for every parameter (Muon's too),
    # then step updates all parameters.
    opt.zero_grad(set_to_none=True)
    scaler.scale(_loss(model, 0)).backward()
    scaler.unscale_(opt)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    before = [p.detach().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**10
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True))

    # An inf in one gradient skips the whole step (both Muon and AdamW parts) and halves the
    # scale.
    opt.zero_grad(set_to_none=True)
    scaler.scale(_loss(model, 1)).backward()
    model.fc1.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in params]
    state_before = copy.deepcopy(opt.state_dict())
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    _assert_state_equal(state_before, opt.state_dict())


# ---------------------------------------------------------------- exact resume


def _assert_state_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_state_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_state_equal(x, y)
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_is_bitwise(name: str) -> None:
    cfg = OptimConfig(name=name, **TRAIN_CFG[name])
    model = _model()
    opt = build_optimizer(model, cfg)
    for step in range(3):
        _train_step(model, opt, step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    for step in range(3, 6):
        _train_step(model, opt, step)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = _model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt2 = build_optimizer(resumed, cfg)
    opt2.load_state_dict(ckpt["optim"])
    for step in range(3, 6):
        _train_step(resumed, opt2, step)

    for (n, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), n
    _assert_state_equal(opt.state_dict(), opt2.state_dict())


# ---------------------------------------------------------------- schedule


def _sched(kind: str, **kw: Any) -> ScheduleConfig:
    return ScheduleConfig(kind=kind, **kw)  # type: ignore[arg-type]


def test_warmup_is_linear_positive_and_monotone() -> None:
    for kind in ("cosine", "wsd", "linear", "constant"):
        cfg = _sched(kind, warmup_steps=10)
        vals = [lr_multiplier(s, 1000, cfg) for s in range(10)]
        assert vals == pytest.approx([(s + 1) / 10 for s in range(10)])
        assert vals[0] > 0 and all(a < b for a, b in itertools.pairwise(vals))
        assert vals[-1] == 1.0 and lr_multiplier(10, 1000, cfg) == 1.0


def test_cosine_values() -> None:
    cfg = _sched("cosine", warmup_steps=10, min_lr_ratio=0.1)
    total = 110
    assert lr_multiplier(60, total, cfg) == pytest.approx(0.1 + 0.5 * (1 - 0.1))  # midpoint
    q = 0.1 + 0.5 * (1 + math.cos(math.pi * 0.25)) * 0.9
    assert lr_multiplier(35, total, cfg) == pytest.approx(q)
    assert lr_multiplier(total, total, cfg) == pytest.approx(0.1)
    assert lr_multiplier(5 * total, total, cfg) == pytest.approx(0.1)  # holds the floor
    decay = [lr_multiplier(s, total, cfg) for s in range(10, total + 1)]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert lr_multiplier(0, 50, _sched("cosine", warmup_steps=0)) == 1.0


def test_linear_values() -> None:
    cfg = _sched("linear", warmup_steps=10)  # min_lr_ratio default 0.1 (OPT)
    assert lr_multiplier(60, 110, cfg) == pytest.approx(1 - 0.5 * 0.9)
    assert lr_multiplier(110, 110, cfg) == pytest.approx(0.1)
    assert lr_multiplier(35, 110, cfg) == pytest.approx(1 - 0.25 * 0.9)


def test_wsd_values() -> None:
    cfg = _sched("wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0)
    total = 100  # decay over steps 80..100
    assert lr_multiplier(50, total, cfg) == 1.0
    assert lr_multiplier(80, total, cfg) == 1.0
    assert lr_multiplier(90, total, cfg) == pytest.approx(0.5)
    assert lr_multiplier(95, total, cfg) == pytest.approx(0.25)
    assert lr_multiplier(total, total, cfg) == 0.0
    cfg = _sched("wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    assert lr_multiplier(90, total, cfg) == pytest.approx(1 - 0.5 * 0.9)
    assert lr_multiplier(total, total, cfg) == pytest.approx(0.1)
    # A decay fraction reaching into the warmup starts decaying only after the warmup.
    cfg = _sched("wsd", warmup_steps=50, decay_fraction=0.9, min_lr_ratio=0.0)
    assert lr_multiplier(49, total, cfg) == 1.0
    assert lr_multiplier(75, total, cfg) == pytest.approx(0.5)


def test_constant_and_range() -> None:
    cfg = _sched("constant", warmup_steps=10)
    assert lr_multiplier(5, 100, cfg) == pytest.approx(0.6)
    assert lr_multiplier(10_000, 100, cfg) == 1.0
    for kind in ("cosine", "wsd", "linear", "constant"):
        for total in (1, 7, 100):
            cfg = _sched(kind, warmup_steps=3, min_lr_ratio=0.2)
            assert all(0.0 <= lr_multiplier(s, total, cfg) <= 1.0 for s in range(total + 5))


def test_set_lr_scales_every_group() -> None:
    model = _model(width_mult=2.0)
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    cfg = _sched("cosine", warmup_steps=10)
    mult = lr_multiplier(3, 100, cfg)
    logged = set_lr(opt, 3, 100, cfg, extra_scale=0.5)
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(g["initial_lr"] * mult * 0.5)
        assert g["initial_lr"] == pytest.approx(1e-3 * g["lr_scale"])
    assert logged == opt.param_groups[0]["lr"] == pytest.approx(1e-3 * mult * 0.5)
    # A bare optimizer without initial_lr takes its current lr as the peak.
    p = nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([p], lr=0.2)
    assert set_lr(sgd, 0, 10, _sched("constant", warmup_steps=2)) == pytest.approx(0.1)
    assert set_lr(sgd, 5, 10, _sched("constant", warmup_steps=2)) == pytest.approx(0.2)


def test_batch_warmup_ramp() -> None:
    cfg = _sched("cosine", batch_warmup_start_accum=1, batch_warmup_steps=10)
    vals = [accum_steps_at(s, cfg, 8) for s in range(15)]
    assert vals[0] == 1 and vals[10] == 8 and vals[-1] == 8
    assert vals[5] == 1 + 7 * 5 // 10
    assert all(isinstance(v, int) and 1 <= v <= 8 for v in vals)
    assert all(a <= b for a, b in itertools.pairwise(vals))
    assert vals[9] < 8  # the full batch is reached at the end of the ramp, not before
    assert accum_steps_at(0, _sched("cosine"), 4) == 4  # no batch warmup
    assert accum_steps_at(0, _sched("cosine", batch_warmup_start_accum=2), 4) == 4  # 0 steps
    with pytest.raises(ValueError, match="batch_warmup_start_accum"):
        accum_steps_at(0, _sched("cosine", batch_warmup_start_accum=9, batch_warmup_steps=5), 4)
