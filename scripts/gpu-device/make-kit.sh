#!/usr/bin/env bash
# Build the carry for a GPU device check (the `device` tool of this workplace: an H200 with
# PyTorch 2.11/cu130, Python 3.12 and no network, no vLLM). Writes, in the repository root:
#   .whl/      Python 3.12 wheels vLLM 0.33's Python code imports that the device image lacks
#   .devstub/  vLLM 0.33's Python code (xz, 7 MB), a stand-in for its compiled copy op, the
#              engineless scenarios to run with real CUDA tensors, and run.sh
# Both are ignored by git (.git/info/exclude); carry them: run(command="bash .devstub/run.sh",
# carry=[".whl", ".devstub"]). Needs .vllm033 (scripts/setup-vllm033.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .git/info .whl .devstub
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.devstub/' .git/info/exclude 2>/dev/null || echo '/.devstub/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  cbor2==6.3.0 pyzmq==27.3.0 openai-harmony==0.0.8 openai==3.60.0 jiter==0.19.0 distro sniffio==1.3.1 \
  pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
  fastapi==0.136.3 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1 httpx2==2.16.2 \
  httpcore2==2.16.2 truststore
tar cJf .devstub/vllm033.tar.xz .vllm033
cp scripts/gpu-device/_C_stable_libtorch.py scripts/gpu-device/run.sh .devstub/
rm -rf .devstub/snap && mkdir -p .devstub/snap && git archive HEAD src tests scripts | tar x -C .devstub/snap
.venv/bin/python - <<'PY'
import importlib.util, json, sys
sys.path.insert(0, "tests/integrations")  # its sibling vllm_versions
spec = importlib.util.spec_from_file_location("t", "tests/integrations/test_vllm_engineless.py")
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
want = set(m.GPU_COPIES) - {"slow_disk"}
json.dump([dict(sc, name=sc["name"] + "_cuda", device="cuda") for sc in m.SCENARIOS if sc["name"] in want],
          open(".devstub/scen.json", "w"))
PY
du -sh .whl .devstub
