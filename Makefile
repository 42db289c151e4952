# Two commands: `make test` and `make demo`. Both create .venv on first use, with exactly the
# versions in requirements.lock (the set the suite last passed with; `make lock` renews it).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock
# A scratch venv with the newest versions pyproject.toml allows (make lock, make test-latest).
LATEST := .cache/latest-venv
# The vLLM set (docs/training.md, "Generation in vLLM"): its lock, resolved as a GPU machine sees
# the index; the venv make setup-vllm installs it into (GPU machines); a CPU venv of its versions
# without vLLM (make test-vllm-set); the Python that makes the venvs (the lock's, see `fits`).
VLLM_LOCK := requirements-vllm.lock
VLLM_REQS := -e '.[dev,vllm]' pip setuptools
VLLM_VENV := .venv-vllm
VLLM_SET  := .cache/vllm-set-venv
PYTHON    ?= python3

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

.PHONY: setup setup-browser setup-vllm check-vllm-set lint test test-all test-fast test-latest test-vllm-set lock \
	latest-venv demo demo-smollm2 bench clean clean-runs

# The lock constrains every distribution, pip and the build backend included (PIP_CONSTRAINT
# reaches pip's isolated build environment too). torch is pinned by version only, so a CPU
# machine takes the CPU wheel and a GPU machine the CUDA build of the same release.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	PIP_CONSTRAINT=$(CURDIR)/$(LOCK) $(PY) -m pip install -q --upgrade pip setuptools
	PIP_CONSTRAINT=$(CURDIR)/$(LOCK) $(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Debian's chromium, for the alignment viewer's headless-browser test (tests/test_alignment_view.py,
# which skips without it). Needs root and apt; .ci/run calls it.
setup-browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  { echo "make setup-browser: could not install Debian's chromium (needs root and apt)"; exit 2; }

# vLLM and TRL's vLLM mode on a CUDA GPU machine, in their own venv: requirements-vllm.lock, the
# newest versions TRL's vllm range allows (vLLM pins transformers below requirements.lock's).
setup-vllm:
	@command -v nvidia-smi >/dev/null || { echo "make setup-vllm: no NVIDIA GPU here; vLLM needs CUDA and this set" \
	  "holds several GB of CUDA wheels (make test-vllm-set tests its versions on CPU, without vLLM)"; exit 2; }
	$(PYTHON) -m crystal_grpo.lock fits $(VLLM_LOCK)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	PIP_CONSTRAINT=$(CURDIR)/$(VLLM_LOCK) $(VLLM_VENV)/bin/python -m pip install -q --upgrade pip setuptools
	PIP_CONSTRAINT=$(CURDIR)/$(VLLM_LOCK) $(VLLM_VENV)/bin/python -m pip install -q $(VLLM_REQS)

# Gating (.ci/run): the vLLM set still resolves, by pip's resolver in dry-run as a GPU machine sees
# the index, reading wheels' metadata by range requests instead of downloading them. The lock tool
# exits 75 when the index did not answer: nothing was judged, so that warns instead of failing.
check-vllm-set: setup
	@$(PY) -m crystal_grpo.lock check $(VLLM_LOCK) $(VLLM_REQS) || { rc=$$?; [ $$rc -eq 75 ] || exit $$rc; \
	  echo "WARNING: make check-vllm-set: the vLLM set was not checked (package index unreachable)"; }

test test-all test-fast test-latest test-vllm-set: export OMP_NUM_THREADS ?= 1

# ruff's lint and format check ([tool.ruff] in pyproject.toml; `ruff format .` fixes the format).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The gating suite (CI): every test but the longest, which test-all adds (tests/conftest.py EXTENDED).
test: setup lint
	$(PY) $(PYTEST) $(XDIST) -m "not extended"

# Everything, about twice test's time: before merging a change to the trainer, the run folder or the sweep.
test-all: setup lint
	$(PY) $(PYTEST) $(XDIST)

# The inner loop: everything that builds no model and launches no run (tests marked slow, see
# tests/conftest.py), in under a minute.
test-fast: setup lint
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

# Renew the locks from the newest allowed versions (the vLLM set's: within TRL's vllm range), and
# TRL's field table for each (train/config/trl_fields_table.py, train/config/trl_fields_table_vllm.py:
# transformers differs); then `make test` and `make test-vllm-set` check the new sets before they are committed.
lock: latest-venv
	$(LATEST)/bin/python -m crystal_grpo.lock write $(LOCK)
	$(LATEST)/bin/python -m crystal_grpo.lock resolve $(VLLM_LOCK) $(VLLM_REQS)
	$(LATEST)/bin/python -m crystal_grpo.train.config.training_section trl_fields_table
	$(MAKE) $(VLLM_SET)/.installed
	$(VLLM_SET)/bin/python -m crystal_grpo.train.config.training_section trl_fields_table_vllm

# Not gating: the suite under the newest allowed versions, to see an upstream break before users do.
test-latest: latest-venv
	$(LATEST)/bin/python -m crystal_grpo.lock diff $(LOCK)
	$(LATEST)/bin/python $(PYTEST) $(XDIST)

# Not gating: the suite under the vLLM set's versions (transformers, numpy, ...) on CPU, vLLM
# itself left out, torch the CPU wheel of the locked release.
$(VLLM_SET)/.installed: pyproject.toml $(VLLM_LOCK)
	test -x $(VLLM_SET)/bin/python || $(PYTHON) -m venv $(VLLM_SET)
	PIP_CONSTRAINT=$(CURDIR)/$(VLLM_LOCK) $(VLLM_SET)/bin/python -m pip install -q --upgrade pip setuptools
	PIP_CONSTRAINT=$(CURDIR)/$(VLLM_LOCK) $(VLLM_SET)/bin/python -m pip install -q -e '.[dev]'
	touch $@

test-vllm-set: $(VLLM_SET)/.installed
	$(VLLM_SET)/bin/python -m crystal_grpo.lock diff $(VLLM_LOCK)
	$(VLLM_SET)/bin/python $(PYTEST) $(XDIST)

# Caches only: built models, generated data, downloads, compiled extensions, the scratch venv; all
# rebuilt on demand. The runs' results (runs/, and wandb's offline logs) go only with clean-runs.
clean:
	test ! -d .cache || find .cache -mindepth 1 -maxdepth 1 ! -name wandb -exec rm -rf {} +

# Every run's results: runs/ (checkpoints, logs, sweeps, the demo's) and .cache/wandb.
clean-runs:
	rm -rf runs .cache/wandb
