"""The two forms docs/vllm.md documents, run exactly as written (placeholders substituted):
`vllm serve ... --kv-transfer-config '{...}'` with one completion request, and the Python
`LLM(...)` snippet (generate, reset vLLM's prefix cache, generate: same tokens, loaded from kvtier).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from vllm_e2e import ENGINE_TIMEOUT_S, tiny_llama_dir  # noqa: E402

from kvtier.integrations.vllm.counters import read_metrics  # noqa: E402
from kvtier.loadgen.servers import free_port  # noqa: E402

pytestmark = pytest.mark.slow
DOC = Path(__file__).parents[2] / "docs" / "vllm.md"


def _block(lang: str, starts: str) -> str:
    for m in re.finditer(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S):
        if m.group(1).lstrip().startswith(starts):
            return m.group(1)
    raise AssertionError(f"docs/vllm.md has no ```{lang} block starting with {starts!r}")


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                TOKENIZERS_PARALLELISM="false")


def test_documented_vllm_serve_line(tmp_path: Path) -> None:
    model = tiny_llama_dir()
    port = free_port()
    line = _block("bash", "vllm serve").strip()
    line = line.replace("MODEL_DIR", str(model)).replace("KVTIER_DIR", str(tmp_path))
    line = line.replace("--port 8000", f"--port {port} --host 127.0.0.1")
    argv = shlex.split(line)
    assert argv[:2] == ["vllm", "serve"]
    # the documented arguments, run by vLLM's CLI; on vllm-cpu through the launcher that
    # fixes the `vllm` script's version lookup (docs/vllm.md says why)
    argv[:1] = [sys.executable, "-m", "kvtier.integrations.vllm.launch"]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(argv, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(2)
        prompt = " ".join(f"word{i}" for i in range(300))  # > 128 tokens: a chunk to store
        body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 4,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert reply["choices"][0]["text"] is not None
        assert reply["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 30  # disk writes land on the worker's I/O thread, and the
        while not 1 <= (m := read_metrics(tmp_path)).get("stored_chunks_disk", 0) == m.get(
                "stored_chunks_cpu"):  # counter files are rewritten at most once a second
            assert time.monotonic() < deadline, m
            time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def python_form(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The Python snippet, started when the module starts, so its engine comes up while the
    `vllm serve` test runs (two engine processes at once: about a minute less than in turn)."""
    tmp = tmp_path_factory.mktemp("python_form")
    code = _block("python", "from vllm import").replace("MODEL_DIR", str(tiny_llama_dir()))
    code = code.replace("KVTIER_DIR", str(tmp))
    script = tmp / "doc_snippet.py"
    script.write_text('if __name__ == "__main__":\n' + textwrap.indent(code, "    ")
                      + '    print("SNIPPET-OK")\n')
    out, err = open(tmp / "stdout", "w+"), open(tmp / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, str(script)], env=_env(), stdout=out, stderr=err, text=True)
    try:
        yield tmp, proc, out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()


@pytest.fixture(scope="module", autouse=True)
def _start_python_form_first(python_form) -> None:  # noqa: ANN001
    """Every test of this module starts the snippet's engine, whichever runs first."""


def test_documented_python_form(python_form) -> None:  # noqa: ANN001
    tmp, proc, out, err = python_form
    try:
        proc.wait(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out.seek(0)
    err.seek(0)
    assert "SNIPPET-OK" in out.read(), err.read()[-3000:]
    m = read_metrics(tmp)
    assert m["loaded_blocks"] == 4  # 600 prompt tokens: 4 chunks of 128, all loaded
    assert m["loaded_chunks_cpu"] == 4
