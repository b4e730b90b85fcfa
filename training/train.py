"""The trainer's command line: `python -m training.train --config X`.

One process; torchrun comes with multi-process training. What a run does is in
training/trainer.py.

Exit codes (shared with launchers and Kubernetes): 0 done, 1 bad config or data,
3 diverged beyond the rollback budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.errors import BucketMissing, StorageError
from core.protocol import EXIT_CRASHED, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK
from training import checkpoint as ckpt
from training import distributed
from training.arguments import add_train_overrides, train_overrides
from training.config import TrainConfigError, load_train_config
from training.data import DatasetError
from training.faults import Faults
from training.recovery import Recovery
from training.trainer import Trainer

__all__ = ["Trainer", "main"]


def main(argv: list[str] | None = None) -> int:
    from training.entrypoint import record_exit

    try:
        code = _main(argv)
    finally:
        # On every path, an exception's included (then the traceback still holds the
        # trainer; the group goes anyway, as torchtitan's does).
        distributed.shutdown()
    record_exit(code)  # for the pod entrypoint: torchrun hides worker exit codes
    return code


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.train", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--config", required=True)
    add_train_overrides(ap)
    ap.add_argument(
        "--recover",
        action="store_true",
        help="restart after exit 3 (the supervisor passes this): back to a "
        "checkpoint, skip data, scale the LR, fresh rollback budget",
    )
    ap.add_argument("--rollback-to", type=int, help="with --recover: newest checkpoint <= this")
    ap.add_argument(
        "--skip-to-sample",
        type=int,
        help="with --recover: resume the training order at this sample",
    )
    ap.add_argument(
        "--lr-scale",
        type=float,
        default=0.5,
        help="with --recover: multiply the learning rate (default 0.5)",
    )
    ap.add_argument(
        "--fault",
        action="append",
        default=[],
        help="inject a fault (tests): nan@S[,S], spike@S[,S], kill@S, lr_blowup@A-B, "
        "lr_blowup_persistent@A-B",
    )
    args = ap.parse_args(argv)
    try:
        cfg = load_train_config(args.config, train_overrides(args))
        # A relative run_dir is taken from the working directory (docs/training.md); this
        # process says where with absolute paths (the closing block, Ctrl-C's line).
        cfg = cfg.model_copy(update={"run_dir": str(Path(cfg.run_dir).absolute())})
        if not 0 < args.lr_scale <= 1:
            raise ValueError(f"--lr-scale must be in (0, 1], got {args.lr_scale}")
        request = (
            Recovery(args.rollback_to, args.skip_to_sample, args.lr_scale) if args.recover else None
        )
        trainer = Trainer(cfg, Faults.parse(args.fault), request)
    except (TrainConfigError, DatasetError, ckpt.CheckpointError, ValueError, BucketMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except StorageError as e:  # unreachable or failing storage at start: worth a restart
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CRASHED
    except KeyboardInterrupt:
        print("interrupted before training began; run the same command again", file=sys.stderr)
        return EXIT_INTERRUPTED
    try:
        code = trainer.run()
    except KeyboardInterrupt:  # Ctrl-C: run() has closed the loader and the checkpoint saver
        if trainer.world.is_main:
            print(interrupted(trainer.state.step, cfg.steps, trainer.ckpt_dir), file=sys.stderr)
        code = EXIT_INTERRUPTED
    if code == EXIT_OK:
        distributed.exit_barrier(trainer.world)
    del trainer  # freed before main's distributed.shutdown destroys the group
    return code


def interrupted(step: int, steps: int, ckpt_dir: Path) -> str:
    """What Ctrl-C leaves behind, in one line: where training stopped, the checkpoint the
    same command resumes from."""
    try:
        newest = max(ckpt.steps(ckpt_dir), default=None)
    except OSError:
        newest = None
    if newest is None:
        return (
            f"interrupted at step {step} of {steps}, before the first checkpoint; "
            "run the same command again to start over"
        )
    return (
        f"interrupted at step {step} of {steps}; run the same command again to resume from "
        f"the checkpoint at step {newest} ({Path(ckpt_dir).absolute() / ckpt.step_name(newest)})"
    )


if __name__ == "__main__":
    sys.exit(main())
