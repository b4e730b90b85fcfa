"""Optimizers for the trainer: parameter grouping (weight decay, muP learning-rate scales),
AdamW / Adafactor from torch, a hand-written Lion, and Muon for hidden matrices combined with
AdamW for the rest into one `torch.optim.Optimizer`.

`OPTIMIZERS` maps each `optim.name` to its builder; the config accepts exactly its keys. A new
optimizer is one builder function decorated with `@register("name")` (options it needs go in
`OptimConfig`).

The model contract (see `training/model.py`): `model.named_parameters()`,
`model.param_kind(name)` -> "embedding" | "norm" | "bias" | "hidden" | "output", and
`model.width_mult` (muP width multiplier, 1.0 when muP is off).

Every parameter group carries
- `kind` / `name`: what the group holds (for logging and for the Muon split),
- `weight_decay`: `cfg.weight_decay` for "hidden" and "output" matrices, 0 for norms, biases and
  embeddings (decaying gains and embeddings towards 0 hurts; GPT-2/nanoGPT, LLaMA practice),
- `lr_scale`: the muP factor, and `initial_lr` = base lr * `lr_scale`, which
  `training.schedule.set_lr` multiplies by the schedule; `lr` starts at `initial_lr`.
- with `lr_layer_decay` or `param_groups` in the config only: `lr_mult`, the product of the
  layer-wise decay and the matching rule's multiplier, folded into `initial_lr` (so the
  schedule, the guard's LR cut and checkpoints carry it like muP's scale). Each kind is then
  split into one group per distinct (multiplier, rule).

Learning-rate semantics per optimizer (`cfg.lr` is passed as is; nothing is rescaled here):
- adamw: `torch.optim.AdamW`, betas `cfg.betas`, eps `cfg.eps`, decoupled weight decay
  (p -= lr * wd * p). foreach by default, torch's fused kernel with `cfg.fused`; both are
  deterministic on CPU (exact resume).
- adafactor: `torch.optim.Adafactor`. Its `lr` is NOT an absolute step: torch uses it as the cap
  of the relative step size rho_t = min(lr, 1/sqrt(t)), and the update is scaled by
  max(1e-3, RMS(param)) * rho_t; it also multiplies weight decay (p *= 1 - lr * wd). torch's
  Adafactor has no first moment, so `cfg.betas` / `cfg.eps` are unused (its beta2 schedule is
  1 - t^-0.8). Typical lr ~1e-2 (torch's default).
- lion: `Lion` below. Its sign update has magnitude lr in every coordinate, so the usual lr is
  3-10x smaller than AdamW's and weight decay 3-10x larger to keep lr * wd (Chen et al. 2023);
  set those in the config, nothing is changed here. Betas: `cfg.betas` if the config sets them,
  else Lion's own (0.9, 0.99) (the config default (0.9, 0.95) is tuned for AdamW).
- muon: `torch.optim.Muon` (lr `cfg.muon_lr`, momentum `cfg.muon_momentum`, Nesterov,
  weight decay `cfg.weight_decay`, Keller Jordan's shape adjustment sqrt(max(1, rows/cols)))
  for 2-D "hidden" matrices; AdamW at `cfg.lr` for everything else (embeddings, norms, biases,
  the output head), as Muon's authors prescribe. See `MuonWithAdamW`.

muP (Yang et al. 2022, Adam): "hidden" matrices get lr_scale = 1 / width_mult (LR
proportional to 1/fan_in); embeddings, norms, biases and the output head keep 1. The head's
width dependence is carried by the model's 1/width_mult logit multiplier (the MuReadout form
of the paper's Table 3 row for output weights); scaling its LR as well would count the width
twice.
Applied to every Adam-like (per-coordinate normalised) optimizer: AdamW, Lion and Adafactor
(for Adafactor, whose step is relative to RMS(param), this is the Adam rule used as an
approximation). Muon's hidden groups keep lr_scale 1: its orthogonalised update already has a
width-independent spectral norm (the spectral condition for feature learning, Yang, Simon &
Bernstein 2023), so muP's 1/fan_in would shrink it twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.optimizer import ParamsT

from training.config import OptimConfig

KINDS = ("embedding", "norm", "bias", "output", "hidden")
# Kinds whose weights decay; gains, biases and embeddings do not (see the module docstring).
_DECAY_KINDS = frozenset({"hidden", "output"})
# Kinds whose Adam-family lr muP scales by 1/width_mult.
_MUP_KINDS = frozenset({"hidden"})
# Lion's defaults from Chen et al. 2023 (Algorithm 2 / the authors' reference code).
LION_BETAS = (0.9, 0.99)


class GroupedModel(Protocol):
    """What the optimizers need from the model (nn.Module plus two attributes)."""

    width_mult: float

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]: ...

    def param_kind(self, name: str) -> str: ...


def param_groups(model: GroupedModel | nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """Parameter groups for `cfg.name`: one per kind present, in the order embedding, norm, bias,
    output, hidden, so group 0 is an unscaled `cfg.lr` group whenever the model has embeddings
    (what `set_lr` returns for logging). For an optimizer registered with `matrix_groups` (muon)
    the 2-D "hidden" matrices form the group named "hidden_muon" (`muon=True`, base lr
    `cfg.muon_lr`, lr_scale 1); every group then has a `muon` flag. Frozen parameters
    (requires_grad False) are left out."""
    width_mult = float(getattr(model, "width_mult", 1.0))
    if not (width_mult > 0 and math.isfinite(width_mult)):
        raise ValueError(f"model.width_mult must be a positive number, got {width_mult}")
    use_muon = _entry(cfg.name).matrix_groups
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    kinds = {n: model.param_kind(n) for n, _ in named}  # type: ignore[operator]
    split = _splitter(named, kinds, cfg)
    # (kind key, lr_mult, rule index) -> parameters; without the options the last two are
    # (1.0, -1) for all, so there is one bucket per kind, as there always was.
    buckets: dict[tuple[str, float, int], list[nn.Parameter]] = {}
    for pname, p in named:
        kind = kinds[pname]
        if kind not in KINDS:
            raise ValueError(f"param_kind({pname!r}) returned {kind!r}; expected one of {KINDS}")
        # Muon only handles 2-D matrices; a non-2-D "hidden" tensor stays with AdamW.
        key = "hidden_muon" if use_muon and kind == "hidden" and p.ndim == 2 else kind
        buckets.setdefault((key, *split(pname, kind)), []).append(p)

    groups: list[dict[str, Any]] = []
    order = {k: i for i, k in enumerate((*KINDS, "hidden_muon"))}
    # By kind, in KINDS order; within a kind, as the parameters came (a stable sort).
    for (key, lr_mult, rule), params in sorted(buckets.items(), key=lambda b: order[b[0][0]]):
        is_muon = key == "hidden_muon"
        kind = "hidden" if is_muon else key
        lr_scale = 1.0 if is_muon or kind not in _MUP_KINDS else 1.0 / width_mult
        base_lr = cfg.muon_lr if is_muon else cfg.lr
        wd = cfg.weight_decay if kind in _DECAY_KINDS else 0.0
        group: dict[str, Any] = {
            "params": params,
            "name": key,
            "kind": kind,
            "weight_decay": wd,
            "lr_scale": lr_scale,
            "initial_lr": base_lr * lr_scale,
            "lr": base_lr * lr_scale,
        }
        if cfg.lr_layer_decay is not None or cfg.param_groups:
            rule_wd = cfg.param_groups[rule].weight_decay if rule >= 0 else None  # type: ignore[index]
            group.update(
                name=f"{key}@{lr_mult:.6g}" + (f"#{rule}" if rule >= 0 else ""),
                weight_decay=wd if rule_wd is None else rule_wd,
                lr_mult=lr_mult,
                initial_lr=base_lr * lr_scale * lr_mult,
                lr=base_lr * lr_scale * lr_mult,
            )
        if use_muon:
            group["muon"] = is_muon
        groups.append(group)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    return groups


_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def _splitter(
    named: list[tuple[str, nn.Parameter]], kinds: dict[str, str], cfg: OptimConfig
) -> Callable[[str, str], tuple[float, int]]:
    """name, kind -> (lr multiplier, index of the first matching `cfg.param_groups` rule or
    -1). Layer-wise decay (see OptimConfig.lr_layer_decay): block i (from the name
    "blocks.<i>.") gets decay ** (n_layer - 1 - i), "embedding" kinds decay ** n_layer,
    the rest (final norm, untied head) 1. Rules that match no parameter are refused."""
    rules = [re.compile(r.pattern) for r in cfg.param_groups or []]
    for i, rx in enumerate(rules):
        if named and not any(rx.search(n) for n, _ in named):
            raise ValueError(
                f"optim.param_groups[{i}].pattern {rx.pattern!r} matches no "
                f"parameter (names look like {named[0][0]!r})"
            )
    decay = cfg.lr_layer_decay
    blocks = [int(m.group(1)) for n, _ in named if (m := _BLOCK.search(n))]
    n_layer = max(blocks) + 1 if blocks else 0

    def split(name: str, kind: str) -> tuple[float, int]:
        mult = 1.0
        if decay is not None:
            m = _BLOCK.search(name)
            if m:
                mult = decay ** (n_layer - 1 - int(m.group(1)))
            elif kind == "embedding":
                mult = decay**n_layer
        rule = next((i for i, rx in enumerate(rules) if rx.search(name)), -1)
        if rule >= 0:
            mult *= cfg.param_groups[rule].lr_mult  # type: ignore[index]
        return mult, rule

    return split


Builder = Callable[[list[dict[str, Any]], OptimConfig], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerEntry:
    """A registered optimizer: `build(groups, cfg)` makes it over `param_groups(model, cfg)`
    and reads the OptimConfig options it uses; with `matrix_groups`, `param_groups` gives
    2-D "hidden" matrices a group of their own ("hidden_muon", see `param_groups`)."""

    build: Builder
    matrix_groups: bool = False


# name -> optimizer; `optim.name` in the config accepts exactly these keys (in this order in
# its error message). Adding an optimizer: one builder decorated with `@register("name")`.
OPTIMIZERS: dict[str, OptimizerEntry] = {}


def register(name: str, *, matrix_groups: bool = False) -> Callable[[Builder], Builder]:
    def add(build: Builder) -> Builder:
        if name in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is registered twice")
        OPTIMIZERS[name] = OptimizerEntry(build, matrix_groups)
        return build

    return add


def _entry(name: str) -> OptimizerEntry:
    entry = OPTIMIZERS.get(name)
    if entry is None:
        raise ValueError(f"unknown optimizer {name!r}")
    return entry


def build_optimizer(model: GroupedModel | nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` over `param_groups(model, cfg)` (see the module docstring)."""
    return _entry(cfg.name).build(param_groups(model, cfg), cfg)


@register("adamw")
def _adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.AdamW:
    # foreach is the default multi-tensor path; `fused` is torch's single-kernel update (CPU
    # and CUDA), a few per cent faster on small models. Both are deterministic (exact resume
    # is tested on CPU for each).
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=not cfg.fused,
        fused=cfg.fused,
    )


@register("lion")
def _lion(groups: list[dict[str, Any]], cfg: OptimConfig) -> Lion:
    # The config's betas default is AdamW's; use Lion's own unless the user set them.
    betas = cfg.betas if "betas" in cfg.model_fields_set else LION_BETAS
    return Lion(groups, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)


@register("adafactor")
def _adafactor(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Adafactor:
    return torch.optim.Adafactor(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


@register("muon", matrix_groups=True)
def _muon(groups: list[dict[str, Any]], cfg: OptimConfig) -> MuonWithAdamW:
    return MuonWithAdamW(
        [g for g in groups if g["muon"]],
        [g for g in groups if not g["muon"]],
        muon_lr=cfg.muon_lr,
        muon_momentum=cfg.muon_momentum,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


def _closure_loss(closure: Callable[[], float] | None) -> float | None:
    """What `step(closure)` returns: the closure re-evaluated with gradients enabled (step
    itself runs under no_grad), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):

        c = beta1 * m + (1 - beta1) * g
        p = p - lr * wd * p - lr * sign(c)       (decoupled weight decay, old p)
        m = beta2 * m + (1 - beta2) * g

    One state tensor per parameter (`exp_avg`), half of AdamW's memory. The update has
    magnitude lr per coordinate, so use an lr 3-10x below AdamW's (and wd 3-10x above)."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = LION_BETAS,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}")
        if weight_decay < 0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                if wd != 0:
                    p.mul_(1.0 - lr * wd)
                update = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for 2-D hidden matrices plus AdamW for everything else, as ONE real
    `torch.optim.Optimizer`, so the trainer, `torch.amp.GradScaler` and lr schedulers treat it
    like any other optimizer.

    How: an inner `torch.optim.Muon` and an inner `torch.optim.AdamW` are built over their
    groups; this optimizer is built over the very same group dicts (AdamW's first, so group 0
    is AdamW's), and both inner optimizers share this optimizer's `state` dict (their parameter
    sets are disjoint). Hence
    - `param_groups` is the concatenated list; `set_lr` writing group["lr"] reaches the inner
      optimizers; each group keeps `lr`, `initial_lr`, `lr_scale` and a `muon` flag;
    - `state_dict()` / `load_state_dict()` are torch's own, over both parts (one flat state
      dict; the inner optimizers are re-linked to the loaded groups and state afterwards);
    - `zero_grad(set_to_none=True)` is torch's own, over all parameters;
    - `step()` steps Muon, then AdamW.

    GradScaler: `unscale_`/`step` only read `optimizer.param_groups` and call
    `optimizer.step()` (`_step_supports_amp_scaling` is False), and key their bookkeeping by
    `id(optimizer)`. Since this object is an Optimizer whose groups hold every parameter, one
    `scaler.unscale_(opt)` unscales all gradients, an inf/NaN anywhere skips both inner
    steps, and `scaler.step(opt)` works unchanged for fp16. Do not pass the inner optimizers
    to the scaler separately."""

    def __init__(
        self,
        muon_params: Iterable[Any],
        adamw_params: Iterable[Any],
        *,
        muon_lr: float = 0.02,
        muon_momentum: float = 0.95,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
    ) -> None:
        muon_cls = getattr(torch.optim, "Muon", None)
        if muon_cls is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Muon (torch>=2.9)")
        muon_groups = _as_groups(muon_params, muon=True)
        adamw_groups = _as_groups(adamw_params, muon=False)
        # An empty part gets no inner optimizer (torch's optimizers refuse empty lists).
        self._muon: torch.optim.Optimizer | None = None
        self._adamw: torch.optim.Optimizer | None = None
        if muon_groups:
            self._muon = muon_cls(
                muon_groups,
                lr=muon_lr,
                momentum=muon_momentum,
                weight_decay=weight_decay,
                nesterov=True,
            )
        if adamw_groups:
            self._adamw = torch.optim.AdamW(
                adamw_groups,
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                foreach=True,
                fused=False,
            )
        # The inner optimizers filled each group dict with their defaults in place; this
        # Optimizer's add_param_group appends the same dict objects (and checks disjointness).
        self._linked = False  # add_param_group: plain appends until __init__ is done
        super().__init__(adamw_groups + muon_groups, defaults={})
        self._linked = True
        self._link()

    @property
    def muon(self) -> torch.optim.Optimizer | None:
        """The inner Muon (None if there are no hidden matrices)."""
        return self._muon

    @property
    def adamw(self) -> torch.optim.Optimizer | None:
        """The inner AdamW (None if every parameter is a hidden matrix)."""
        return self._adamw

    def _link(self) -> None:
        # Point the inner optimizers at this optimizer's current group dicts and state; needed
        # after load_state_dict, which replaces both with new objects.
        for inner, flag in ((self._muon, True), (self._adamw, False)):
            if inner is None:
                continue
            groups = [g for g in self.param_groups if bool(g["muon"]) is flag]
            for g in groups:  # a checkpoint from another torch version may lack newer keys
                for k, v in inner.defaults.items():
                    g.setdefault(k, v)
            inner.param_groups = groups
            inner.state = self.state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Optimizer.load_state_dict ends with __setstate__({"state", "param_groups"}).
        super().__setstate__(state)
        if self.__dict__.get("_linked"):
            self._link()

    def __getstate__(self) -> dict[str, Any]:
        # Keep the inner optimizers through pickle/deepcopy (the base keeps only 3 fields).
        return {
            **super().__getstate__(),
            "_muon": self._muon,
            "_adamw": self._adamw,
            "_linked": self._linked,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self.__dict__.get("_linked"):  # called by Optimizer.__init__
            super().add_param_group(param_group)
            return
        # Later additions go to the inner optimizer named by the group's `muon` flag.
        param_group.setdefault("muon", False)
        inner = self._muon if param_group["muon"] else self._adamw
        if inner is None:
            raise ValueError("no inner optimizer for this group; build one with both parts")
        inner.add_param_group(param_group)
        inner.param_groups.pop()  # _link re-derives the list from self.param_groups
        super().add_param_group(param_group)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        for inner in (self._muon, self._adamw):
            if inner is not None:
                inner.step()
        return loss


def _as_groups(params: Iterable[Any], *, muon: bool) -> list[dict[str, Any]]:
    """Normalise tensors-or-dicts into group dicts tagged with the `muon` flag."""
    items = list(params)
    if not items:
        return []
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    for g in groups:
        g["muon"] = muon
        g.setdefault("lr_scale", 1.0)
    return groups


def agc_params(model: GroupedModel | nn.Module) -> list[nn.Parameter]:
    """The parameters adaptive gradient clipping acts on: 2-D "hidden" matrices. Brock et
    al. 2021 leave the final classifier unclipped, and embeddings, norm gains and biases are
    not the unit-wise weight matrices the rule is written for."""
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and p.ndim == 2 and model.param_kind(name) == "hidden"
    ]  # type: ignore[operator]


@torch.no_grad()
def clip_grad_agc_(params: Iterable[nn.Parameter], clip: float, eps: float = 1e-3) -> None:
    """Adaptive gradient clipping (Brock et al. 2021, "High-Performance Large-Scale Image
    Recognition Without Normalization", Sec. 4.1), unit-wise: every row i of a weight
    W (out, in), the fan-in of output unit i, gets G_i scaled by
    clip * max(||W_i||, eps) / ||G_i|| when ||G_i|| exceeds clip * max(||W_i||, eps), and is
    left as is otherwise (the reference code's 1e-6 floor on ||G_i|| avoids 0/0). Pure
    tensor ops: nothing is read back to the host."""
    for p in params:
        g = p.grad
        if g is None:
            continue
        w_norm = p.detach().norm(dim=1, keepdim=True).clamp_min(eps)
        g_norm = g.norm(dim=1, keepdim=True)
        max_norm = clip * w_norm
        scale = torch.where(
            g_norm > max_norm, max_norm / g_norm.clamp_min(1e-6), torch.ones_like(g_norm)
        )
        g.mul_(scale)
