"""Recipe options, part 2, each a config switch that leaves today's runs bit for bit as
they were: the init variants (scaled, small, T-Fixup), dropout per site and stochastic
depth, layer-wise / per-name learning rates, warm start and resume overrides (lr, optimizer
switch), layer-wise statistics with an attention-logit warning, and the gradient noise
scale with its batch-size controller."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.factories import train_config
from tests.support.host_sync import BUDGET, reads_per_step
from tests.support.host_sync import trainer as sync_trainer
from tests.support.trainer import config_error, train
from training import checkpoint as ckpt
from training.config import ModelConfig, OptimConfig, parse_train_config
from training.metrics import read
from training.model import GPT, Block, LayerNorm, RMSNorm, drop_path
from training.noise_scale import NoiseScale
from training.optim import build_optimizer, param_groups
from training.schedule import lr_multiplier, set_lr
from training.trainer import Trainer

V, T = 64, 16


def gpt(seed: int = 0, **over: Any) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(**{"d_model": 32, "n_layer": 2, "n_head": 4, **over}), V, T)


def ids(b: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, T), generator=torch.Generator().manual_seed(seed))


def _std(m: GPT, *suffixes: str) -> float:
    return (
        torch.cat([p.flatten() for n, p in m.named_parameters() if n.endswith(suffixes)])
        .std()
        .item()
    )


# ---------------------------------------------------------------- init
def _old_init(m: GPT) -> None:
    """The init as it was before `init` existed, written out again."""
    std = m.cfg.init_std
    with torch.no_grad():
        for name, module in m.named_modules():
            if isinstance(module, nn.Linear):
                s = std
                if name.startswith("blocks."):
                    s /= math.sqrt(m.width_mult)
                    if name.endswith(("attn.w_o", "mlp.w_down")):
                        s /= math.sqrt(2 * m.cfg.n_layer)
                nn.init.normal_(module.weight, mean=0.0, std=s)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm | LayerNorm):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)


@pytest.mark.parametrize(
    "over",
    [{}, {"mup_base_d_model": 16, "bias": True, "norm": "layernorm", "tie_embeddings": False}],
)
def test_default_init_is_the_old_scaled_init_bit_for_bit(over):
    new, old = gpt(**over), gpt(**over)
    assert new.cfg.init == "scaled"
    torch.manual_seed(123)
    new.init_weights()
    torch.manual_seed(123)
    _old_init(old)
    for (n, a), (_, b) in zip(new.named_parameters(), old.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_small_init_stds_and_their_mup_form():
    L, d = 8, 256
    m = gpt(d_model=d, n_layer=L, mlp="gelu", init="small")
    small = math.sqrt(2 / (5 * d))
    assert _std(m, "attn.w_q.weight", "mlp.w_up.weight") == pytest.approx(small, rel=0.03)
    assert _std(m, "attn.w_o.weight", "mlp.w_down.weight") == pytest.approx(
        2 / (L * math.sqrt(d)), rel=0.03
    )
    assert m.wte.weight.std().item() == pytest.approx(small, rel=0.05)
    # muP: d is the base width; hidden matrices then carry muP's 1/sqrt(width_mult), which
    # lands on the same hidden stds, while the embedding keeps the base width's.
    mup = gpt(d_model=d, n_layer=L, mlp="gelu", init="small", mup_base_d_model=64)
    assert _std(mup, "attn.w_q.weight", "mlp.w_up.weight") == pytest.approx(small, rel=0.03)
    assert _std(mup, "attn.w_o.weight") == pytest.approx(2 / (L * math.sqrt(d)), rel=0.05)
    assert mup.wte.weight.std().item() == pytest.approx(math.sqrt(2 / (5 * 64)), rel=0.05)
    # Not the default's numbers.
    assert abs(small - 0.02) / 0.02 > 0.5


def test_tfixup_init_is_xavier_with_the_decoder_scales():
    L, d = 6, 192
    m = gpt(d_model=d, n_layer=L, n_head=4, mlp="gelu", init="tfixup", tie_embeddings=False)
    scale = (9 * L) ** -0.25
    xavier_sq = math.sqrt(2 / (d + d))  # Xavier std of a d x d matrix
    xavier_up = math.sqrt(2 / (d + 4 * d))
    assert _std(m, "attn.w_q.weight", "attn.w_k.weight") == pytest.approx(xavier_sq, rel=0.03)
    assert _std(m, "attn.w_v.weight", "attn.w_o.weight") == pytest.approx(
        xavier_sq * scale, rel=0.03
    )
    assert _std(m, "mlp.w_up.weight", "mlp.w_down.weight") == pytest.approx(
        xavier_up * scale, rel=0.03
    )
    assert m.wte.weight.std().item() == pytest.approx(d**-0.5 * scale, rel=0.03)
    # Uniform, within Xavier's bound (a normal init would overshoot it).
    bound = math.sqrt(6 / (2 * d))
    q = torch.cat([b.attn.w_q.weight.flatten() for b in m.blocks])
    assert q.abs().max().item() <= bound and q.abs().max().item() > 0.95 * bound
    assert m.lm_head is not None
    assert m.lm_head.weight.std().item() == pytest.approx(math.sqrt(2 / (V + d)), rel=0.05)
    # It trains: a few steps on one batch lower the loss, with no warmup at all.
    x = ids()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        loss = nn.functional.cross_entropy(m(x)[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_init_options_are_refused_where_they_make_no_sense():
    msg = config_error(model={"init": "tfixup", "mup_base_d_model": 16})
    assert "model: Value error, init tfixup cannot be combined with mup_base_d_model" in msg
    assert "model.init: " in config_error(model={"init": "xavier"})


def test_new_model_keys_keep_old_fingerprints_until_used():
    c = parse_train_config({"dataset": "ds"})
    # The fingerprint as it was computed before the new keys existed.
    model = c.model.model_dump(mode="json")
    for key in (
        "compile",
        "activation_checkpointing",
        "init",
        "attn_dropout",
        "resid_dropout",
        "embd_dropout",
        "drop_path",
    ):
        model.pop(key)
    blob = json.dumps(
        {"model": model, "optim": {"name": "adamw"}}, sort_keys=True, separators=(",", ":")
    )
    assert c.checkpoint_fingerprint() == hashlib.sha256(blob.encode()).hexdigest()[:16]
    for over in ({"init": "small"}, {"drop_path": 0.1}, {"attn_dropout": 0.1}):
        other = parse_train_config({"dataset": "ds", "model": over})
        assert other.checkpoint_fingerprint() != c.checkpoint_fingerprint(), over


# ---------------------------------------------------------------- dropout, drop path
def test_one_dropout_is_the_default_of_all_three_sites():
    x = ids()
    torch.manual_seed(5)
    a = gpt(dropout=0.3).train()(x)
    torch.manual_seed(5)
    b = gpt(attn_dropout=0.3, resid_dropout=0.3, embd_dropout=0.3).train()(x)
    assert torch.equal(a, b)
    torch.manual_seed(5)
    c = gpt(dropout=0.3, attn_dropout=0.0).train()(x)
    assert not torch.equal(a, c)


def _zero_fraction(t: torch.Tensor) -> float:
    return (t == 0).float().mean().item()


@pytest.mark.parametrize("site", ["embd", "resid", "attn"])
def test_each_dropout_site_acts_alone(site):
    m = gpt(**{f"{site}_dropout": 0.5}).train()
    seen: dict[str, torch.Tensor] = {}
    m.blocks[0].register_forward_pre_hook(lambda mod, args: seen.update(embd=args[0]))
    m.blocks[0].attn.register_forward_hook(lambda mod, args, out: seen.update(resid=out))
    x = ids()
    torch.manual_seed(0)
    out = m(x)
    m.eval()
    # Embedding and residual dropout zero about half of their outputs; the other sites
    # zero nothing. Attention dropout shows only in the result (it acts on probabilities).
    assert _zero_fraction(seen["embd"]) == pytest.approx(0.5 if site == "embd" else 0.0, abs=0.08)
    assert _zero_fraction(seen["resid"]) == pytest.approx(0.5 if site == "resid" else 0.0, abs=0.08)
    assert not torch.equal(out, m(x))  # training differs from evaluation
    attn_only = gpt(attn_dropout=0.5)
    assert attn_only.blocks[0].attn.dropout == 0.5
    assert attn_only.blocks[0].attn.resid_dropout.p == 0.0 and attn_only.drop.p == 0.0


def test_drop_path_drops_whole_samples_and_rescales():
    torch.manual_seed(0)
    x = torch.randn(4000, 3, 5) + 2.0
    y = drop_path(x, 0.25, training=True)
    dropped = (y == 0).flatten(1).all(1)
    assert dropped.float().mean().item() == pytest.approx(0.25, abs=0.03)
    assert torch.allclose(y[~dropped], x[~dropped] / 0.75)
    assert drop_path(x, 0.25, training=False) is x
    assert drop_path(x, 0.0, training=True) is x


def test_drop_path_rates_grow_linearly_and_act_per_branch():
    m = gpt(n_layer=4, drop_path=0.3)
    assert [b.drop_path_rate for b in m.blocks] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    # A parallel block: each sample's update is a, m, a + m or nothing, each kept branch
    # scaled by 1 / (1 - rate).
    torch.manual_seed(0)
    block = Block(
        ModelConfig(d_model=32, n_layer=2, n_head=4, parallel_block=True),
        mup=False,
        drop_path_rate=0.5,
    )
    x = torch.randn(64, 8, 32)
    h = block.ln_1(x)
    a, f = block.attn(h, None, None), block.mlp(h)
    block.train()
    delta = block(x, None, None) - x
    combos = [torch.zeros_like(a), a / 0.5, f / 0.5, (a + f) / 0.5]
    which = [
        [torch.allclose(delta[i], c[i], atol=1e-5) for c in combos].index(True) for i in range(64)
    ]
    assert set(which) == {0, 1, 2, 3}
    block.eval()
    assert torch.allclose(block(x, None, None), x + a + f)


def test_dropout_and_drop_path_resume_exactly(train_dataset, tmp_path):
    over = {
        "model": {"embd_dropout": 0.1, "attn_dropout": 0.2, "drop_path": 0.2},
        "schedule": {"kind": "constant"},
    }
    assert train(train_dataset, tmp_path / "a", steps=2, **over) == 0
    assert train(train_dataset, tmp_path / "a", steps=4, **over) == 0
    assert train(train_dataset, tmp_path / "b", steps=4, **over) == 0
    sa = ckpt.load(tmp_path / "a" / "checkpoints", 4)
    sb = ckpt.load(tmp_path / "b" / "checkpoints", 4)
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])


# ---------------------------------------------------------------- layer-wise learning rates
def _lrs(m: GPT, c: OptimConfig) -> dict[str, tuple[float, float]]:
    """parameter name -> (initial lr, weight decay) of its group."""
    names = {id(p): n for n, p in m.named_parameters()}
    return {
        names[id(p)]: (g["initial_lr"], g["weight_decay"])
        for g in param_groups(m, c)
        for p in g["params"]
    }


def test_default_groups_are_unchanged():
    m = gpt()
    groups = param_groups(m, OptimConfig())
    assert [g["name"] for g in groups] == ["embedding", "norm", "hidden"]
    assert all("lr_mult" not in g for g in groups)


def test_layer_decay_from_the_head_down_to_the_embeddings():
    m = gpt(n_layer=3, tie_embeddings=False, mup_base_d_model=16)  # width_mult 2
    lrs = _lrs(m, OptimConfig(lr=1.0, lr_layer_decay=0.5))
    assert lrs["wte.weight"][0] == 0.125  # 0.5 ** n_layer
    assert lrs["blocks.0.attn.w_q.weight"][0] == 0.25 * 0.5  # 0.5 ** 2, muP's 1/2
    assert lrs["blocks.1.ln_1.weight"][0] == 0.5  # norms: no muP scale
    assert lrs["blocks.2.mlp.w_down.weight"][0] == 1.0 * 0.5
    assert lrs["ln_f.weight"][0] == 1.0 and lrs["lm_head.weight"][0] == 1.0
    # Muon's hidden matrices: its own lr, the same layer factors.
    muon = _lrs(m, OptimConfig(name="muon", lr=1.0, muon_lr=0.02, lr_layer_decay=0.5))
    assert muon["blocks.0.attn.w_q.weight"][0] == pytest.approx(0.02 * 0.25)
    assert muon["blocks.2.attn.w_q.weight"][0] == 0.02


def test_param_group_rules_first_match_wins_and_must_match():
    m = gpt()
    rules = [
        {"pattern": r"attn\.w_[qk]", "lr_mult": 0.1, "weight_decay": 0.0},
        {"pattern": r"attn\.", "lr_mult": 2.0},
    ]
    lrs = _lrs(m, OptimConfig(lr=1.0, weight_decay=0.1, param_groups=rules, lr_layer_decay=0.5))
    assert lrs["blocks.0.attn.w_q.weight"] == (0.5 * 0.1, 0.0)
    assert lrs["blocks.1.attn.w_k.weight"] == (pytest.approx(0.1), 0.0)
    assert lrs["blocks.1.attn.w_v.weight"] == (2.0, 0.1)
    assert lrs["blocks.1.mlp.w_up.weight"] == (1.0, 0.1)
    with pytest.raises(ValueError, match=r"optim.param_groups\[1\].pattern 'nope' matches no"):
        param_groups(m, OptimConfig(param_groups=[{"pattern": "wte"}, {"pattern": "nope"}]))
    assert "optim.param_groups[0].pattern: Value error, not a regular expression" in (
        config_error(optim={"param_groups": [{"pattern": "("}]})
    )
    assert "optim.lr_layer_decay: " in config_error(optim={"lr_layer_decay": 1.5})


def test_multipliers_survive_the_schedule_and_the_log_shows_the_schedule():
    m = gpt()
    c = OptimConfig(lr=1e-3, lr_layer_decay=0.5)
    opt = build_optimizer(m, c)
    sched = parse_train_config({"dataset": "ds"}).schedule
    for step in (0, 50, 500):
        logged = set_lr(opt, step, 1000, sched, extra_scale=0.5)
        want = 1e-3 * lr_multiplier(step, 1000, sched) * 0.5
        assert logged == pytest.approx(want, rel=1e-12)
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(want * g["lr_mult"], rel=1e-12)


def test_a_rule_scales_the_update_it_names(train_dataset, tmp_path):
    """One step with the embedding's lr cut 1000x moves it about 1000x less (AdamW's step
    is proportional to the lr; embeddings carry no weight decay)."""

    def wte_change(run: str, **over: Any) -> torch.Tensor:
        t = Trainer(
            parse_train_config(
                train_config(
                    train_dataset,
                    tmp_path / run,
                    schedule={"kind": "constant", "warmup_steps": 0},
                    **over,
                )
            )
        )
        try:
            before = t.model.wte.weight.detach().clone()
            t.train_step()
            return (t.model.wte.weight.detach() - before).abs()
        finally:
            t.loader.close()
            t.ckpts.close()

    base = wte_change("a")
    cut = wte_change("b", optim={"param_groups": [{"pattern": "^wte", "lr_mult": 1e-3}]})
    assert base.max().item() > 0
    assert cut.max().item() == pytest.approx(base.max().item() * 1e-3, rel=1e-2)


def test_layer_wise_lrs_resume_exactly(train_dataset, tmp_path):
    over = {
        "optim": {"lr_layer_decay": 0.7, "param_groups": [{"pattern": r"\.mlp\.", "lr_mult": 0.5}]}
    }
    assert train(train_dataset, tmp_path / "a", steps=3, **over) == 0
    assert train(train_dataset, tmp_path / "a", steps=6, **over) == 0
    assert train(train_dataset, tmp_path / "b", steps=6, **over) == 0
    sa = ckpt.load(tmp_path / "a" / "checkpoints", 6)
    sb = ckpt.load(tmp_path / "b" / "checkpoints", 6)
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
    assert sa["optimizer"]["param_groups"] == sb["optimizer"]["param_groups"]
    lrs = [r["lr"] for r in read(tmp_path / "b" / "metrics.jsonl") if r.get("kind") == "train"]
    c = parse_train_config(train_config(train_dataset, tmp_path, **over)).schedule
    assert lrs == pytest.approx([1e-3 * lr_multiplier(k, 6, c) for k in range(6)], rel=1e-12)


# ---------------------------------------------------------------- warm start, overrides
def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def _events(run: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in read(run / "metrics.jsonl") if r.get("event") == name]


def test_init_from_takes_the_weights_with_a_fresh_optimizer(train_dataset, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(train_dataset, a, steps=3) == 0
    assert train(train_dataset, b, steps=2, init_from=str(a)) == 0
    a0, a3 = (ckpt.load(a / "checkpoints", s) for s in (0, 3))
    b0 = ckpt.load(b / "checkpoints", 0)
    assert _same_weights(a3, b0) and not _same_weights(a0, b0)
    assert b0["optimizer"]["state"] == {} and b0["trainer"]["step"] == 0
    assert [e["checkpoint"] for e in _events(b, "init_from")] == [
        str(a / "checkpoints" / ckpt.step_name(3))
    ]
    lrs = [r["lr"] for r in read(b / "metrics.jsonl") if r.get("kind") == "train"]
    assert lrs[0] == 1e-3 / 2  # the schedule starts again at warmup's first step
    # Shapes are checked: one line naming the first parameter that does not fit.
    capsys.readouterr()
    assert (
        train(
            train_dataset, tmp_path / "c", init_from=str(a / "checkpoints"), model={"d_model": 64}
        )
        == 1
    )
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1
    assert re.search(
        r"init_from .*step-0+3: parameter wte\.weight has shape \[\d+, 32\] "
        r"there, \[\d+, 64\] here$",
        errors[0],
    ), errors[0]
    assert train(train_dataset, tmp_path / "d", init_from=str(tmp_path / "none")) == 1
    assert "init_from: " in capsys.readouterr().err


def test_lr_override_and_optimizer_switch_on_resume(train_dataset, tmp_path):
    """Resumed with {lr, optimizer: muon}: the new peak lr and Muon from the resume step on,
    with the step count, data position and guard state kept; recorded once; and a run
    resumed again after the switch (its config still says adamw, its checkpoint holds
    Muon's state) ends bit for bit where a run resumed once ends."""
    base = {"schedule": {"kind": "constant", "warmup_steps": 0}}
    over = {**base, "resume_overrides": {"lr": 5e-4, "optimizer": "muon"}}
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        assert train(train_dataset, run, steps=3, **base) == 0
    assert train(train_dataset, a, steps=5, **over) == 0
    assert train(train_dataset, a, steps=7, **over) == 0
    assert train(train_dataset, b, steps=7, **over) == 0
    sa, sb = (ckpt.load(r / "checkpoints", 7) for r in (a, b))
    assert _same_weights(sa, sb)
    assert sa["trainer"]["optimizer"] == "muon"
    assert "hidden_muon" in [g["name"] for g in sa["optimizer"]["param_groups"]]
    assert sa["trainer"]["step"] == 7 and sa["trainer"]["samples_seen"] == 7 * 4
    assert sa["guard"] == sb["guard"]
    lrs = [r["lr"] for r in read(a / "metrics.jsonl") if r.get("kind") == "train"]
    assert lrs == [1e-3] * 3 + [5e-4] * 4
    for run in (a, b):
        assert [(e["step"], e["from"], e["to"]) for e in _events(run, "optimizer_switch")] == [
            (3, "adamw", "muon")
        ]
        assert [(e["step"], e["lr"]) for e in _events(run, "lr_override")] == [(3, 5e-4)]
    assert "resume_overrides.optimizer: Input should be" in config_error(
        resume_overrides={"optimizer": "sgd"}
    )


# ---------------------------------------------------------------- layer statistics
def _no_hooks(t: Trainer) -> bool:
    return all(not b._forward_hooks and not b.attn._forward_hooks for b in t.model.blocks)


def test_stats_cost_no_hooks_or_reads_when_off_and_one_read_when_on(train_dataset, tmp_path):
    off = sync_trainer(train_dataset, tmp_path / "off", 2)
    assert _no_hooks(off)
    _, ours_off, _ = reads_per_step(off, 4)
    assert ours_off == [BUDGET] * 4
    on = sync_trainer(train_dataset, tmp_path / "on", 2, stats_every=2)
    _, ours_on, _ = reads_per_step(on, 4)
    assert ours_on == [BUDGET, BUDGET + 1, BUDGET, BUDGET + 1]  # steps 2 and 4 only
    assert _no_hooks(on)  # removed after the statistics step's forward


def test_stats_values_are_what_they_say(train_dataset, tmp_path):
    t = Trainer(
        parse_train_config(
            train_config(
                train_dataset,
                tmp_path,
                stats_every=1,
                optim={"grad_clip": None},
                model={"position": "learned"},
            )
        )
    )
    blocks = list(t.model.blocks)
    acts: dict[int, torch.Tensor] = {}
    attn_in: dict[int, tuple[Any, ...]] = {}

    def keep(store: dict[int, Any], i: int, value: Any) -> None:  # None: output unchanged
        store.setdefault(i, value)

    for i, b in enumerate(blocks):
        b.register_forward_hook(lambda m, a, out, i=i: keep(acts, i, out.detach()))
        b.attn.register_forward_hook(
            lambda m, a, out, i=i: keep(
                attn_in, i, (*a, m.w_q.weight.detach().clone(), m.w_k.weight.detach().clone())
            )
        )
    grads: dict[int, list[torch.Tensor]] = {}
    t.optimizer.register_step_pre_hook(
        lambda opt, a, k: grads.update(
            {i: [p.grad.clone() for p in b.parameters()] for i, b in enumerate(blocks)}
        )
    )
    before = [[p.detach().clone() for p in b.parameters()] for b in blocks]
    try:
        out = t.train_step()
    finally:
        t.loader.close()
        t.ckpts.close()
    st = out.extras.get("layer_stats")
    assert st is not None and set(st) == {"act_rms", "grad_rms", "attn_logit_max", "update_ratio"}
    for i, b in enumerate(blocks):
        assert st["act_rms"][i] == pytest.approx(acts[i].pow(2).mean().sqrt().item(), rel=1e-5)
        g = torch.cat([x.flatten() for x in grads[i]])
        assert st["grad_rms"][i] == pytest.approx(g.pow(2).mean().sqrt().item(), rel=1e-5)
        w0 = torch.cat([x.flatten() for x in before[i]])
        w1 = torch.cat([p.detach().flatten() for p in b.parameters()])
        assert st["update_ratio"][i] == pytest.approx(
            ((w1 - w0).norm() / w0.norm()).item(), rel=1e-4
        )
        # Brute force over the allowed (query, key) pairs, head by head.
        x, _, mask, w_q, w_k = attn_in[i]  # the weights of the forward, before the step
        q = (x.detach() @ w_q.T).view(*x.shape[:2], 2, -1)
        k = (x.detach() @ w_k.T).view(*x.shape[:2], 2, -1)
        best = -math.inf
        n = x.shape[1]
        for row in range(x.shape[0]):
            for qi in range(n):
                dots = (q[row, qi] * k[row, : qi + 1]).sum(-1)  # (keys, heads)
                if mask is not None:
                    dots = dots[mask[row, 0, qi, : qi + 1]]
                best = max(best, dots.max().item() * b.attn.scale)
        assert st["attn_logit_max"][i] == pytest.approx(best, rel=1e-5)


def test_attention_logit_guard_warns_and_stats_are_logged(train_dataset, tmp_path):
    assert train(train_dataset, tmp_path / "a", steps=4, stats_every=2, max_attn_logit=1e-6) == 0
    recs = read(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in recs if r.get("kind") == "stats"] == [2, 4]
    warnings = [r for r in recs if r.get("event") == "attn_logit_warning"]
    assert [w["step"] for w in warnings] == [2, 4]
    assert all(w["attn_logit_max"] > 1e-6 and w["limit"] == 1e-6 for w in warnings)
    assert train(train_dataset, tmp_path / "b", steps=4, stats_every=2, max_attn_logit=1e6) == 0
    assert not any(
        r.get("event") == "attn_logit_warning" for r in read(tmp_path / "b" / "metrics.jsonl")
    )
    assert "max_attn_logit needs stats_every" in config_error(max_attn_logit=10.0)
    assert "stats_every cannot be combined with model.compile" in config_error(
        stats_every=5, model={"compile": True}
    )


# ---------------------------------------------------------------- gradient noise scale
def test_noise_scale_estimator_recovers_b_noise():
    # From the expected norms, E|G_B|^2 = |G|^2 + S / B, the estimate is exact.
    ns = NoiseScale(beta=0.5)
    for b_small, b_big in ((4, 8), (4, 16), (2, 32)):
        assert ns.observe(
            2.0 + 30.0 / b_small, 2.0 + 30.0 / b_big, b_small, b_big
        ) == pytest.approx(15.0)
    assert ns.g2 == pytest.approx(2.0) and ns.s == pytest.approx(30.0)
    assert ns.observe(float("nan"), 1.0, 4, 8) == pytest.approx(15.0)  # ignored
    # From sampled gradients: per-sample g = G + noise with covariance sigma^2 I in D dims,
    # so S = D sigma^2 and B_noise = D sigma^2 / |G|^2 = 64 * 4 / 16 = 16.
    gen = torch.Generator().manual_seed(0)
    G = torch.full((64,), 0.5, dtype=torch.float64)
    ns = NoiseScale(beta=0.998)
    for _ in range(3000):
        g = G + 2.0 * torch.randn(32, 64, generator=gen, dtype=torch.float64)
        ns.observe(g[:4].mean(0).pow(2).sum().item(), g.mean(0).pow(2).sum().item(), 4, 32)
    assert ns.b_noise() == pytest.approx(16.0, rel=0.15)
    # The controller: ceil(B_noise / micro_batch), never lower than now, at most max_accum.
    assert ns.propose(2, 4, 8) == math.ceil(ns.b_noise() / 4)
    assert ns.propose(7, 4, 8) == 7 and ns.propose(2, 4, 3) == 3
    assert ns.propose(2, 4, 100, target=2.0) == math.ceil(2 * ns.b_noise() / 4)
    assert NoiseScale(beta=0.9).propose(2, 4, 8) == 2  # no estimate yet


def test_noise_scale_adds_no_host_read(train_dataset, tmp_path):
    t = sync_trainer(train_dataset, tmp_path, 2, noise_scale={"every": 2})
    _, ours, _ = reads_per_step(t, 4)
    assert ours == [BUDGET] * 4


def test_noise_scale_controller_logs_raises_and_resumes_exactly(train_dataset, tmp_path):
    over = {
        "accum_steps": 2,
        "micro_batch": 1,
        "schedule": {"kind": "constant"},
        "noise_scale": {"every": 1, "max_accum": 5, "ema_beta": 0.5, "target": 3.0},
    }
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(train_dataset, a, steps=3, **over) == 0
    assert train(train_dataset, a, steps=6, **over) == 0
    assert train(train_dataset, b, steps=6, **over) == 0
    sa, sb = (ckpt.load(r / "checkpoints", 6) for r in (a, b))
    assert _same_weights(sa, sb) and sa["noise_scale"] == sb["noise_scale"]
    recs = read(b / "metrics.jsonl")
    noise = [r for r in recs if r.get("kind") == "noise_scale"]
    assert [r["step"] for r in noise] == [1, 2, 3, 4, 5, 6]
    for r in noise:
        assert r["b_noise"] == pytest.approx(r["s"] / r["g2"])
    # The accumulation of each step is the last raise before it (2 before any), and the
    # controller never lowers it or passes max_accum.
    raises = {r["step"]: r["accum_to"] for r in recs if r.get("event") == "batch_size"}
    accum, want = 2, []
    for step in range(1, 7):
        want.append(accum)
        accum = raises.get(step, accum)
    assert [r["accum"] for r in recs if r.get("kind") == "train"] == want
    assert raises and all(2 < v <= 5 for v in raises.values())
    assert list(raises.values()) == sorted(raises.values())
    assert [r.get("accum") for r in read(a / "metrics.jsonl") if r.get("kind") == "train"] == want
    assert "noise_scale needs accum_steps >= 2" in config_error(noise_scale={})
    assert "noise_scale.max_accum (2) is below accum_steps (4)" in config_error(
        accum_steps=4, noise_scale={"max_accum": 2}
    )


def test_resuming_with_other_param_groups_is_one_clear_line(train_dataset, tmp_path, capsys):
    assert train(train_dataset, tmp_path, steps=3) == 0
    capsys.readouterr()
    assert train(train_dataset, tmp_path, steps=6, optim={"lr_layer_decay": 0.5}) == 1
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "optim.lr_layer_decay" in errors[0]
    assert "its optimizer state does not fit this run's optimizer" in errors[0]


# ---------------------------------------------------------------- batch warmup by tokens
def test_batch_ramp_by_tokens_follows_the_tokens_trained(train_dataset, tmp_path):
    """accum ramps from 1 to 4 over the first 3,000 tokens: each step's accumulation is the
    ramp's value at the tokens seen before it (as logged), not at its step number."""
    run = tmp_path / "run"
    assert (
        train(
            train_dataset,
            run,
            steps=12,
            accum_steps=4,
            log_every=1,
            schedule={
                "kind": "constant",
                "batch_warmup_start_accum": 1,
                "batch_warmup_tokens": 3000,
            },
        )
        == 0
    )
    recs = [r for r in read(run / "metrics.jsonl") if r.get("kind") == "train"]
    seen = 0
    accums = []
    for r in recs:
        accums.append(r["accum"])
        assert r["accum"] == min(4, 1 + 3 * seen // 3000), (r, seen)
        seen = r["tokens_seen"]
    assert accums[0] == 1 and accums[-1] == 4 and len(set(accums)) >= 3
    assert "not both" in config_error(
        schedule={
            "batch_warmup_start_accum": 1,
            "batch_warmup_steps": 5,
            "batch_warmup_tokens": 100,
        }
    )
