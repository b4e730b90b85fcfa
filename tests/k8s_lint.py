"""Moved to tests/support/k8s_lint.py. This name stays for what outside tests/ uses it:
infra/scan.sh (`from tests.k8s_lint import ...`) and k8s/README.md
(`python -m tests.k8s_lint k8s/`)."""

import sys

from tests.support.k8s_lint import jobset_child_jobs, lint, lint_all, load_yaml_files, main

__all__ = ["jobset_child_jobs", "lint", "lint_all", "load_yaml_files", "main"]

if __name__ == "__main__":
    sys.exit(main())
