"""GPU check: host<->device bandwidth through kvtier's worker against vLLM's native CPU offloading
on the same blocks, and a byte-exact round trip for each. Ready to run on a CUDA machine with vLLM
installed; on this CPU-only project machine it runs kvtier's half on CPU tensors (the plumbing
check) and reports vLLM's native half as refused, with vLLM's own message.

    .venv/bin/python scripts/gpu-check.py [--chunks 64] [--layers 8] [--reps 3] [--json]

Both connectors are built by vLLM's own factory and driven through their OffloadingWorker
(`submit_store` / `submit_load` / `get_finished`), with one full-attention group of `--layers`
layers (8 KV heads x 128 head dim, float16 on GPU / float32 on CPU, 16 tokens per block, 16 blocks
per chunk), the same device blocks, in one process. Each rep stores `--chunks` chunks from random
device blocks into host slots and loads them back into other blocks; a rep's time is wall clock
from the first submit to the last job seen finished (polling get_finished, as vLLM's step loop
does). GB/s = bytes moved / that time; the report is the median of the reps per direction and
kvtier's ratio to native (issue 15's target: at least 0.9 on a GPU). The round trip is checked
with torch.equal on the device, every layer, every block.

Uses the engine-less harness (tests/integrations/vllm_engineless/harness.py): vLLM's real
scheduler, both connector halves and their specs, no model weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations" / "vllm_engineless"))


def _scenario(kind: str, device: str, layers: int, host_bytes: int, kv_bytes: int) -> dict:
    full = {"kind": "full", "heads": 8, "head_size": 128}
    sc = {"name": f"gpu_check_{kind}", "layers": [full] * layers, "block_size": 16, "device": device,
          "max_model_len": 256,
          "kv_bytes": kv_bytes, "extra": {"blocks_per_chunk": 16, "kvtier.cpu_bytes": str(host_bytes)}}
    if kind == "native":
        sc["ktc"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec",
                                                   "cpu_bytes_to_use": host_bytes, "blocks_per_chunk": 16}}
    return sc


def _run(h, kind: str, chunks: int, reps: int) -> dict:
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    worker = h.wconn.connector_worker.worker
    bpc = int(h.wconn.connector_worker.spec.blocks_per_chunk)
    kv = list(h.kv.values())
    num_blocks = kv[0].shape[0]
    if 2 * chunks * bpc + 1 > num_blocks:
        raise SystemExit(f"--chunks {chunks} needs {2 * chunks * bpc + 1} device blocks, the cache has "
                         f"{num_blocks}: give fewer chunks or more kv bytes")
    page = sum(t[0].numel() * t.element_size() for t in kv)  # one block, every layer
    if kind == "native":
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        def host(j: int, item_end: int):
            return CPULoadStoreSpec([j])
    else:
        from kvtier.integrations.vllm.common import ChunkItem, KvtierLoadStoreSpec

        def host(j: int, item_end: int):
            return KvtierLoadStoreSpec([ChunkItem(0, j.to_bytes(4, "big") * 4, 0, item_end, (("cpu", j),))])

    def wait(ids: set[int]) -> bool:
        ok = True
        while ids:
            for r in worker.get_finished():
                if r.job_id in ids:
                    ids.discard(r.job_id)
                    ok &= bool(r.success)
        return ok

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    gen = torch.Generator().manual_seed(0)
    store_gbps, load_gbps, exact = [], [], True
    job = 0
    for _ in range(reps):
        perm = torch.randperm(num_blocks - 1, generator=gen)[: 2 * chunks * bpc] + 1
        src, dst = perm[: chunks * bpc].tolist(), perm[chunks * bpc:].tolist()
        for t in kv:
            t[src] = torch.randint(-100, 100, t[src].shape, generator=gen).to(t.dtype).to(t.device)
        sync()
        t0, ids = time.perf_counter(), set()
        for j in range(chunks):
            job += 1
            ids.add(job)
            worker.submit_store(job, GPULoadStoreSpec(src[j * bpc:(j + 1) * bpc], [bpc], [0]), host(j, bpc * h.bs))
        exact &= wait(ids)
        sync()
        store_gbps.append(chunks * bpc * page / (time.perf_counter() - t0) / 1e9)
        t0, ids = time.perf_counter(), set()
        for j in range(chunks):
            job += 1
            ids.add(job)
            worker.submit_load(job, host(j, bpc * h.bs), GPULoadStoreSpec(dst[j * bpc:(j + 1) * bpc], [bpc], [0]))
        exact &= wait(ids)
        sync()
        load_gbps.append(chunks * bpc * page / (time.perf_counter() - t0) / 1e9)
        exact &= all(bool(torch.equal(t[src], t[dst])) for t in kv)
    out = {"store_gbps": statistics.median(store_gbps), "load_gbps": statistics.median(load_gbps),
           "round_trip_exact": bool(exact), "bytes_per_rep": chunks * bpc * page}
    if kind != "native":  # on a GPU kvtier's worker must copy through vLLM's own handler (copies.py)
        out["copy_path"] = "vLLM handler" if worker.copies.copier is not None else "index_copy"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--emulate-gpu", action="store_true",
                   help="CPU only: kvtier's half takes its GPU path (vLLM's copy handler computing every "
                        "pointer) with the copy emulated (tests/integrations/vllm_engineless/fake_cuda.py); "
                        "a plumbing check, its GB/s mean nothing")
    args = p.parse_args()
    for name in ("chunks", "layers", "reps"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name} {getattr(args, name)} must be > 0")
    import torch
    import vllm
    from harness import Harness

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # one chunk = 16 blocks x 16 tokens x layers x 2 (K, V) x 8 heads x 128 x 4 bytes (fp32 harness)
    chunk_bytes = 16 * 16 * args.layers * 2 * 8 * 128 * 4
    host_bytes = (args.chunks + 4) * chunk_bytes
    kv_bytes = (2 * args.chunks + 4) * chunk_bytes
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "vllm": vllm.__version__, "chunks": args.chunks, "layers": args.layers, "reps": args.reps}
    import contextlib

    for kind in ("kvtier", "native"):
        emulate = contextlib.nullcontext()
        if args.emulate_gpu and kind == "kvtier" and device == "cpu":
            import fake_cuda

            emulate = fake_cuda.installed()
        try:
            with emulate:
                h = Harness(_scenario(kind, device, args.layers, host_bytes, kv_bytes))
                out[kind] = _run(h, kind, args.chunks, args.reps)
        except Exception as exc:  # noqa: BLE001 - reported, e.g. native offloading refusing a CPU platform
            out[kind] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    k, n = out["kvtier"], out["native"]
    if "error" not in k and "error" not in n:
        out["store_ratio"] = k["store_gbps"] / n["store_gbps"]
        out["load_ratio"] = k["load_gbps"] / n["load_gbps"]
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 0 if all(out[x].get("round_trip_exact", True) for x in ("kvtier", "native")) else 1


if __name__ == "__main__":
    sys.exit(main())
