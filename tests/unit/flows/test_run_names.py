"""Flow run names tell runs apart (issue 29, item 3): the run dir and steps, where a run's
parameters set them, beside the flow and config names."""

from __future__ import annotations

from flows.runs import name_for


def test_run_dir_and_steps_are_in_the_name():
    assert (
        name_for(
            "pipeline",
            {"prep_config": "configs/demo.yaml", "run_dir": "runs/night", "steps": 60},
            "2026-11-26-0300",
        )
        == "pipeline-demo-night-60steps-2026-11-26-0300"
    )


def test_unset_parameters_leave_the_name_as_it_was():
    assert (
        name_for(
            "train",
            {"config_path": "configs/train-demo.yaml", "run_dir": None, "steps": None},
            "2026-11-26-0300",
        )
        == "train-train-demo-2026-11-26-0300"
    )
    assert name_for("prep", {}, "2026-11-26-0300") == "prep-run-2026-11-26-0300"
