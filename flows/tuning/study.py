"""The Optuna study of a search: opened (or created, with its sampler, pruner, objective
direction and enqueued parameter sets) in the search's storage, and the parameters a trial
suggests."""

from __future__ import annotations

from typing import Any

from flows.tuning.config import FloatDist, HpoError, IntDist, Search


def open_study(s: Search, create: bool = True) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s.cfg.out_dir().mkdir(parents=True, exist_ok=True)
    if not create:
        try:
            return optuna.load_study(study_name=s.name, storage=s.cfg.storage_url())
        except KeyError:
            raise HpoError(
                f"no study {s.name!r} in {s.cfg.storage_url()}: run "
                f"`ballast hpo run {s.path}` first"
            ) from None
    sc, pc = s.cfg.sampler, s.cfg.pruner
    sampler = (
        optuna.samplers.RandomSampler(seed=sc.seed)
        if sc.kind == "random"
        # constant_liar: trials running in parallel count as bad guesses near their
        # point, so the sampler does not propose the same region twice at once.
        else optuna.samplers.TPESampler(
            seed=sc.seed, n_startup_trials=sc.n_startup_trials, constant_liar=True
        )
    )
    rung = pc.min_resource or s.proxy.eval_every
    pruner = {
        "median": lambda: optuna.pruners.MedianPruner(
            n_startup_trials=pc.n_startup_trials, n_warmup_steps=pc.n_warmup_steps
        ),
        "asha": lambda: optuna.pruners.SuccessiveHalvingPruner(
            min_resource=rung, reduction_factor=pc.reduction_factor
        ),
        "hyperband": lambda: optuna.pruners.HyperbandPruner(
            min_resource=rung, max_resource=s.proxy.steps, reduction_factor=pc.reduction_factor
        ),
        "none": optuna.pruners.NopPruner,
    }[pc.kind]()
    study = optuna.create_study(
        study_name=s.name,
        storage=s.cfg.storage_url(),
        sampler=sampler,
        pruner=pruner,
        direction=s.objective.direction,
        load_if_exists=True,
    )
    _same_objective(s, study)
    for params in s.cfg.enqueue:
        study.enqueue_trial(params, skip_if_exists=True)
    return study


def _same_objective(s: Search, study: Any) -> None:
    """A study keeps the objective and direction it was created with (Optuna stores the
    direction; the objective is a user attribute): trials ranked by one objective are no
    baseline for another, so a changed one is refused, not mixed in."""
    o = s.objective
    had = study.user_attrs.get("objective")
    direction = study.direction.name.lower()
    if had is None and not study.trials:
        study.set_user_attr("objective", o.name)
        had = o.name
    elif had is None:  # a study from before objectives were configurable
        had = "val_loss"
    if (had, direction) != (o.name, o.direction):
        raise HpoError(
            f"study {s.name!r} in {s.cfg.storage_url()} ranks its trials by {had} "
            f"({direction}); this search's objective is {o.name} ({o.direction}): give the "
            "search another `study:` name"
        )


def suggest(trial: Any, space: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, d in space.items():
        if isinstance(d, FloatDist):
            out[key] = trial.suggest_float(key, d.low, d.high, log=d.log, step=d.step)
        elif isinstance(d, IntDist):
            out[key] = trial.suggest_int(key, d.low, d.high, log=d.log, step=d.step)
        else:
            out[key] = trial.suggest_categorical(key, d.choices)
    return out


def trial_state(name: str) -> Any:
    from optuna.trial import TrialState

    return TrialState[name]
