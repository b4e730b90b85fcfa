"""After-training evaluation (`ballast eval`): the model of a checkpoint scored by the same
Evaluator the trainer's `evals` component runs, on the same tasks, so a checkpoint's numbers
equal the in-loop evaluation's at its step.

What makes them equal: the checkpoint's own config (model, precision, EMA), the dataset's
tokenizer and seq_len, the run's `evals` section (its batch size too: batches are filled
longest first, and a different batch changes the float sums in their last bits), and the
weights the loop evaluates (the EMA's when `ema` is on). The checkpoint is found and read by
training/export_hf.py's functions, the run's config and dataset by training/blame.py's.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.dataset import not_a_dataset, read_manifest
from core.errors import ConfigError, StorageError
from training import checkpoint as ckpt
from training.blame import local_dataset
from training.config import TrainConfig, load_train_config
from training.config.evals import EvalsConfig, EvalTask, EvalText
from training.data import DatasetError
from training.evals.runner import Evaluator, Result
from training.evals.tasks import EvalDataError
from training.evals.tokenizer import dataset_tokenizer
from training.export_hf import ExportError, export_hf, find_checkpoint, load_checkpoint
from training.model import GPT
from training.step import autocast


class EvalError(ValueError):
    """`ballast eval` cannot run: one line naming the cause (exit 1)."""


@dataclass
class Loaded:
    """A checkpoint's model, ready to score, and where it came from."""

    root: Path
    step: int
    cfg: TrainConfig
    model: GPT
    weights: str  # "ema" or "model"
    dataset: str
    manifest: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.root / ckpt.step_name(self.step)

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])


def parse_named(value: str, flag: str) -> list[tuple[str, str | None]]:
    """`a,b=path.jsonl` -> [(a, None), (b, path.jsonl)]."""
    out: list[tuple[str, str | None]] = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, path = part.partition("=")
        if not name.strip() or (eq and not path.strip()):
            raise EvalError(f"{flag} {value!r}: expected NAME or NAME=PATH, comma-separated")
        out.append((name.strip(), path.strip() if eq else None))
    if not out:
        raise EvalError(f"{flag} {value!r}: no names in it")
    return out


def evals_config(
    base: EvalsConfig | None,
    tasks: str | None = None,
    texts: str | None = None,
    limit: int | str | None = "run",
    batch_size: int | None = None,
) -> EvalsConfig:
    """The run's `evals` section (`base`), with the command line's choices over it: `tasks` /
    `texts` name the sets to score (either replaces both lists of the run's section: what
    is asked for is what is scored; a bare name the section defines keeps its definition);
    `limit` an int, None (all items) or "run" (the section's own; 500 without one)."""
    data: dict[str, Any] = base.model_dump() if base is not None else {}
    if tasks is not None or texts is not None:
        # A bare name the run's section defines (a local file, a variant) is the run's.
        known = {t.name: t for t in base.task_list()} if base is not None else {}
        known_texts = {t.name: t for t in base.texts} if base is not None else {}
        data["tasks"] = [
            (known.get(name) or EvalTask(name=name)).model_dump()
            if path is None
            else EvalTask(name=name, path=path).model_dump()
            for name, path in (parse_named(tasks, "--tasks") if tasks else [])
        ]
        text_list = []
        for name, path in parse_named(texts, "--texts") if texts else []:
            if path is None and name not in known_texts:
                raise EvalError(
                    f"--texts {name}: not a text set of the run's evals section; "
                    "give its file: NAME=PATH.jsonl"
                )
            spec = known_texts[name] if path is None else EvalText(name=name, path=path)
            text_list.append(spec.model_dump())
        data["texts"] = text_list
    elif base is None:
        raise EvalError(
            "the run's config has no `evals` section: name what to score with --tasks "
            "(e.g. arc_easy,hellaswag) or --texts NAME=PATH.jsonl"
        )
    if limit != "run":
        data["limit"] = limit
    if batch_size is not None:
        data["batch_size"] = batch_size
    try:
        return EvalsConfig.model_validate(data)
    except ValueError as e:  # pydantic's ValidationError: the first error's message
        errors = getattr(e, "errors", None)
        msg = errors()[0]["msg"] if callable(errors) else str(e)
        raise EvalError(f"evals: {' '.join(str(msg).split())}") from None


def open_checkpoint(
    path: str | Path,
    config: str | None = None,
    dataset: str | None = None,
    device: torch.device | None = None,
    weights: str = "auto",
) -> tuple[Loaded, EvalsConfig | None]:
    """The model at `path` (a step-N directory, a checkpoint directory or a run directory)
    and the `evals` section to score it with: `config`'s (a training YAML) if given, else
    the checkpoint's own config's. `weights`: auto (the EMA's when the run kept one, as the
    loop evaluates), ema or model."""
    p = Path(path)
    if not p.exists():
        raise EvalError(f"{p}: no such checkpoint or run directory")
    try:
        root, step = find_checkpoint(p)
        cfg, sd = load_checkpoint(root, step)
    except ExportError as e:
        raise EvalError(str(e)) from None
    evals = cfg.evals
    if config is not None:
        try:
            evals = load_train_config(config).evals
        except ConfigError as e:
            raise EvalError(" ".join(str(e).split())) from None

    try:
        uri = local_dataset(dataset or cfg.dataset)
    except (StorageError, DatasetError) as e:  # an object store that cannot be read
        raise EvalError(f"the run's dataset: {' '.join(str(e).split())}") from None
    missing = not_a_dataset(str(uri))
    if missing is not None:
        raise EvalError(f"{missing}; the run's dataset is gone? pass --dataset")
    manifest = read_manifest(str(uri))
    vocab = int(manifest["tokenizer"]["vocab_size"])
    if int(sd["wte.weight"].shape[0]) != vocab:
        raise EvalError(
            f"the checkpoint's vocabulary ({sd['wte.weight'].shape[0]}) is not the dataset's "
            f"({vocab}, {uri}); pass the run's --dataset"
        )
    model = GPT(cfg.model, vocab, int(manifest["seq_len"]))
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        raise EvalError(
            f"{root / ckpt.step_name(step)}: weights do not fit its config: "
            f"{str(e).splitlines()[0]}"
        ) from None
    used = _load_weights(model, root, step, cfg, weights)
    model = model.to(device or torch.device("cpu")).eval()
    return Loaded(root, step, cfg, model, used, str(uri), manifest), evals


def _load_weights(model: GPT, root: Path, step: int, cfg: TrainConfig, weights: str) -> str:
    """Put the EMA weights in `model` where asked for (or, with auto, where the run kept an
    EMA: the in-loop evaluation scores those); returns which weights it holds."""
    if weights == "model" or (weights == "auto" and cfg.ema is None):
        return "model"
    # load_checkpoint returns the model's tensors only; the EMA is its own entry (a list in
    # model.parameters() order, the `ema` component's state), read from the same files.
    shadow = ckpt.load(root, step).get("ema") if not ckpt.is_sharded(root, step) else None
    if not shadow:
        if weights == "ema":
            raise EvalError(f"{root / ckpt.step_name(step)}: the checkpoint holds no EMA weights")
        return "model"
    params = list(model.parameters())
    if len(shadow) != len(params):
        raise EvalError(f"{root / ckpt.step_name(step)}: its EMA does not fit the model")
    with torch.no_grad():
        for p, s in zip(params, shadow, strict=True):
            p.copy_(s)
    return "ema"


def evaluate(
    loaded: Loaded, cfg: EvalsConfig, device: torch.device
) -> tuple[Result, dict[str, str]]:
    """Score `loaded` on `cfg`'s tasks and text sets (one process); with each set's primary
    metric (the one the loop judges regressions on)."""
    try:
        tok = dataset_tokenizer(Path(loaded.dataset), loaded.manifest)
        evaluator = Evaluator(cfg, tok, loaded.seq_len)
    except (EvalDataError, ValueError) as e:
        raise EvalError(str(e)) from None

    def forward(ids: torch.Tensor) -> torch.Tensor:
        with autocast(loaded.cfg, device):
            return loaded.model(ids)

    return evaluator.run(forward, device), evaluator.metrics()


def export(loaded: Loaded, out: Path) -> None:
    """`ballast export hf` of the weights `loaded` holds: its checkpoint's, or with the EMA's
    a copy of the checkpoint whose model is the EMA (export_hf reads a checkpoint), so that
    lm-eval scores the weights `ballast eval` does."""
    if loaded.weights == "model":
        export_hf(loaded.path, out, dataset=loaded.dataset)
        return
    with tempfile.TemporaryDirectory(prefix="ballast-ema-") as tmp:
        sd = {k: v.detach().cpu() for k, v in loaded.model.state_dict().items()}
        state = {"model": sd, "config": loaded.cfg.model_dump(mode="json")}
        ckpt.save(Path(tmp), loaded.step, state)
        export_hf(Path(tmp) / ckpt.step_name(loaded.step), out, dataset=loaded.dataset)


def harness_eval(
    loaded: Loaded, cfg: EvalsConfig, device: torch.device, work: Path
) -> tuple[list[dict[str, Any]], dict[str, float], float]:
    """lm-eval's `hf` model on `loaded` exported under `work/hf`, over `cfg`'s tasks written
    as local lm-eval tasks under `work/tasks`: (table rows, record, seconds)."""
    from training.evals import harness

    specs = cfg.task_list()
    if not specs:
        raise harness.HarnessError("--harness scores multiple-choice tasks: name them with --tasks")
    t0 = time.perf_counter()
    names = harness.write_tasks(work / "tasks", specs, cfg.limit)
    export(loaded, work / "hf")
    scores = harness.run(work / "hf", work / "tasks", names, cfg.limit, cfg.batch_size, device.type)
    rows, record = [], {}
    for s in scores:
        record[f"{s.name}/n"] = float(s.n)
        for m in ("acc", "acc_norm", "bpb"):
            rows.append(
                {
                    "task": s.name,
                    "metric": m,
                    "value": s.values[m],
                    "stderr": s.stderrs[m],
                    "n": s.n,
                    "primary": False,
                }
            )
            record[f"{s.name}/{m}"] = s.values[m]
            record[f"{s.name}/{m}_stderr"] = s.stderrs[m]
    return rows, record, time.perf_counter() - t0


# -- what the command shows and writes ---------------------------------------------------


def rows(result: Result, metrics: dict[str, str]) -> list[dict[str, Any]]:
    """One row per set and metric, the set's primary metric first."""
    out = []
    for s in result.scores:
        primary = metrics.get(s.name)
        for m in sorted(s.values, key=lambda k: (k != primary, k)):
            out.append(
                {
                    "task": s.name,
                    "metric": m,
                    "value": s.values[m],
                    "stderr": s.stderrs[m],
                    "n": s.n,
                    "primary": m == primary,
                }
            )
    return out


def table(lines: list[dict[str, Any]]) -> list[str]:
    """`task  metric  value ± stderr  n` as aligned text; the primary metric marked *."""

    def num(x: float) -> str:
        return "nan" if not math.isfinite(x) else f"{x:.4f}"

    cells = [("task", "metric", "value", "± stderr", "n")] + [
        (
            r["task"],
            r["metric"] + (" *" if r.get("primary") else ""),
            num(r["value"]),
            "± " + num(r["stderr"]),
            str(r["n"]),
        )
        for r in lines
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    return [
        "  ".join(c[i].ljust(widths[i]) if i < 2 else c[i].rjust(widths[i]) for i in range(5))
        for c in cells
    ]
