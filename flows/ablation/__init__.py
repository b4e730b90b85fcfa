"""The parts of the `ablate` flow (flows/ablate.py): its config (config.py) and its
results (results.py)."""
