# Two commands: `make test` and `make demo`. Both create .venv on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Everything offline and inside the repo.
export HF_HUB_OFFLINE        := 1
export TRANSFORMERS_OFFLINE  := 1
export HF_HOME               := $(CURDIR)/.cache/hf
export TORCH_EXTENSIONS_DIR  := $(CURDIR)/.cache/torch_extensions
export WANDB_DIR             := $(CURDIR)/.cache/wandb
export WANDB_MODE            ?= offline
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test demo bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# constraints.txt pins torch==2.13.0 so no CUDA wheels are pulled on CPU machines.
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

demo: setup
	$(PY) scripts/demo.py

bench: setup
	$(PY) scripts/bench_scorer.py

clean:
	rm -rf .cache runs
