"""Moved to tests/support/tiny_run.py. This name stays for benchmarks/ui_check.py
(`from tests.tiny_run import write_configs`)."""

from tests.support.tiny_run import write_configs

__all__ = ["write_configs"]
