"""Benchmark: char-level tinyshakespeare on CPU, ballast's trainer vs the classic
nanoGPT "baby" run, in the same process on the same machine.

    python -m benchmarks.train_cpu [--iters 2000] [--skip-classic] [--out FILE.json]

Ballast: ../shared/data/tinyshakespeare.txt through `ballast prep` with byte tokens and
seq_len 64; the first 90% of the file is the train split and the last 10% the
validation split (as the classic run splits it); a 4-layer, 128-wide, 4-head model;
batch 12; `--iters` iterations; lr with warmup and cosine decay; no dropout.

Classic: nanoGPT's model.py architecture (LayerNorm with bias, learned positions, GELU
MLP, tied head) and train.py loop (random 64-token windows, AdamW betas 0.9/0.99,
wd 0.1 on 2-D weights, lr 1e-3, warmup 100, cosine to 1e-4, clip 1.0), written here from
its published description (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import RESULTS, ROOT, SHARED, has_dataset, write_json


# ---- the classic baseline -------------------------------------------------------------
class ClassicBlock(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class ClassicGPT(nn.Module):
    def __init__(self, vocab: int, block: int, d: int = 128, n_layer: int = 4, h: int = 4):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(ClassicBlock(d, h) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * n_layer)
                    if name.endswith(("c_proj.weight", "mlp_proj.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def classic_run(data: np.ndarray, split: int, iters: int, seed: int = 1337) -> dict:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train, val = (
        torch.from_numpy(data[:split].astype(np.int64)),
        torch.from_numpy(data[split:].astype(np.int64)),
    )
    block, batch = 64, 12
    model = ClassicGPT(256, block)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.99),
    )

    def get_batch(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ix = rng.integers(0, len(src) - block, batch)
        x = torch.stack([src[i : i + block] for i in ix])
        y = torch.stack([src[i + 1 : i + 1 + block] for i in ix])
        return x, y

    def lr_at(it: int) -> float:
        if it < 100:
            return 1e-3 * (it + 1) / 100
        ratio = (it - 100) / (iters - 100)
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * ratio)) * (1e-3 - 1e-4)

    t0 = time.perf_counter()
    for it in range(iters):
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        x, y = get_batch(train)
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    secs = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():  # nanoGPT's estimate_loss: 200 random validation batches
        losses = [
            F.cross_entropy(model(x).view(-1, 256), y.view(-1)).item()
            for x, y in (get_batch(val) for _ in range(200))
        ]
    return {
        "val_loss": float(np.mean(losses)),
        "seconds": round(secs, 2),
        "ms_per_iter": round(1000 * secs / iters, 2),
        "tokens_per_s": round(iters * batch * block / secs),
    }


# ---- ballast --------------------------------------------------------------------------
# The classic run's architecture in ballast's model (LayerNorm with bias, learned positions,
# GELU): the trainer's overhead measured on the same FLOPs as the classic loop.
CLASSIC_ARCH = {"norm": "layernorm", "position": "learned", "mlp": "gelu", "bias": True}


def ballast_run(
    text: str,
    split: int,
    iters: int,
    work: Path,
    lr: float,
    arch: dict | None = None,
    fused: bool = False,
    extra: dict | None = None,
) -> dict:
    from dataprep.config import parse_config
    from dataprep.pipeline import run_prep
    from training.config import parse_train_config
    from training.metrics import read
    from training.train import Trainer

    work.mkdir(parents=True, exist_ok=True)
    (work / "train.txt").write_text(text[:split], encoding="utf-8")
    (work / "val.txt").write_text(text[split:], encoding="utf-8")
    out = work / "prep"
    if not has_dataset(out / "dataset"):
        run_prep(
            parse_config(
                {
                    "output": str(out),
                    "workers": 1,
                    "sources": [
                        {"name": "train", "paths": [str(work / "train.txt")], "split": "train"},
                        {"name": "val", "paths": [str(work / "val.txt")], "split": "validation"},
                    ],
                    "dedup": {"exact": False, "near": False},
                    "quality": [],
                    "mixture": {"max_epochs": 1.0},
                    "pack": {"seq_len": 64, "strategy": "bfd"},
                    "dataset": {"validation_fraction": 0.0, "pack_partitions": 1},
                }
            ),
            progress=False,
        )
    run_dir = work / "run"
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = parse_train_config(
        {
            "dataset": str(out / "dataset"),
            "run_dir": str(run_dir),
            "seed": 1337,
            "steps": iters,
            "micro_batch": 12,
            "eval_every": iters,
            "log_every": 50,
            "model": {"d_model": 128, "n_layer": 4, "n_head": 4, **(arch or {})},
            "optim": {
                "name": "adamw",
                "lr": lr,
                "betas": [0.9, 0.99],
                "weight_decay": 0.1,
                "fused": fused,
            },
            "schedule": {"kind": "cosine", "warmup_steps": 100, "min_lr_ratio": 0.1},
            "checkpoint": {"every": iters, "keep_last": 1},
            **(extra or {}),
        }
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    code = trainer.run()
    secs = time.perf_counter() - t0
    recs = read(run_dir / "metrics.jsonl")
    val = [r["val_loss"] for r in recs if r.get("kind") == "eval"][-1]
    tokens = [r["tokens_seen"] for r in recs if r.get("kind") == "train"][-1]
    return {
        "exit_code": code,
        "val_loss": round(val, 4),
        "seconds": round(secs, 2),
        "setup_seconds": round(setup, 2),
        "ms_per_iter": round(1000 * secs / iters, 2),
        "tokens_per_s": round(tokens / secs),
        "lr": lr,
        "arch": arch or "recipe",
        "fused_adamw": fused,
        "train_rows": trainer.data.train.rows,
        "run_dir": str(run_dir),
        "val_rows": trainer.data.validation.rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--skip-classic", action="store_true")
    ap.add_argument(
        "--arch",
        choices=["recipe", "classic"],
        default="recipe",
        help="ballast's default model (RMSNorm, RoPE, SwiGLU) or the classic one",
    )
    ap.add_argument("--fused", action="store_true", help="torch's fused AdamW kernel")
    ap.add_argument("--out", default=str(RESULTS / "train_cpu.json"))
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-train"))
    args = ap.parse_args()
    path = SHARED / "tinyshakespeare.txt"
    if not path.is_file():
        print(f"skip: {path} not found")
        return
    text = path.read_text(encoding="utf-8")
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    split = int(0.9 * len(text))
    result: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_start": os.getloadavg(),
            "torch_threads": torch.get_num_threads(),
        },
        "iters": args.iters,
    }
    result["ballast"] = ballast_run(
        text,
        split,
        args.iters,
        Path(args.workdir),
        args.lr,
        CLASSIC_ARCH if args.arch == "classic" else None,
        args.fused,
    )
    print(json.dumps({"ballast": result["ballast"]}, indent=2))
    if not args.skip_classic:
        result["classic"] = classic_run(data, split, args.iters)
        print(json.dumps({"classic": result["classic"]}, indent=2))
        result["speedup_tokens_per_s"] = round(
            result["ballast"]["tokens_per_s"] / result["classic"]["tokens_per_s"], 3
        )
    result["machine"]["load_avg_end"] = os.getloadavg()
    result["targets"] = {"val_loss": 1.85, "tokens_per_s_vs_classic": 1.2}
    write_json(args.out, result, end="")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
