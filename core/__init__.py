"""The bottom layer: what prep, training, launching and the CLI all share.

Storage (the Store interface, local and S3), file helpers, retry with backoff,
credential redaction, typed errors, config loading, the dataset contract and the run
protocol (exit codes, event lines). Nothing here imports from dataprep/, training/, infra/
or flows/ (checked by the import contract in pyproject.toml)."""
