#!/bin/bash
# The GPU device check (made by scripts/gpu-device/make-kit.sh, run from .devstub/): vLLM 0.33's
# Python code + a stand-in for its compiled copy op, kvtier from a snapshot of HEAD, the wheels
# the device image lacks. It prints scripts/gpu-check.py's JSON (both sides copy through the
# stand-in op: its GB/s are the stand-in's, not vLLM's kernel's; the round trips are real) and
# each engineless GPU scenario run with real CUDA tensors (checked, mismatches).
# Where it stopped on 2026-12-04 (three runs): vLLM's model inspection imports modules that call
# compiled ops at import time (vllm_flash_attn's FA2/FA3 check, patched below; then
# torch.ops._C.cutlass_scaled_mm_supports_block_fp8): each needs a stand-in before any scenario
# builds its engine config. Add them to _C_stable_libtorch.py one by one, or skip the inspection.
# What goes first on PYTHONPATH lives in a private directory of its own (mktemp -d, 0700): a
# fixed path under /tmp could be made first by another local user, whose code would be imported.
set -x
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl 2>&1 | tail -2
mkdir -p "$WORK/site/vllm-0.33.0.dist-info" && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n' > "$WORK/site/vllm-0.33.0.dist-info/METADATA"
mkdir -p "$WORK/v" && tar xJf .devstub/vllm033.tar.xz -C "$WORK/v" && cp .devstub/_C_stable_libtorch.py "$WORK/v/.vllm033/vllm/"
sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:  # device check: no attention runs/' "$WORK/v/.vllm033/vllm/vllm_flash_attn/__init__.py"
cd .devstub/snap
export PYTHONPATH="$WORK/v/.vllm033:$WORK/site:$PWD/src:$PWD/tests/integrations/vllm_engineless" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cuda
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, vllm; from vllm.platforms import current_platform; print('torch', torch.__version__, 'vllm', vllm.__version__, current_platform.device_name, torch.cuda.is_available())" 2>&1 | tail -3
timeout 150 python3 scripts/gpu-check.py --chunks 64 --layers 8 --reps 3 --json 2>&1 | tee $OUT/gpu-check.log | grep -v WARNING | tail -15
cd tests/integrations && timeout 200 python3 vllm_engineless/harness.py "$(cat $ROOT/.devstub/scen.json)" > $OUT/harness.out 2> $OUT/harness.err
python3 - <<'PY'
import json, os
out = open(os.environ["OUT"] + "/harness.out").read()
line = [l for l in out.splitlines() if l.startswith("RESULT ")]
if not line:
    print("NO RESULT"); print(open(os.environ["OUT"] + "/harness.err").read()[-3000:])
else:
    r = json.loads(line[0][7:])
    for k, v in r.items():
        if not isinstance(v, dict):
            continue
        c = v.get("c", v)
        print(k, "ERROR " + v["error"][:300] if "error" in v else "", "ext", c.get("external_tokens"), "checked", c.get("checked"), "mismatches", c.get("mismatches"))
PY
