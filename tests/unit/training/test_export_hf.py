"""`ballast export hf`: for every supported option set, the exported transformers model
loaded offline gives Ballast's logits (fp32, within 1e-4) on real text tokenized by the
exported tokenizer, and the same greedy continuation; unsupported options are refused with
one line naming them; a DCP (FSDP2) checkpoint exports too. Tiny models, nothing downloaded.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from cli.main import main as cli_main
from dataprep.tokenizer import byte_tokenizer, train_bpe
from tests.support.helpers import shared_file
from training import checkpoint as ckpt
from training.config import ModelConfig, TrainConfig
from training.export_hf import UnsupportedArchitecture, architecture, export_hf
from training.model import GPT

SEQ_LEN = 64
TINY = {"d_model": 48, "n_layer": 2, "n_head": 3}

# name -> (model options, tokenizer, the class it must export as)
CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "llama": ({}, "bpe", "LlamaForCausalLM"),
    "llama-mup": ({"mup_base_d_model": 16}, "bytes", "LlamaForCausalLM"),
    "llama-untied-bias": ({"tie_embeddings": False, "bias": True}, "bytes", "LlamaForCausalLM"),
    "qwen3-qknorm": ({"qk_norm": True}, "bytes", "Qwen3ForCausalLM"),
    "qwen3-qknorm-mup": (
        {"qk_norm": True, "mup_base_d_model": 24, "tie_embeddings": False},
        "bpe",
        "Qwen3ForCausalLM",
    ),
    "neox-partial-parallel": (
        {
            "norm": "layernorm",
            "mlp": "gelu",
            "rotary_pct": 0.25,
            "parallel_block": True,
            "bias": True,
        },
        "bytes",
        "GPTNeoXForCausalLM",
    ),
    "neox-sequential-mup": (
        {"norm": "layernorm", "mlp": "gelu", "mup_base_d_model": 16, "rope_theta": 500.0},
        "bpe",
        "GPTNeoXForCausalLM",
    ),
    "gpt2-learned": (
        {
            "norm": "layernorm",
            "mlp": "gelu",
            "position": "learned",
            "bias": True,
            "tie_embeddings": False,
        },
        "bytes",
        "GPT2LMHeadModel",
    ),
    "gpt2-learned-mup-nobias": (
        {"norm": "layernorm", "mlp": "gelu", "position": "learned", "mup_base_d_model": 24},
        "bpe",
        "GPT2LMHeadModel",
    ),
}


@pytest.fixture(scope="module")
def text() -> str:
    return shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, text) -> dict[str, Path]:
    """A dataset directory per tokenizer kind: manifest.json + tokenizer.json, as prep
    writes them (export reads nothing else)."""
    root = tmp_path_factory.mktemp("datasets")
    out = {}
    for kind, tok in (("bytes", byte_tokenizer()), ("bpe", train_bpe([text[:200_000]], 300))):
        d = root / kind
        d.mkdir()
        (d / "tokenizer.json").write_text(tok.to_json(), encoding="utf-8")
        (d / "manifest.json").write_text(
            json.dumps(
                {
                    "seq_len": SEQ_LEN,
                    "tokenizer": {
                        "kind": kind,
                        "vocab_size": tok.vocab_size,
                        "eos_id": tok.eos_id,
                        "pad_id": tok.pad_id,
                        "file": "tokenizer.json",
                    },
                }
            )
        )
        out[kind] = d
    return out


def make_model(options: dict[str, Any], vocab: int, seed: int = 0) -> GPT:
    """A random tiny model whose norm gains and biases are far from 1 and 0, so a norm or
    bias mapped to the wrong place changes the logits."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**TINY, **options), vocab, SEQ_LEN)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if model.param_kind(name) in ("norm", "bias"):
                p.add_(torch.randn_like(p) * 0.3)
            else:  # larger weights: logits that differ clearly between tokens
                p.mul_(3.0)
    return model.eval()


def save_local(model: GPT, run: Path, dataset: Path) -> Path:
    cfg = TrainConfig(dataset=str(dataset), run_dir=str(run), model=model.cfg)
    return ckpt.save(
        run / "checkpoints", 7, {"model": model.state_dict(), "config": cfg.model_dump(mode="json")}
    )


def batch(tokenizer: Any, text: str) -> torch.Tensor:
    """4 rows of real text, SEQ_LEN tokens each, from the exported tokenizer."""
    ids = tokenizer(text[:20_000], add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[i * 997 : i * 997 + SEQ_LEN] for i in range(4)])


def greedy(model: GPT, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.shape[1] :].tolist()


def compare(model: GPT, out: Path, text: str) -> float:
    """Max |logit difference| of the export vs Ballast; asserts greedy generation agrees."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(
        out, local_files_only=True, dtype=torch.float32
    ).eval()
    x = batch(tok, text)
    assert x.shape == (4, SEQ_LEN)
    with torch.no_grad():
        ours = model(x)
        theirs = hf(input_ids=x).logits.float()
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-4, diff
    prompt = x[:1, :20]
    gen = hf.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert gen[0, 20:].tolist() == greedy(model, prompt, 10)
    return diff


@pytest.mark.parametrize("name", list(CASES))
def test_export_matches_ballast(name, datasets, text, tmp_path):
    options, kind, arch = CASES[name]
    dataset = datasets[kind]
    vocab = json.loads((dataset / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    model = make_model(options, vocab)
    assert architecture(model.cfg) == arch
    save_local(model, tmp_path / "run", dataset)
    out, got = export_hf(tmp_path / "run", tmp_path / "hf")  # a run dir: its latest
    assert got == arch
    files = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    gen = json.loads((out / "generation_config.json").read_text())
    manifest = json.loads((dataset / "manifest.json").read_text())["tokenizer"]
    assert (gen["eos_token_id"], gen["pad_token_id"]) == (manifest["eos_id"], manifest["pad_id"])
    diff = compare(model, out, text)
    print(f"{name}: {arch}, max |logit diff| {diff:.2e}")


def test_tokenizer_round_trip(datasets, text, tmp_path):
    """The exported tokenizer gives the dataset tokenizer's ids, and EOS/pad are set."""
    from transformers import AutoTokenizer

    from dataprep.tokenizer import load_tokenizer

    sample = text[:5000] + " ünïcödé ✓"
    for kind, dataset in datasets.items():
        model = make_model(
            {}, json.loads((dataset / "manifest.json").read_text())["tokenizer"]["vocab_size"]
        )
        save_local(model, tmp_path / kind, dataset)
        step_dir = tmp_path / kind / "checkpoints" / "step-00000007"
        out, _ = export_hf(step_dir, tmp_path / f"{kind}-hf")
        ours = load_tokenizer(str(dataset / "tokenizer.json"))
        theirs = AutoTokenizer.from_pretrained(out, local_files_only=True)
        assert (
            theirs(sample, add_special_tokens=False)["input_ids"]
            == ours.encode_batch([sample])[0].tolist()
        )
        assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eos_id, ours.pad_id)
        assert theirs.decode(ours.encode_batch([sample])[0].tolist()) == sample


def test_sharded_safetensors_and_bfloat16(datasets, text, tmp_path):
    """Above --max-shard-size the weights are split with an index; bfloat16 on request."""
    from transformers import AutoModelForCausalLM

    model = make_model({}, 258)
    save_local(model, tmp_path / "run", datasets["bytes"])
    out, _ = export_hf(tmp_path / "run", tmp_path / "hf", max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    compare(model, out, text)
    out16, _ = export_hf(tmp_path / "run", tmp_path / "hf16", dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(out16, local_files_only=True)
    assert hf.dtype == torch.bfloat16


REFUSED = {
    "norm rmsnorm with mlp gelu": {"mlp": "gelu"},
    "norm layernorm with mlp swiglu": {"norm": "layernorm"},
    "parallel_block with norm rmsnorm": {"parallel_block": True},
    "norm rmsnorm with position learned": {"position": "learned"},
    "norm rmsnorm with rotary_pct 0.5": {"rotary_pct": 0.5},
    "qk_norm with norm layernorm": {"norm": "layernorm", "mlp": "gelu", "qk_norm": True},
    "qk_norm with bias": {"qk_norm": True, "bias": True},
    "parallel_block with position learned": {
        "norm": "layernorm",
        "mlp": "gelu",
        "position": "learned",
        "parallel_block": True,
    },
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_unsupported_options_are_refused(what):
    with pytest.raises(UnsupportedArchitecture) as e:
        architecture(ModelConfig(**TINY, **REFUSED[what]))
    assert what in str(e.value) and "\n" not in str(e.value)


def test_cli_export_and_refusal(datasets, text, tmp_path, capsys):
    model = make_model({}, 258)
    step_dir = save_local(model, tmp_path / "run", datasets["bytes"])
    assert (
        cli_main(
            [
                "export",
                "hf",
                str(step_dir),
                str(tmp_path / "hf"),
                "--dataset",
                str(datasets["bytes"]),
            ]
        )
        == 0
    )
    compare(model, tmp_path / "hf", text)
    capsys.readouterr()
    bad = make_model({"mlp": "gelu"}, 258)
    save_local(bad, tmp_path / "bad", datasets["bytes"])
    assert cli_main(["export", "hf", str(tmp_path / "bad"), str(tmp_path / "bad-hf")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "norm rmsnorm with mlp gelu" in err
    assert not (tmp_path / "bad-hf").exists()
    assert cli_main(["export", "hf", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 1
    assert "no checkpoint" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_dcp_checkpoint(datasets, text, tmp_path, monkeypatch):
    """A checkpoint written by save_sharded from an FSDP2 model (one process, gloo on CPU)
    exports like a local one."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = make_model(
        {"norm": "layernorm", "mlp": "gelu", "rotary_pct": 0.5, "parallel_block": True}, 258
    )
    reference = make_model(
        {"norm": "layernorm", "mlp": "gelu", "rotary_pct": 0.5, "parallel_block": True}, 258
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters())
        cfg = TrainConfig(
            dataset=str(datasets["bytes"]),
            run_dir=str(tmp_path / "run"),
            parallel="fsdp2",
            model=reference.cfg,
        )
        ckpt.save_sharded(
            tmp_path / "run" / "checkpoints",
            3,
            model,
            optim,
            {"config": cfg.model_dump(mode="json")},
            True,
            dist.barrier,
        )
    finally:
        dist.destroy_process_group()
    assert ckpt.is_sharded(tmp_path / "run" / "checkpoints", 3)
    out, arch = export_hf(tmp_path / "run", tmp_path / "hf")
    assert arch == "GPTNeoXForCausalLM"
    assert os.path.isfile(out / "model.safetensors")
    compare(reference, out, text)
