"""Benchmark: how long the training loop is blocked per checkpoint, background vs
synchronous save, for a ~100M-parameter model with AdamW state on CPU; and upload
throughput of that checkpoint to a loopback S3 server (moto_server).

    python -m benchmarks.checkpoint_stall [--repeats 3] [--out FILE.json]

Target: the background save's stall is <= 10% of the synchronous save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, ROOT, machine, write_json


def build_state() -> tuple[dict, int]:
    from training.config import ModelConfig, OptimConfig
    from training.model import GPT
    from training.optim import build_optimizer

    torch.manual_seed(0)
    # GPT-2 small's shape (124M parameters with a 50304 vocabulary).
    model = GPT(ModelConfig(d_model=768, n_layer=12, n_head=12), vocab_size=50304, max_seq_len=1024)
    opt = build_optimizer(model, OptimConfig())
    x = torch.randint(0, 50304, (1, 32))
    model(x).float().mean().backward()  # one step, so AdamW has its two moments
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": {"step": 1}}, n


def state_bytes(tree: object) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(state_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(state_bytes(v) for v in tree)
    return 0


def upload_throughput(root: Path, step: int) -> dict:
    """Upload the checkpoint to a moto_server on loopback with the trainer's uploader."""
    from core.store import StorageOptions
    from training.checkpoint.remote import RemoteCheckpoints

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    moto = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        )
        import boto3

        for _ in range(100):
            try:
                boto3.client("s3").create_bucket(Bucket="bench")
                break
            except Exception:
                time.sleep(0.1)
        remote = RemoteCheckpoints("s3://bench/ckpt", StorageOptions(), log=lambda m: None)
        t0 = time.perf_counter()
        remote.submit(root, step)
        remote.wait()
        secs = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (root / f"step-{step:08d}").iterdir())
        t0 = time.perf_counter()
        restore_dir = root.parent / "restored"
        shutil.rmtree(restore_dir, ignore_errors=True)
        remote.restore_latest(restore_dir)
        rsecs = time.perf_counter() - t0
        remote.close()
        return {
            "bytes": size,
            "upload_seconds": round(secs, 2),
            "upload_mb_per_s": round(size / 1e6 / secs, 1),
            "restore_seconds": round(rsecs, 2),
            "restore_mb_per_s": round(size / 1e6 / rsecs, 1),
        }
    finally:
        moto.terminate()
        moto.wait()


def main() -> None:
    from training import checkpoint as ckpt

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "checkpoint_stall.json"))
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-ckpt"))
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    state, n_params = build_state()
    sync, stall, bg_total = [], [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        ckpt.save(work / "sync", i, state)
        sync.append(time.perf_counter() - t0)
    saver = ckpt.AsyncSaver()
    for i in range(args.repeats):
        t0 = time.perf_counter()
        saver.save(work / "async", i, state)
        stall.append(saver.last_stall_s)
        saver.wait()
        bg_total.append(time.perf_counter() - t0)
    upload = upload_throughput(work / "async", args.repeats - 1)
    result = {
        "machine": machine(),
        "params": n_params,
        "state_bytes": state_bytes(state),
        "sync_save_seconds": [round(x, 3) for x in sync],
        "async_stall_seconds": [round(x, 3) for x in stall],
        "async_total_seconds": [round(x, 3) for x in bg_total],
        "median_sync_s": round(statistics.median(sync), 3),
        "median_stall_s": round(statistics.median(stall), 3),
        "stall_fraction_of_sync": round(statistics.median(stall) / statistics.median(sync), 4),
        "target_stall_fraction": 0.10,
        "upload": upload,
    }
    print(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    write_json(args.out, result, end="")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
