"""The GPT (training/model.py) and its loss (training/loss.py), on CPU at tiny sizes."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from training import model as model_mod
from training.config import ModelConfig
from training.loss import IGNORE_INDEX, lm_loss, shift_targets
from training.model import GPT, Rotary, apply_rotary, positions_from_segments, swiglu_hidden

V, T = 64, 16
TINY: dict[str, Any] = {"d_model": 32, "n_layer": 2, "n_head": 4}


def make(seed: int = 0, **overrides: Any) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(**{**TINY, **overrides}), vocab_size=V, max_seq_len=T)


def ids(b: int = 2, t: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


# -- shapes across options ----------------------------------------------------------------

COMBOS = [
    {},
    {"norm": "layernorm", "position": "learned", "mlp": "gelu"},
    {"norm": "layernorm", "bias": True, "tie_embeddings": False},
    {"parallel_block": True, "rotary_pct": 0.25},
    {"parallel_block": True, "norm": "layernorm", "mlp": "gelu", "qk_norm": True},
    {"qk_norm": True, "position": "learned", "tie_embeddings": False},
    {"mlp": "gelu", "bias": True, "parallel_block": True, "position": "learned"},
    {"rotary_pct": 0.5, "qk_norm": True, "bias": True, "mup_base_d_model": 16},
    {"dropout": 0.1, "activation_checkpointing": True},
]


@pytest.mark.parametrize(
    "opts", COMBOS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
def test_shapes_backward_and_param_kinds(opts: dict[str, Any]) -> None:
    m = make(**opts)
    x = ids()
    seg = torch.tensor([[1] * 10 + [2] * 6, [1] * 12 + [0] * 4])
    for segment_ids in (None, seg):
        logits = m(x, segment_ids=segment_ids)
        assert logits.shape == (2, T, V) and logits.dtype == torch.float32
        targets, valid = shift_targets(x, segment_ids)
        total, _, _ = lm_loss(logits, targets, valid, z_loss=1e-4)
        m.zero_grad()
        total.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    names = [n for n, _ in m.named_parameters()]
    kinds = {n: m.param_kind(n) for n in names}
    assert kinds["wte.weight"] == "embedding"
    assert kinds["blocks.0.attn.w_q.weight"] == "hidden"
    assert kinds["ln_f.weight"] == "norm"
    assert ("lm_head.weight" in kinds) == (not m.cfg.tie_embeddings)
    if not m.cfg.tie_embeddings:
        assert kinds["lm_head.weight"] == "output"
    assert (m.wpe is not None) == (opts.get("position") == "learned")
    has_bias = any("bias" in n for n in names)
    assert has_bias == m.cfg.bias
    assert all(kinds[n] == "bias" for n in names if n.endswith(".bias"))
    # 2-D weights inside blocks are exactly the "hidden" ones.
    for n, p in m.named_parameters():
        assert (kinds[n] == "hidden") == (p.ndim == 2 and n.startswith("blocks."))


def test_param_kind_accepts_wrapped_names_and_rejects_unknown() -> None:
    m = make()
    assert m.param_kind("_orig_mod.blocks.1.mlp.w_down.weight") == "hidden"
    assert m.param_kind("module.wte.weight") == "embedding"
    with pytest.raises(KeyError):
        m.param_kind("blocks.0.nope.weight")


def test_swiglu_width_and_parallel_block_has_one_norm() -> None:
    assert swiglu_hidden(ModelConfig(d_model=128, mlp_ratio=4.0)) == 344  # 341.3 -> 344
    assert make(mlp="swiglu").blocks[0].mlp.w_up.out_features % 8 == 0
    assert make(mlp="gelu").blocks[0].mlp.w_up.out_features == 4 * 32
    assert make(parallel_block=True).blocks[0].ln_2 is None


def test_num_params_and_flops() -> None:
    tied, untied = make(), make(tie_embeddings=False)
    assert untied.num_params(exclude_embeddings=False) == (
        tied.num_params(exclude_embeddings=False) + V * 32
    )
    # Tied: the table is the head's matmul and counts; untied: the head counts, not wte.
    assert tied.num_params() == untied.num_params() == tied.num_params(False)
    learned = make(position="learned")
    assert learned.num_params() == learned.num_params(False) - T * 32
    assert tied.flops_per_token(T) == 6 * tied.num_params() + 12 * 2 * 32 * T


def test_autocast_bf16_gives_float32_logits() -> None:
    m = make(norm="layernorm")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m(ids())
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# -- document masking ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"position": "learned", "norm": "layernorm"},
        {"parallel_block": True, "qk_norm": True, "rotary_pct": 0.5},
    ],
)
def test_document_masking_isolates_documents(opts: dict[str, Any]) -> None:
    m = make(**opts).eval()
    a, b = ids(1, 10, seed=2), ids(1, 6, seed=3)
    packed = torch.cat([a, b], dim=1)
    seg = torch.tensor([[1] * 10 + [2] * 6])
    pos = torch.tensor([list(range(10)) + list(range(6))])
    with torch.no_grad():
        alone = m(b)
        masked = m(packed, position_ids=pos, segment_ids=seg)
        unmasked = m(packed, position_ids=pos, segment_ids=None)
        derived = m(packed, segment_ids=seg)  # position ids derived from the segments
    assert torch.allclose(masked[:, 10:], alone, atol=1e-5, rtol=0)
    assert torch.allclose(masked[:, :10], m(a), atol=1e-5, rtol=0)
    assert not torch.allclose(unmasked[:, 10:], alone, atol=1e-3)
    assert torch.equal(derived, masked)


def test_flex_block_mask_matches_dense_mask() -> None:
    # The CUDA path (flex attention) runs here uncompiled; flex has no CPU backward.
    m = make().eval()
    x = ids(2)
    seg = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * 12 + [0] * 4])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.attention_backend = "flex"
        flex = m(x, segment_ids=seg)
        m.attention_backend = "sdpa"
        dense = m(x, segment_ids=seg)
    assert torch.allclose(flex, dense, atol=1e-5, rtol=0)


def test_compiled_model_keeps_the_mask_eager_and_equals_eager() -> None:
    # The mask reads segment ids on the host; compile_model keeps it out of the graph.
    from torch._dynamo.testing import CompileCounter

    m = make().eval()
    x = ids(2)
    seg = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * 12 + [0] * 4])
    counter = CompileCounter()
    compiled = model_mod.compile_model(m, m, backend=counter)  # type: ignore[arg-type]
    with torch.no_grad():
        assert torch.allclose(compiled(x, segment_ids=seg), m(x, segment_ids=seg), atol=1e-6)
    assert counter.frame_count >= 1
    assert getattr(m.attention_mask, "_torchdynamo_disable", False)


def test_fast_path_equals_masked_path_for_one_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    m = make().eval()
    x, one = ids(), torch.ones(2, T, dtype=torch.long)
    assert m.attention_mask(one, training=False) is None  # one segment: fast path
    assert m.attention_mask(None, training=False) is None
    with torch.no_grad():
        fast = m(x, segment_ids=one)
        monkeypatch.setattr(model_mod, "is_single_segment", lambda s: s is None)
        assert isinstance(m.attention_mask(one, training=False), torch.Tensor)
        masked = m(x, segment_ids=one)
    assert torch.allclose(fast, masked, atol=1e-5, rtol=0)
    assert torch.allclose(fast, m(x), atol=0, rtol=0)


def test_padding_produces_no_nan_and_does_not_leak() -> None:
    m = make(position="learned")
    x = ids(3)
    seg = torch.tensor([[1] * 9 + [0] * 7, [0] * T, [1] * 4 + [2] * 4 + [0] * 8])
    logits = m(x, segment_ids=seg)
    assert torch.isfinite(logits).all()
    targets, valid = shift_targets(x, seg, (seg > 0).to(torch.int8))
    total, _, _ = lm_loss(logits, targets, valid, 1e-4)
    total.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    # What sits in the padding changes nothing for the real tokens.
    x2 = x.clone()
    x2[seg == 0] = (x2[seg == 0] + 1) % V
    with torch.no_grad():
        real = seg > 0
        assert torch.allclose(m(x2, segment_ids=seg)[real], logits.detach()[real], atol=1e-6)


def test_positions_from_segments() -> None:
    seg = torch.tensor([[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 0, 0]])
    assert positions_from_segments(seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]


# -- rotary -------------------------------------------------------------------------------


def test_partial_rotary_leaves_other_dims_alone() -> None:
    rot = Rotary(head_dim=16, rotary_pct=0.25, theta=10_000.0)
    assert rot.rotary_dim == 4
    pos = torch.arange(T)[None]
    cos, sin = rot(pos)
    x = torch.randn(1, 2, T, 16)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 4:], x[..., 4:])  # untouched, whatever the position
    assert not torch.allclose(y[..., :4], x[..., :4])
    assert torch.allclose(y[:, :, 0], x[:, :, 0])  # position 0 is the identity
    # Rotations keep norms, and q.k depends only on the offset between positions.
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    q, k = torch.randn(16), torch.randn(16)

    def dot(m: int, n: int) -> torch.Tensor:
        c, s = rot(torch.tensor([[m, n]]))
        qm = apply_rotary(q.expand(1, 1, 2, 16), c, s)[0, 0, 0]
        kn = apply_rotary(k.expand(1, 1, 2, 16), c, s)[0, 0, 1]
        return qm @ kn

    assert torch.allclose(dot(3, 1), dot(13, 11), atol=1e-5)
    assert not torch.allclose(dot(3, 1), dot(1, 3), atol=1e-3)


# -- init -----------------------------------------------------------------------------------


def test_scaled_init_and_no_biases() -> None:
    L, d = 8, 256
    torch.manual_seed(0)
    m = GPT(ModelConfig(d_model=d, n_layer=L, n_head=4, mlp="gelu"), V, T)
    assert not any("bias" in n for n, _ in m.named_parameters())
    resid = torch.cat(
        [
            p.flatten()
            for n, p in m.named_parameters()
            if n.endswith(("attn.w_o.weight", "mlp.w_down.weight"))
        ]
    )
    other = torch.cat(
        [
            p.flatten()
            for n, p in m.named_parameters()
            if n.endswith(("attn.w_q.weight", "mlp.w_up.weight"))
        ]
    )
    assert resid.std().item() == pytest.approx(0.02 / math.sqrt(2 * L), rel=0.03)
    assert other.std().item() == pytest.approx(0.02, rel=0.03)
    assert m.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(
        torch.equal(p, torch.ones_like(p))
        for n, p in m.named_parameters()
        if m.param_kind(n) == "norm"
    )
    biased = make(bias=True, norm="layernorm")
    assert all(
        torch.equal(p, torch.zeros_like(p))
        for n, p in biased.named_parameters()
        if n.endswith(".bias")
    )


# -- activation checkpointing -------------------------------------------------------------


def test_activation_checkpointing_same_loss_and_grads() -> None:
    x = ids(2)
    seg = torch.tensor([[1] * 10 + [2] * 6, [1] * 16])
    results = []
    for ckpt in (False, True):
        m = make(seed=5, activation_checkpointing=ckpt).train()
        targets, valid = shift_targets(x, seg)
        loss, _, _ = lm_loss(m(x, segment_ids=seg), targets, valid, 1e-4)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.allclose(l0, l1, atol=1e-6)
    assert g0.keys() == g1.keys()
    assert all(torch.allclose(g0[n], g1[n], atol=1e-6) for n in g0)


# -- loss -----------------------------------------------------------------------------------


def test_shift_targets_never_crosses_segments_or_padding() -> None:
    x = torch.tensor([[10, 11, 12, 20, 21, 0, 0], [30, 31, 32, 33, 34, 35, 36]])
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    mask = (seg > 0).to(torch.int8)
    targets, valid = shift_targets(x, seg, mask)
    assert valid.tolist() == [[True, True, False, True, False, False, False], [True] * 6 + [False]]
    assert targets[0].tolist() == [11, 12, IGNORE_INDEX, 21] + [IGNORE_INDEX] * 3
    assert targets[1].tolist() == [31, 32, 33, 34, 35, 36, IGNORE_INDEX]
    # Padding is caught from the segment ids alone, or from the loss mask alone.
    assert torch.equal(shift_targets(x, seg)[1], valid)
    _, v_mask_only = shift_targets(x, None, mask)
    assert v_mask_only[0].tolist() == [True, True, True, True, False, False, False]
    _, v_none = shift_targets(x)
    assert v_none.tolist() == [[True] * 6 + [False]] * 2
    # Randomised: every valid pair is (same segment, real) -> (same segment, real).
    seg = torch.sort(torch.randint(0, 4, (8, 32)), dim=1).values.flip(1)
    x = torch.randint(0, V, (8, 32))
    targets, valid = shift_targets(x, seg, (seg > 0).to(torch.int8))
    b, t = valid.nonzero(as_tuple=True)
    assert torch.equal(seg[b, t], seg[b, t + 1]) and (seg[b, t + 1] > 0).all()
    assert torch.equal(targets[b, t], x[b, t + 1])
    assert (targets[~valid] == IGNORE_INDEX).all()


def test_lm_loss_matches_cross_entropy_and_z_loss_is_exact() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, V) * 3
    x = torch.randint(0, V, (2, 5))
    seg = torch.tensor([[1, 1, 2, 2, 0], [1, 1, 1, 1, 1]])
    targets, valid = shift_targets(x, seg)
    total0, ce0, z0 = lm_loss(logits, targets, valid, z_loss=0.0)
    total, ce, z = lm_loss(logits, targets, valid, z_loss=1e-2)
    ref = F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=IGNORE_INDEX)
    assert torch.allclose(ce, ref, atol=1e-6) and torch.equal(ce, ce0)
    assert z0.item() == 0 and torch.equal(total0, ce0)
    lse = torch.logsumexp(logits, dim=-1)[valid]
    assert torch.allclose(z, 1e-2 * lse.pow(2).mean(), atol=1e-7, rtol=1e-6)
    assert torch.allclose(total, ce + z)
    # No valid position: zeros, not NaN.
    t_, v_ = shift_targets(x[:, :1])
    assert [t.item() for t in lm_loss(logits[:, :1], t_, v_, 1e-2)] == [0.0, 0.0, 0.0]


def test_tiny_model_overfits_a_fixed_batch() -> None:
    m = make(seed=0).train()
    x = ids(4, seed=7)
    seg = torch.tensor([[1] * 16, [1] * 8 + [2] * 8, [1] * 12 + [0] * 4, [1] * 16])
    targets, valid = shift_targets(x, seg, (seg > 0).to(torch.int8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(50):
        loss, _, _ = lm_loss(m(x, segment_ids=seg), targets, valid, z_loss=1e-4)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(V), rel=0.1)
    assert losses[-1] < 0.3 * losses[0]


# -- muP --------------------------------------------------------------------------------------


def test_mup_width_mult_init_and_attention_scale() -> None:
    assert make().width_mult == 1.0
    sp = make(d_model=128, n_head=4)
    mup = make(d_model=128, n_head=4, mup_base_d_model=32)
    assert mup.width_mult == 4.0
    assert sp.blocks[0].attn.scale == pytest.approx(1 / math.sqrt(32))
    assert mup.blocks[0].attn.scale == pytest.approx(1 / 32)

    def std(m: GPT, suffix: str) -> float:
        return (
            torch.cat([p.flatten() for n, p in m.named_parameters() if n.endswith(suffix)])
            .std()
            .item()
        )

    for suffix in ("attn.w_q.weight", "mlp.w_up.weight", "attn.w_o.weight"):
        assert std(mup, suffix) == pytest.approx(std(sp, suffix) / 2, rel=0.1)  # 1/sqrt(4)
    assert std(mup, "wte.weight") == pytest.approx(std(sp, "wte.weight"), rel=0.1)


def test_mup_readout_scales_logits_by_one_over_width_mult() -> None:
    m = make(d_model=64, n_head=4, mup_base_d_model=16, tie_embeddings=False).eval()
    seen: dict[str, torch.Tensor] = {}
    m.ln_f.register_forward_hook(lambda _m, _i, out: seen.__setitem__("h", out))
    with torch.no_grad():
        logits = m(ids())
        assert m.lm_head is not None
        expected = seen["h"] @ m.lm_head.weight.T / 4.0
    assert torch.allclose(logits, expected, atol=1e-6)


def test_mup_logit_scale_does_not_grow_with_width() -> None:
    """At init, standard-parametrisation logits grow with width (~sqrt(d)); muP's do not."""
    x = ids(4)

    def logit_std(d: int, base: int | None) -> float:
        torch.manual_seed(0)
        m = GPT(ModelConfig(d_model=d, n_layer=2, n_head=4, mup_base_d_model=base), 256, T)
        with torch.no_grad():
            return m(x).std().item()

    sp_ratio = logit_std(256, None) / logit_std(32, None)
    mup_ratio = logit_std(256, 32) / logit_std(32, 32)
    assert sp_ratio > 2.0  # sqrt(8) ~ 2.8 in theory
    assert mup_ratio < 1.0
