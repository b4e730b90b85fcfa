"""muP transfer: the study's best hyperparameters, found on the narrow proxy, written into
a training config at another width (`ballast hpo transfer`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from flows.tuning.config import HpoError, flat_message, load_hpo_config, set_key
from flows.tuning.study import open_study
from training.config import TrainConfigError, parse_train_config, read_train_doc


def transfer(hpo_config: str, width: int, out: str | Path) -> dict[str, Any]:
    """Write the training config at width `width` with the study's best hyperparameters:
    the base config with the proxy's overrides and the best trial's values, d_model set to
    `width`, heads added to keep the proxy's head size, and mup_base_d_model kept at the
    proxy's (muP scales the hidden learning rates, init and readout from it, so lr and
    init_std carry over as they are). The trial budget (steps, eval_every) is not
    transferred. ConfigError / HpoError with one line on what is wrong."""
    s = load_hpo_config(hpo_config)
    m = s.proxy.model
    if m.mup_base_d_model is None:
        raise HpoError(
            f"{hpo_config}: the proxies trained without muP (model.mup_base_d_model "
            "unset), so their hyperparameters do not transfer across width; set "
            f"overrides: {{model.mup_base_d_model: {m.d_model}}} and search again"
        )
    head_dim = m.d_model // m.n_head
    if width % head_dim:
        raise HpoError(
            f"--to-width {width} is not a multiple of the proxy's head size "
            f"{head_dim} (d_model {m.d_model} / n_head {m.n_head})"
        )
    study = open_study(s, create=False)
    try:
        best = study.best_trial
    except ValueError:
        raise HpoError(f"study {s.name} has no completed trial yet") from None
    doc = copy.deepcopy(read_train_doc(s.cfg.base_config))
    if s.cfg.dataset is not None:
        doc["dataset"] = s.cfg.dataset
    for key, value in (*s.cfg.overrides.items(), *best.params.items()):
        set_key(doc, key, value)
    set_key(doc, "model.d_model", width)
    set_key(doc, "model.n_head", width // head_dim)
    set_key(doc, "model.mup_base_d_model", m.mup_base_d_model)
    try:
        parse_train_config(copy.deepcopy(doc), str(out))
    except TrainConfigError as e:
        raise HpoError(f"the transferred config is invalid: {flat_message(str(e))}") from None
    header = (
        f"# Transferred by `ballast hpo transfer` from study {s.name} "
        f"({s.cfg.storage_url()}), trial {best.number}: {s.objective.label} "
        f"{best.value:.4f} at width {m.d_model}.\n# muP base width "
        f"{m.mup_base_d_model}; hyperparameters: {json.dumps(best.params)}\n"
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(header + yaml.safe_dump(doc, sort_keys=False))
    return {
        "out": str(out),
        "trial": best.number,
        "value": best.value,
        "objective": s.objective.label,
        "params": best.params,
        "width": width,
        "base_width": m.mup_base_d_model,
    }
