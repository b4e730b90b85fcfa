"""Export a checkpoint as a Hugging Face transformers model directory.

`export_hf(checkpoint, out_dir)` writes config.json, model.safetensors (sharded with an
index above `max_shard_size`), generation_config.json and the tokenizer (tokenizer.json +
tokenizer_config.json with EOS/pad), so `AutoModelForCausalLM.from_pretrained(out_dir)`
and `AutoTokenizer.from_pretrained(out_dir)` load it offline.

Each option set maps to the transformers class that computes the same function:

* RMSNorm + full RoPE + SwiGLU + sequential blocks -> LlamaForCausalLM
  (with QK-norm: Qwen3ForCausalLM, whose q/k norms are per-head RMSNorms before RoPE);
* LayerNorm + RoPE (any rotary_pct) + GELU, sequential or parallel -> GPTNeoXForCausalLM;
* LayerNorm + learned positions + GELU + sequential -> GPT2LMHeadModel.

Anything else has no exact equivalent and is refused (UnsupportedArchitecture, one line
naming the option). muP's multipliers are folded into the weights: the 1/head_dim
attention scale into W_Q (or into q_norm's gain under QK-norm, which would undo a scale
on W_Q), the 1/width_mult logit multiplier into an untied head.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from core.dataset import read_manifest, resolve
from core.store import StorageOptions, open_store
from training import checkpoint as ckpt
from training.config import ModelConfig, TrainConfig

__all__ = [
    "ExportError",
    "UnsupportedArchitecture",
    "architecture",
    "export_hf",
    "find_checkpoint",
    "hf_config",
    "hf_state_dict",
    "hf_tokenizer",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ExportError(RuntimeError):
    """The export cannot be done (bad checkpoint, dataset or tokenizer); one line."""


class UnsupportedArchitecture(ExportError):
    """An option with no exact transformers equivalent."""


def _refuse(what: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"cannot export to Hugging Face transformers: {what} has no exact equivalent"
    )


def architecture(cfg: ModelConfig) -> str:
    """The transformers class computing the same function as a model of `cfg`, or
    UnsupportedArchitecture naming the first option that rules every class out."""
    if cfg.norm == "rmsnorm":
        if cfg.mlp != "swiglu":
            raise _refuse("norm rmsnorm with mlp gelu")
        if cfg.position != "rope":
            raise _refuse("norm rmsnorm with position learned")
        if cfg.rotary_pct != 1.0:
            raise _refuse(f"norm rmsnorm with rotary_pct {cfg.rotary_pct}")
        if cfg.parallel_block:
            raise _refuse("parallel_block with norm rmsnorm")
        if cfg.qk_norm:
            if cfg.bias:  # Qwen3's MLP has no biases
                raise _refuse("qk_norm with bias")
            return "Qwen3ForCausalLM"
        return "LlamaForCausalLM"
    if cfg.qk_norm:
        raise _refuse("qk_norm with norm layernorm")
    if cfg.mlp != "gelu":
        raise _refuse("norm layernorm with mlp swiglu")
    if cfg.position == "rope":
        return "GPTNeoXForCausalLM"
    if cfg.parallel_block:
        raise _refuse("parallel_block with position learned")
    return "GPT2LMHeadModel"


def _width_mult(cfg: ModelConfig) -> float:
    return cfg.d_model / cfg.mup_base_d_model if cfg.mup_base_d_model else 1.0


def _untied(cfg: ModelConfig) -> bool:
    # Folding 1/width_mult into a tied head would scale the embeddings too.
    return not cfg.tie_embeddings or _width_mult(cfg) != 1.0


@dataclass(frozen=True)
class Special:
    eos_id: int
    pad_id: int


def hf_config(cfg: ModelConfig, vocab_size: int, seq_len: int, special: Special) -> Any:
    """The transformers config (an object of the class's own config type)."""
    import transformers

    arch = architecture(cfg)
    head_dim = cfg.d_model // cfg.n_head
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "tie_word_embeddings": not _untied(cfg),
        # EOS doubles as BOS, as in GPT-2: in packed training data every document follows
        # an EOS. transformers' own defaults (bos 1, eos 2 for Llama) would be wrong ids.
        "bos_token_id": special.eos_id,
        "eos_token_id": special.eos_id,
        "pad_token_id": special.pad_id,
        "architectures": [arch],
    }
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        kw: dict[str, Any] = dict(
            hidden_size=cfg.d_model,
            intermediate_size=_swiglu_hidden(cfg),
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_head,
            head_dim=head_dim,
            hidden_act="silu",
            max_position_embeddings=seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_parameters=rope,
            attention_bias=cfg.bias,
            attention_dropout=0.0,
            **common,
        )
        if arch == "LlamaForCausalLM":
            return transformers.LlamaConfig(mlp_bias=cfg.bias, **kw)
        return transformers.Qwen3Config(use_sliding_window=False, **kw)
    if arch == "GPTNeoXForCausalLM":
        return transformers.GPTNeoXConfig(
            hidden_size=cfg.d_model,
            intermediate_size=int(cfg.mlp_ratio * cfg.d_model),
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            hidden_act="gelu",  # exact erf GELU, as F.gelu
            max_position_embeddings=seq_len,
            layer_norm_eps=cfg.norm_eps,
            use_parallel_residual=cfg.parallel_block,
            attention_bias=cfg.bias,
            rope_parameters={**rope, "partial_rotary_factor": cfg.rotary_pct},
            attention_dropout=0.0,
            hidden_dropout=0.0,
            **common,
        )
    return transformers.GPT2Config(
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=int(cfg.mlp_ratio * cfg.d_model),
        activation_function="gelu",
        n_positions=seq_len,
        layer_norm_epsilon=cfg.norm_eps,
        scale_attn_weights=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **common,
    )


def _swiglu_hidden(cfg: ModelConfig) -> int:
    from training.layers import swiglu_hidden

    return swiglu_hidden(cfg)


def hf_state_dict(cfg: ModelConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Ballast's state dict (float32) renamed and reshaped into the class's own, with the
    muP multipliers folded in and zeros where the class has a bias Ballast does not."""
    arch = architecture(cfg)
    sd = {k: v.detach().float() for k, v in sd.items()}
    d, n_head = cfg.d_model, cfg.n_head
    head_dim = d // n_head
    mup = cfg.mup_base_d_model is not None
    # Ballast's muP attention scale is 1/head_dim; every class here uses 1/sqrt(head_dim),
    # so q carries the extra 1/sqrt(head_dim) (RoPE is linear: it commutes with a scale).
    q_scale = 1.0 / math.sqrt(head_dim) if mup else 1.0

    def get(name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        if name in sd:
            return sd[name]
        assert shape is not None, name
        return torch.zeros(shape)  # a bias Ballast does not have: zero is the same function

    def lin(prefix: str, out: int) -> tuple[Tensor, Tensor]:
        return get(prefix + ".weight"), get(prefix + ".bias", (out,))

    def norm(prefix: str) -> tuple[Tensor, Tensor]:
        return get(prefix + ".weight"), get(prefix + ".bias", (d,))

    head = sd["wte.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    head = head * (1.0 / _width_mult(cfg))
    out: dict[str, Tensor] = {}

    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        out["model.embed_tokens.weight"] = sd["wte.weight"]
        out["model.norm.weight"] = sd["ln_f.weight"]
        for i in range(cfg.n_layer):
            b, h = f"blocks.{i}.", f"model.layers.{i}."
            out[h + "input_layernorm.weight"] = sd[b + "ln_1.weight"]
            out[h + "post_attention_layernorm.weight"] = sd[b + "ln_2.weight"]
            if cfg.qk_norm:  # the norm would remove a scale on W_Q: fold it into the gain
                out[h + "self_attn.q_norm.weight"] = sd[b + "attn.q_norm.weight"] * q_scale
                out[h + "self_attn.k_norm.weight"] = sd[b + "attn.k_norm.weight"]
            for ours, theirs in (
                ("w_q", "q_proj"),
                ("w_k", "k_proj"),
                ("w_v", "v_proj"),
                ("w_o", "o_proj"),
            ):
                scale = q_scale if ours == "w_q" and not cfg.qk_norm else 1.0
                for kind in ("weight", "bias") if cfg.bias else ("weight",):
                    out[f"{h}self_attn.{theirs}.{kind}"] = sd[f"{b}attn.{ours}.{kind}"] * scale
            for ours, theirs in (
                ("w_gate", "gate_proj"),
                ("w_up", "up_proj"),
                ("w_down", "down_proj"),
            ):
                for kind in ("weight", "bias") if cfg.bias else ("weight",):
                    out[f"{h}mlp.{theirs}.{kind}"] = sd[f"{b}mlp.{ours}.{kind}"]
        out["lm_head.weight"] = head
        return out

    if arch == "GPTNeoXForCausalLM":
        out["gpt_neox.embed_in.weight"] = sd["wte.weight"]
        w, bias = norm("ln_f")
        out["gpt_neox.final_layer_norm.weight"], out["gpt_neox.final_layer_norm.bias"] = w, bias
        hidden = int(cfg.mlp_ratio * d)
        for i in range(cfg.n_layer):
            b, h = f"blocks.{i}.", f"gpt_neox.layers.{i}."
            # A parallel block has one norm shared by both branches: write it twice.
            ln2 = b + ("ln_1" if cfg.parallel_block else "ln_2")
            for ours, theirs in (
                (b + "ln_1", "input_layernorm"),
                (ln2, "post_attention_layernorm"),
            ):
                out[h + theirs + ".weight"], out[h + theirs + ".bias"] = norm(ours)
            (wq, bq), (wk, bk), (wv, bv) = (lin(b + f"attn.{n}", d) for n in ("w_q", "w_k", "w_v"))
            wq, bq = wq * q_scale, bq * q_scale
            # NeoX's fused projection is laid out per head: [q_h; k_h; v_h] for each head h.
            per_head = [t.view(n_head, head_dim, -1) for t in (wq, wk, wv)]
            out[h + "attention.query_key_value.weight"] = torch.cat(per_head, 1).reshape(3 * d, d)
            wo, bo = lin(b + "attn.w_o", d)
            out[h + "attention.dense.weight"] = wo
            if cfg.bias:
                per_head_b = [t.view(n_head, head_dim) for t in (bq, bk, bv)]
                out[h + "attention.query_key_value.bias"] = torch.cat(per_head_b, 1).reshape(-1)
                out[h + "attention.dense.bias"] = bo
            for ours, theirs, n in (
                ("w_up", "dense_h_to_4h", hidden),
                ("w_down", "dense_4h_to_h", d),
            ):
                out[f"{h}mlp.{theirs}.weight"], out[f"{h}mlp.{theirs}.bias"] = lin(
                    f"{b}mlp.{ours}", n
                )
        out["lm_head.weight"] = head
        return out

    # GPT-2: Conv1D weights are stored (in, out), the transpose of nn.Linear's.
    out["transformer.wte.weight"] = sd["wte.weight"]
    out["transformer.wpe.weight"] = sd["wpe.weight"]
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = norm("ln_f")
    hidden = int(cfg.mlp_ratio * d)
    for i in range(cfg.n_layer):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        out[h + "ln_1.weight"], out[h + "ln_1.bias"] = norm(b + "ln_1")
        out[h + "ln_2.weight"], out[h + "ln_2.bias"] = norm(b + "ln_2")
        (wq, bq), (wk, bk), (wv, bv) = (lin(b + f"attn.{n}", d) for n in ("w_q", "w_k", "w_v"))
        out[h + "attn.c_attn.weight"] = torch.cat([wq * q_scale, wk, wv], 0).t().contiguous()
        out[h + "attn.c_attn.bias"] = torch.cat([bq * q_scale, bk, bv])
        wo, bo = lin(b + "attn.w_o", d)
        out[h + "attn.c_proj.weight"], out[h + "attn.c_proj.bias"] = wo.t().contiguous(), bo
        wu, bu = lin(b + "mlp.w_up", hidden)
        out[h + "mlp.c_fc.weight"], out[h + "mlp.c_fc.bias"] = wu.t().contiguous(), bu
        wd, bd = lin(b + "mlp.w_down", d)
        out[h + "mlp.c_proj.weight"], out[h + "mlp.c_proj.bias"] = wd.t().contiguous(), bd
    out["lm_head.weight"] = head
    return out


# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_tokenizer_json(ballast_json: str) -> str:
    """Ballast's byte tokenizer (id = the UTF-8 byte, then EOS and PAD) as a tokenizers
    JSON: a BPE with no merges over ByteLevel's 256 symbols, one symbol per byte, and no
    regex split, so every byte becomes exactly its own id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    body = json.loads(ballast_json)
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    for name, i in sorted(body["special_tokens"].items(), key=lambda kv: kv[1]):
        hf.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        if hf.token_to_id(name) != i:
            raise ExportError(f"byte tokenizer: {name} got id {hf.token_to_id(name)}, not {i}")
    return hf.to_str()


def hf_tokenizer(tokenizer_json: str, special: Special, seq_len: int) -> Any:
    """A PreTrainedTokenizerFast over the dataset's tokenizer, EOS/pad set from its manifest."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    # Ballast's byte tokenizer file is its own small JSON, marked as such (dataprep/tokenizer).
    try:
        is_bytes = "ballast_tokenizer" in json.loads(tokenizer_json)
        text = _byte_tokenizer_json(tokenizer_json) if is_bytes else tokenizer_json
        hf = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on a schema error
        raise ExportError(f"the dataset's tokenizer file cannot be read: {e}") from None
    eos, pad = hf.id_to_token(special.eos_id), hf.id_to_token(special.pad_id)
    if eos is None or pad is None:
        raise ExportError(
            f"the tokenizer has no token for eos id {special.eos_id} or pad id {special.pad_id}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=hf, eos_token=eos, pad_token=pad, bos_token=eos, model_max_length=seq_len
    )


# ---------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------


def find_checkpoint(path: str | Path) -> tuple[Path, int]:
    """(checkpoint root, step) for a `step-N` directory, a checkpoint root (its `latest`,
    else its newest step) or a run directory (its `checkpoints/`)."""
    p = Path(path)
    m = re.fullmatch(r"step-(\d+)", p.name)
    if m and p.is_dir():
        return p.parent, int(m.group(1))
    for root in (p, p / "checkpoints"):
        step = ckpt.latest_step(root)
        if step is None and ckpt.steps(root):
            step = ckpt.steps(root)[-1]
        if step is not None:
            return root, step
    raise ExportError(
        f"{path}: no checkpoint there (a step-N directory, a checkpoint "
        "directory or a run directory)"
    )


def load_checkpoint(root: Path, step: int) -> tuple[TrainConfig, dict[str, Tensor]]:
    """The run's config and the model's state dict (float32, CPU), local or DCP."""
    try:
        state = ckpt.load(root, step)  # verifies every file's sha256 first
    except ckpt.CheckpointError as e:
        raise ExportError(str(e)) from None
    if "config" not in state:
        raise ExportError(f"{root / ckpt.step_name(step)}: the checkpoint holds no config")
    try:
        cfg = TrainConfig.model_validate(state["config"])
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise ExportError(
            f"{root / ckpt.step_name(step)}: its config is not valid here: "
            f"{' '.join(str(e).split())}"
        ) from None
    if "model" in state:
        return cfg, state["model"]
    if not ckpt.is_sharded(root, step):
        raise ExportError(f"{root / ckpt.step_name(step)}: the checkpoint holds no model")
    return cfg, _load_dcp(root / ckpt.step_name(step))


def _load_dcp(d: Path) -> dict[str, Tensor]:
    """The model's tensors of a DCP checkpoint, read whole in this one process (DCP
    reshards on load, so any world size reads back as plain tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(d)).read_metadata()
    model: dict[str, Tensor] = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            model[key.removeprefix("model.")] = torch.empty(md.size, dtype=md.properties.dtype)
    if not model:
        raise ExportError(f"{d}: the DCP checkpoint holds no model tensors")
    state = {"model": model}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(d), no_dist=True)
    return state["model"]


# ---------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    dataset: str | None = None,
    dtype: str = "float32",
    max_shard_size: str = "5GB",
) -> tuple[Path, str]:
    """Write the transformers directory; returns (out_dir, the class name)."""
    try:
        import transformers
    except ImportError:
        raise ExportError(
            "`ballast export hf` needs transformers: pip install 'ballast-lm[hf]'"
        ) from None

    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    root, step = find_checkpoint(checkpoint)
    cfg, sd = load_checkpoint(root, step)
    arch = architecture(cfg.model)  # refuse before reading the dataset
    uri, manifest, tok_json = _dataset_tokenizer(dataset or cfg.dataset, cfg.storage)
    info = manifest["tokenizer"]
    special = Special(int(info["eos_id"]), int(info["pad_id"]))
    seq_len = int(manifest["seq_len"])
    vocab_size = int(sd["wte.weight"].shape[0])
    if vocab_size != int(info["vocab_size"]):
        raise ExportError(
            f"the checkpoint's vocabulary ({vocab_size}) is not the dataset's "
            f"({info['vocab_size']}, {uri})"
        )
    if "wpe.weight" in sd:
        seq_len = int(sd["wpe.weight"].shape[0])

    config = hf_config(cfg.model, vocab_size, seq_len, special)
    weights = hf_state_dict(cfg.model, sd)
    model = getattr(transformers, arch)(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Only the tied head may be missing (it is the embedding); anything else is a bug.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ExportError(
            f"{arch}: weights do not fit (missing {missing}, unexpected {unexpected})"
        )
    model = model.to(DTYPES[dtype]).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=special.eos_id, eos_token_id=special.eos_id, pad_token_id=special.pad_id
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    tokenizer = hf_tokenizer(tok_json, special, seq_len)
    tokenizer.save_pretrained(out)
    _add_legacy_keys(out, cfg.model, arch)
    return out, arch


def _add_legacy_keys(out: Path, cfg: ModelConfig, arch: str) -> None:
    """Also write the names transformers 4.x reads (it ignores 5.x's `rope_parameters` and
    knows no `TokenizersBackend`); 5.x reads `rope_parameters` first, so both agree."""
    legacy: dict[str, Any] = {}
    if cfg.position == "rope":
        legacy["rope_theta"] = cfg.rope_theta
    if arch == "GPTNeoXForCausalLM":
        legacy |= {"rotary_pct": cfg.rotary_pct, "rotary_emb_base": cfg.rope_theta}
    for name, extra in (
        ("config.json", legacy),
        ("tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"}),
    ):
        path = out / name
        body = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(
            json.dumps({**body, **extra}, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )


def _dataset_tokenizer(uri: str, options: StorageOptions) -> tuple[str, dict[str, Any], str]:
    """(the dataset's newest version, its manifest, its tokenizer file's text)."""
    from core.errors import StorageError

    try:
        uri = resolve(uri, options)
        manifest = read_manifest(uri, options)
        name = manifest["tokenizer"]["file"]
        text = open_store(uri, options).get(name).decode("utf-8")
    except (StorageError, KeyError, ValueError) as e:
        raise ExportError(
            f"dataset {uri}: cannot read its tokenizer ({e}); pass --dataset if it has moved"
        ) from None
    return uri, manifest, text
