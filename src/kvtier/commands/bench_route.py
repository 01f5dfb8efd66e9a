"""`kvtier bench route`: one request stream through Ray Serve to two vLLM engines with kvtier,
routed by Ray's default router, by Ray's prefix-aware router and by kvtier's.

Each router gets two fresh replicas (vllm-cpu, Gemma 3 270M by default: five sliding-window groups
of 512 and one full, kvtier's cpu tier, KV events on, an engine cache of a few blocks so a later
request's prefix comes back from kvtier) and the same requests, built once:

  chat  multi-turn conversations, each turn the whole history plus a new message;
  docs  documents longer than the sliding window, each asked several questions (document +
        question); the sliding groups keep only a document's last window, so only the replica
        that stored the document restores it.

Conversations (documents) run side by side, `--concurrency` requests in flight, each one's
requests in order. Per router and workload: tokens reused per request (vLLM's num_cached_tokens:
its own small cache and kvtier's loads), TTFT p50 at the client (`--max-tokens 1`: the request's
latency), and how many requests the router sent by prefix. Ray's prefix-aware router
(`PrefixCacheAffinityRouter`) reads the prompt's text: it gets the token ids as text, a prefix of
one being a prefix of the other; it needs pyarrow (kvtier's `ray` extra) and is left out, said so,
without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

HELP = "Ray Serve over two vLLM engines with kvtier: Ray's routers against kvtier's (reuse, TTFT)"
ROUTERS = {"default": "Ray's default (power of two)",
           "prefix": "Ray's PrefixCacheAffinityRouter",
           "kvtier": "kvtier's KvtierRequestRouter"}
_ROUTER_CLASS = {"prefix": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
                 "kvtier": "kvtier.integrations.ray.KvtierRequestRouter"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gemma3", help="a model directory, or 'gemma3' / 'smollm2'")
    p.add_argument("--routers", default="default,prefix,kvtier", help="of: default, prefix, kvtier")
    p.add_argument("--workloads", default="chat,docs", help="of: chat, docs")
    p.add_argument("--conversations", type=int, default=4, metavar="N")
    p.add_argument("--turns", type=int, default=4, metavar="N")
    p.add_argument("--turn-tokens", type=int, default=200, metavar="N", help="tokens a turn adds")
    p.add_argument("--documents", type=int, default=2, metavar="N")
    p.add_argument("--questions", type=int, default=4, metavar="N", help="questions per document")
    p.add_argument("--document-tokens", type=int, default=1200, metavar="N")
    p.add_argument("--concurrency", type=int, default=2, metavar="N", help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=1, metavar="N")
    p.add_argument("--engine-blocks", type=int, default=0, metavar="N",
                   help="vLLM's own KV cache in blocks of 128 tokens, all groups' (0: one request's worth, "
                        "so reuse across requests comes from kvtier)")
    p.add_argument("--cpu-bytes", default="512MiB", help="kvtier's cpu tier per engine")
    p.add_argument("--queue-cost-tokens", type=float, default=512.0, help="kvtier's router setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class RouteRequest:
    """What a replica is sent: the prompt's token ids, and as text for Ray's prefix router."""
    prompt_token_ids: list[int]
    max_tokens: int
    prompt: str = field(default="")


class RouteEngine:
    """One replica: one vLLM engine with kvtier's cpu tier and KV events on a port of its own."""

    def __init__(self, model: str, kv: dict, engine_blocks: int, max_model_len: int) -> None:
        from vllm import AsyncEngineArgs, AsyncLLMEngine
        from vllm.config import KVEventsConfig, KVTransferConfig

        from kvtier.loadgen.servers import free_port

        self.port = free_port()
        self.engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
            model=model, max_model_len=max_model_len, enforce_eager=True, dtype="float32", seed=0,
            block_size=128, num_gpu_blocks_override=engine_blocks,
            enable_prefix_caching=True, kv_transfer_config=KVTransferConfig(**kv),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint=f"tcp://*:{self.port}")))

    def record_replica_metadata(self) -> dict:
        from kvtier.integrations.ray import replica_metadata

        return replica_metadata(self.port, host="127.0.0.1")

    async def __call__(self, req: RouteRequest) -> dict:
        import uuid

        from ray import serve
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens)
        final = None
        async for out in self.engine.generate({"prompt_token_ids": req.prompt_token_ids}, params, str(uuid.uuid4())):
            final = out
        return {"replica": serve.get_replica_context().replica_id.unique_id,
                "reused": (final.num_cached_tokens or 0) if final is not None else 0}


def workloads(a: argparse.Namespace) -> dict[str, list[list[list[int]]]]:
    """Per workload, its chains (a conversation, a document's questions), each a list of prompts
    sent in order."""
    rng = random.Random(a.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    out: dict[str, list[list[list[int]]]] = {}
    if "chat" in a.workloads:
        chats = []
        for _ in range(a.conversations):
            history, turns = tokens(300), []
            for _ in range(a.turns):
                history = history + tokens(a.turn_tokens)
                turns.append(history)
            chats.append(turns)
        out["chat"] = chats
    if "docs" in a.workloads:
        out["docs"] = [[doc + tokens(40) for _ in range(a.questions)]
                       for doc in (tokens(a.document_tokens) for _ in range(a.documents))]
    return out


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError

    args.routers = [r for r in args.routers.split(",") if r]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if bad := [r for r in args.routers if r not in ROUTERS]:
        raise ConfigError(f"--routers {bad}: choose among {', '.join(ROUTERS)}")
    if bad := [w for w in args.workloads if w not in ("chat", "docs")]:
        raise ConfigError(f"--workloads {bad}: choose among chat, docs")
    for name in ("conversations", "turns", "turn_tokens", "documents", "questions", "document_tokens",
                 "concurrency", "max_tokens"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be > 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine; --engine-blocks of it are used
    from kvtier.commands.bench_serve import auto_bind
    from kvtier.commands.bench_vllm import _model_dir

    model = _model_dir(args.model)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", auto_bind(sorted(os.sched_getaffinity(0))))
    streams = workloads(args)
    longest = max(len(p) for chains in streams.values() for chain in chains for p in chain)
    max_model_len = -(-(longest + args.max_tokens) // 128) * 128
    from kvtier.commands.bench_serve import engine_groups

    need = engine_groups(model) * (max_model_len // 128 + 1)  # one request, every group's blocks
    if 0 < args.engine_blocks < need:
        raise ConfigError(f"--engine-blocks {args.engine_blocks} cannot hold one request of {max_model_len} "
                          f"tokens; use at least {need} (or 0)")
    args.engine_blocks = args.engine_blocks or need
    skipped: dict[str, str] = {}
    if "prefix" in args.routers:
        try:
            import ray.serve.llm.request_router  # noqa: F401
        except ImportError as exc:
            skipped["prefix"] = f"{exc} (it needs pyarrow: pip install 'kvtier[ray]')"
    import ray
    from ray import serve

    results: dict[str, dict] = {}
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    # vLLM's logging setup (dictConfig) closes every handler of the process, Ray Serve's own
    # replica log handler among them, and the replica then fails Serve's health calls
    env["VLLM_CONFIGURE_LOGGING"] = "0"
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    try:
        serve.start(proxy_location="Disabled")
        for router in args.routers:
            if router in skipped:
                continue
            with tempfile.TemporaryDirectory(prefix="kvtier-bench-route-") as directory:
                results[router] = _side(args, router, model, max_model_len, streams, directory)
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {"model": model, "max_model_len": max_model_len, "results": results, "skipped": skipped,
              "settings": {k: getattr(args, k) for k in ("conversations", "turns", "turn_tokens", "documents",
                                                         "questions", "document_tokens", "concurrency",
                                                         "max_tokens", "engine_blocks", "cpu_bytes",
                                                         "queue_cost_tokens", "seed")}}
    if args.json:
        print(json.dumps(report))
    else:
        print(_table(report))
    return 0


def _side(a: argparse.Namespace, router: str, model: str, max_model_len: int,
          streams: dict[str, list[list[list[int]]]], directory: str) -> dict[str, dict]:
    """Two fresh replicas behind `router`, every workload through them in turn."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvtier.integrations.ray import routers

    kv = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
                                        "spec_module_path": "kvtier.integrations.vllm.spec",
                                        "kvtier.tiers": "cpu", "kvtier.cpu_bytes": a.cpu_bytes,
                                        "kvtier.directory": directory}}
    config = RequestRouterConfig() if router == "default" else RequestRouterConfig(
        request_router_class=_ROUTER_CLASS[router],
        request_router_kwargs={"queue_cost_tokens": a.queue_cost_tokens} if router == "kvtier" else {})
    deployment = serve.deployment(RouteEngine, name="engine", num_replicas=2, max_ongoing_requests=8,
                                  ray_actor_options={"num_cpus": 0}, request_router_config=config,
                                  max_constructor_retry_count=1)  # an engine that fails to start fails the bench
    t0 = time.monotonic()
    handle = serve.run(deployment.bind(model, kv, a.engine_blocks, max_model_len), name=f"route-{router}")
    print(f"[bench route] {ROUTERS[router]}: two engines up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    handle.remote(RouteRequest([7] * 16, 1, "7 " * 16)).result(timeout_s=600)  # one-time costs, not measured (text: Ray's prefix router divides by its length)
    mine = [r for r in routers() if r.app_name == f"route-{router}"]
    out = {}
    for name, chains in streams.items():
        before = dict(mine[0].decisions) if mine else None
        rows = asyncio.run(_drive(handle, chains, a))
        out[name] = {"requests": len(rows), "reused_mean": statistics.fmean(r["reused"] for r in rows),
                     "ttft_p50_s": statistics.median(r["latency_s"] for r in rows),
                     "replicas": sorted({r["replica"] for r in rows}), "rows": rows}
        if mine and before is not None:
            out[name]["by_prefix"] = mine[0].decisions["by_prefix"] - before["by_prefix"]
        print(f"[bench route] {router} {name}: {len(rows)} requests, reused {out[name]['reused_mean']:.0f} "
              f"tokens/request, TTFT p50 {out[name]['ttft_p50_s']:.3f} s", file=sys.stderr)
    serve.delete(f"route-{router}")
    return out


async def _drive(handle, chains: list[list[list[int]]], a: argparse.Namespace) -> list[dict]:  # noqa: ANN001
    """Every chain at once, each in order, at most `concurrency` requests in flight."""
    sem = asyncio.Semaphore(a.concurrency)
    rows: list[dict] = []

    async def chain(i: int, prompts: list[list[int]]) -> None:
        for k, p in enumerate(prompts):
            async with sem:
                t0 = time.perf_counter()
                res = await handle.remote(RouteRequest(p, a.max_tokens, " ".join(map(str, p)) + " "))
                rows.append({"chain": i, "turn": k, "prompt_tokens": len(p), "latency_s": time.perf_counter() - t0,
                             **res})

    await asyncio.gather(*(chain(i, c) for i, c in enumerate(chains)))
    return rows


def _table(r: dict) -> str:
    s = r["settings"]
    lines = [f"model {r['model']}; two replicas, kvtier cpu tier {s['cpu_bytes']} each, engine cache "
             f"{s['engine_blocks']} x 128 tokens; {s['concurrency']} requests in flight, max_tokens {s['max_tokens']}",
             f"{'workload':9s} {'router':34s} {'requests':>8s} {'reused tok/req':>15s} {'TTFT p50':>9s} {'by prefix':>9s}"]
    for router, per in r["results"].items():
        for name, x in per.items():
            lines.append(f"{name:9s} {ROUTERS[router]:34s} {x['requests']:8d} {x['reused_mean']:15.0f} "
                         f"{x['ttft_p50_s']:8.3f}s {x.get('by_prefix', '-')!s:>9s}")
    for router, why in r["skipped"].items():
        lines.append(f"{ROUTERS[router]}: not run here: {why}")
    return "\n".join(lines)
