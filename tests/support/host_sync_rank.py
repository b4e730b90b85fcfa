"""One rank's host reads per optimizer step (tests/e2e/test_host_sync_parallel.py runs it
under torchrun; without torchrun it is the one-process trainer): the Trainer built from a
config file as the one-process test builds it, a few warm-up steps (the pipeline schedule
infers its shapes on its first call, the optimizer creates its state), then the reads of
each of the next steps, counted on the main thread by `count_host_reads`.

    python -m tests.support.host_sync_rank CONFIG OUT_DIR [--warmup N] [--steps N] [--read-loss]

writes OUT_DIR/rank<R>.json: for every step, warm-up included (`warmup` says how many
lead), the reads by method (torch's optimizer's under "optim.<method>"), every read's site
(method, the frame that made it and, for torch's code, the first frame of ours that led
there) and the guard's verdict."""

from __future__ import annotations

import argparse
import collections
import gc
import json
from pathlib import Path
from typing import Any

import torch

from tests.support.host_sync import count_host_reads
from training import distributed
from training.config import load_train_config
from training.faults import Hooks
from training.trainer import Trainer


class ReadsLoss(Hooks):
    """A planted host read in our step code (the test's proof that the count can fail):
    the loss read back after each micro-batch (each pipeline piece, on the last stage)."""

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        loss.item()
        return loss


def measure(trainer: Trainer, steps: int) -> list[dict[str, Any]]:
    """For each of `steps` train_step() calls: its host reads by method, by site, and the
    guard's verdict."""
    result = []
    for _ in range(steps):
        sites: collections.Counter[str] = collections.Counter()
        with count_host_reads(sites) as counts:
            out = trainer.train_step()
        action = out.decision.action if out.decision else "fp16"
        result.append({"reads": dict(counts), "sites": dict(sites), "action": action})
        trainer.state.step += 1
        trainer.state.samples_seen += out.samples
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--read-loss",
        action="store_true",
        help="plant a read: the loss read back on the host at each loss computation",
    )
    args = ap.parse_args(argv)
    trainer = Trainer(load_train_config(args.config), ReadsLoss() if args.read_loss else None)
    try:
        steps = measure(trainer, args.warmup + args.steps)
    finally:
        trainer.loader.close()
        trainer.ckpts.close()
    w = trainer.world
    result: dict[str, Any] = {"rank": w.rank, "world_size": w.size, "tp": w.tp, "pp": w.pp}
    result |= {"warmup": args.warmup, "steps": steps}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{w.rank}.json").write_text(json.dumps(result, indent=1))
    # CI once saw the pp2 run's last stage abort at exit ("terminate called without an
    # active exception", SIGABRT; not reproduced here in 20 runs, 16 of them two at a time). The
    # trainer's own exit has a barrier before it (the final checkpoint's) and this script
    # had none: no rank now tears its process group down while the other still talks, and
    # the trainer (pipeline stages, schedule, their communication objects) is freed while
    # the interpreter is whole, not during its finalization.
    distributed.barrier(w)
    del trainer
    gc.collect()
    distributed.shutdown()


if __name__ == "__main__":
    main()
