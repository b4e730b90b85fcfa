#!/usr/bin/env bash
# Security scan of the Kubernetes manifests with checkov:
#   bash infra/scan.sh
# - every YAML under k8s/ as written,
# - the `kubectl kustomize` output of each overlay (namespace, generated ConfigMaps),
# - the JobSet's Job template as a batch/v1 Job: checkov has no checks for the JobSet CRD.
# Accepted findings are skipped on the objects themselves (checkov.io/skipN annotations with
# their reasons; for the trainer pods see SCAN_SKIPS in infra/k8s_manifests.py).
#
# checkov lives in a venv of its own ($CHECKOV_VENV, default /tmp/checkov-venv): its pins
# clash with the project's. The first run creates it (about 20 s with a PyPI mirror).
# Exit status: checkov's (non-zero when a check fails).
set -euo pipefail
cd "$(dirname "$0")/.."

CHECKOV_VENV=${CHECKOV_VENV:-/tmp/checkov-venv}
CHECKOV_VERSION=${CHECKOV_VERSION:-3.3.30}
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

checkov=${CHECKOV:-}
if [ -z "$checkov" ]; then
  if [ ! -x "$CHECKOV_VENV/bin/checkov" ]; then
    echo "scan: installing checkov $CHECKOV_VERSION into $CHECKOV_VENV" >&2
    python3 -m venv "$CHECKOV_VENV"
    "$CHECKOV_VENV/bin/pip" install -q --upgrade pip
    "$CHECKOV_VENV/bin/pip" install -q "checkov==$CHECKOV_VERSION"
  fi
  checkov="$CHECKOV_VENV/bin/checkov"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if command -v kubectl >/dev/null 2>&1; then
  for overlay in k8s/overlays/*/; do
    kubectl kustomize "$overlay" > "$work/kustomize-$(basename "$overlay").yaml"
  done
else
  echo "scan: kubectl not found; scanning k8s/ without the kustomize output" >&2
fi

"$PYTHON" - "$work/jobset-jobs.yaml" <<'EOF'
import sys
from pathlib import Path

import yaml

from tests.k8s_lint import jobset_child_jobs, load_yaml_files

jobs = [job for _, obj in load_yaml_files([Path("k8s")]) if obj.get("kind") == "JobSet"
        for job in jobset_child_jobs(obj)]
Path(sys.argv[1]).write_text(yaml.safe_dump_all(jobs, sort_keys=False))
EOF

files=()
while IFS= read -r f; do files+=(-f "$f"); done < <(
  find k8s "$work" -name '*.yaml' ! -name kustomization.yaml | sort)

# --skip-download: no calls to the vendor's API (guidelines, severities); the checks
# themselves ship with the package.
"$checkov" "${files[@]}" --framework kubernetes --skip-download --compact --quiet
