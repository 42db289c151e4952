# Two commands: `make test` and `make demo`. Both create .venv on first use, with exactly the
# versions in requirements.lock (the set the suite last passed with; `make lock` renews it).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock
# A scratch venv with the newest versions pyproject.toml allows (make lock, make test-latest).
LATEST := .cache/latest-venv

# Everything offline and inside the repo.
export HF_HUB_OFFLINE        := 1
export TRANSFORMERS_OFFLINE  := 1
export HF_HOME               := $(CURDIR)/.cache/hf
export TORCH_EXTENSIONS_DIR  := $(CURDIR)/.cache/torch_extensions
export WANDB_DIR             := $(CURDIR)/.cache/wandb
export WANDB_MODE            ?= offline
export TOKENIZERS_PARALLELISM := false

PYTEST := -m pytest -q -p no:cacheprovider
# One pytest-xdist worker per core, each torch at one thread: the suite's models are tiny, so a
# second thread buys nothing while a second worker halves the time. Tests of a module that share a
# module-scoped run stay on one worker (tests/conftest.py); OMP_NUM_THREADS=2 make test overrides.
XDIST  := -n auto --dist loadgroup

.PHONY: setup test test-fast test-latest lock latest-venv demo demo-smollm2 bench clean clean-runs

# The lock constrains every distribution, pip and the build backend included (PIP_CONSTRAINT
# reaches pip's isolated build environment too). torch is pinned by version only, so a CPU
# machine takes the CPU wheel and a GPU machine the CUDA build of the same release.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	PIP_CONSTRAINT=$(CURDIR)/$(LOCK) $(PY) -m pip install -q --upgrade pip setuptools
	PIP_CONSTRAINT=$(CURDIR)/$(LOCK) $(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test test-fast test-latest: export OMP_NUM_THREADS ?= 1

test: setup
	$(PY) $(PYTEST) $(XDIST)

# The inner loop: everything that builds no model and launches no run (tests marked slow, see
# tests/conftest.py), in under a minute.
test-fast: setup
	$(PY) $(PYTEST) $(XDIST) -m "not slow"

demo: setup
	$(PY) scripts/demo.py

demo-smollm2: setup
	$(PY) scripts/demo.py --smollm2

bench: setup
	$(PY) scripts/bench_scorer.py

# The newest versions pyproject.toml allows, resolved afresh into a scratch venv.
latest-venv:
	rm -rf $(LATEST) && python3 -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip setuptools
	$(LATEST)/bin/python -m pip install -q -e '.[dev]'

# Renew the lock from the newest allowed versions, and TRL's field table (train/trl_schema.py)
# for the locked TRL and transformers; then `make test` checks the new set before it is committed.
lock: latest-venv
	$(LATEST)/bin/python -m crystal_grpo.lock write $(LOCK)
	$(LATEST)/bin/python -m crystal_grpo.train.trl_fields

# Not gating: the suite under the newest allowed versions, to see an upstream break before users do.
test-latest: latest-venv
	$(LATEST)/bin/python -m crystal_grpo.lock diff $(LOCK)
	$(LATEST)/bin/python $(PYTEST) $(XDIST)

# Caches only: built models, generated data, downloads, compiled extensions, the scratch venv; all
# rebuilt on demand. The runs' results (runs/, and wandb's offline logs) go only with clean-runs.
clean:
	test ! -d .cache || find .cache -mindepth 1 -maxdepth 1 ! -name wandb -exec rm -rf {} +

# Every run's results: runs/ (checkpoints, logs, sweeps, the demo's) and .cache/wandb.
clean-runs:
	rm -rf runs .cache/wandb
