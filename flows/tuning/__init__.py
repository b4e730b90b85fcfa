"""The parts of the `hpo` flow (flows/hpo.py): the search config, the Optuna study, the
trials as supervised training jobs, the reports, and muP transfer."""
