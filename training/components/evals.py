"""`evals`: downstream benchmarks and held-out text sets scored in the training loop every
`evals.every` steps and after the last (training/evals/), on the trainer's own model in eval
mode (the EMA weights when `ema` is on), shared out over the ranks.

Each evaluation writes one "downstream" record (`<task>/<metric>` and its `_stderr` for
every metric, `<task>/n`, the seconds it took), which the metrics log passes on to
TensorBoard and MLflow as `downstream/<task>/<metric>`, and a console line. When a metric
falls below its best so far by more than `evals.regression.k` standard errors, an
`eval_regression` event names the task, the best step and this one, and the data trained
on in between (sources by token share, the documents with the most tokens); with
`action: rollback` the run also rolls back to a checkpoint at or before the best step,
skipping that data, as a divergence does.
"""

from __future__ import annotations

from typing import Any

from training import distributed
from training.components.base import Component
from training.evals.regression import Regression, RegressionTracker
from training.evals.runner import Evaluator, Result, summary_line
from training.evals.tasks import EvalDataError
from training.evals.tokenizer import dataset_tokenizer
from training.evals.window import window_data
from training.metrics import MetricsLog
from training.step import StepResult, autocast


class Evals(Component):
    name = key = "evals"

    def __init__(self, t: Any) -> None:
        super().__init__(t)
        from training.config import TrainConfigError

        cfg = t.cfg.evals
        assert cfg is not None
        self.cfg = cfg
        if t.data.root is None:
            raise TrainConfigError(
                "evals: the dataset has no local copy to read its tokenizer from"
            )
        try:
            tok = dataset_tokenizer(t.data.root, t.data.manifest)
            self.evaluator = Evaluator(cfg, tok, t.data.seq_len)
        except (EvalDataError, ValueError) as e:
            raise TrainConfigError(str(e)) from None
        for line in self.evaluator.notes():
            t.console.say(line)
        reg = cfg.regression
        self.tracker = RegressionTracker(reg.k if reg is not None else float("inf"))
        self._divergence: tuple[str, str, int] | None = None
        self.last: Result | None = None

    # -- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> Any:
        return self.tracker.state_dict()

    def load_state_dict(self, state: Any | None) -> None:
        self.tracker.load_state_dict(state)

    # -- the evaluation -------------------------------------------------------------------
    def evaluate(self) -> Result:
        """Score every task and text set on the current (or EMA) weights, on every rank."""
        t = self.t
        ema = t.component("ema")
        was_training = t.model.training
        t.model.eval()

        def forward(ids: Any) -> Any:
            with autocast(t.cfg, t.device):
                return t.model(ids)

        # By data-parallel rank: the ranks of a TP group score the same sequences together.
        rank, size = distributed.dp_rank_and_size(t.world)

        def run() -> Result:
            return self.evaluator.run(forward, t.device, rank, size, t.world.dp_group)

        try:
            if ema is not None:
                with ema.swapped():  # type: ignore[attr-defined]
                    return run()
            return run()
        finally:
            t.model.train(was_training)

    def after_step(self, log: MetricsLog, out: StepResult) -> None:
        t, s = self.t, self.t.state
        self._divergence = None
        if s.step % self.cfg.every and s.step != t.cfg.steps:
            return
        result = self.last = self.evaluate()
        metrics = self.evaluator.metrics()
        record: dict[str, Any] = {"kind": "downstream", "step": s.step}
        record.update(result.record_fields())
        record["seconds"] = round(result.seconds, 3)
        if t.component("ema") is not None:
            record["weights"] = "ema"
        log.write(record)
        t.console.say(summary_line(s.step, result, metrics))
        if self.cfg.regression is None:
            return
        for sc in result.scores:
            m = metrics[sc.name]
            reg = self.tracker.update(
                f"{sc.name}/{m}",
                m,
                sc.values[m],
                sc.per_item[m],
                s.step,
                s.samples_seen,
            )
            if reg is not None:
                self._regressed(log, reg)

    def _regressed(self, log: MetricsLog, reg: Regression) -> None:
        t, s = self.t, self.t.state
        assert self.cfg.regression is not None
        action = self.cfg.regression.action
        task, metric = reg.key.rsplit("/", 1)
        event: dict[str, Any] = {
            "event": "eval_regression",
            "step": s.step,
            "task": task,
            "metric": metric,
            "value": reg.value,
            "best": reg.best.value,
            "best_step": reg.best.step,
            "drop": reg.drop,
            "stderr": reg.stderr,
            "k": self.tracker.k,
            "action": action,
        }
        # What was trained on since the best step: sampler positions, as blame reads them.
        if t.world.is_main:
            event.update(window_data(t.data, t.sampler, reg.best.samples_seen, s.samples_seen))
        t.record(log, event)
        if action == "rollback" and self._divergence is None:
            self._divergence = (
                "eval_regression",
                f"{task} {metric} {reg.value:.4g} at step {s.step}, below its best "
                f"{reg.best.value:.4g} at step {reg.best.step} by {reg.drop / reg.stderr:.1f} "
                "standard errors",
                reg.best.step + 1,
            )

    def divergence(self) -> tuple[str, str, int] | None:
        d, self._divergence = self._divergence, None
        return d

    def final_fields(self) -> dict[str, Any]:
        if self.last is None:
            return {}
        return {"downstream": self.last.record_fields()}
