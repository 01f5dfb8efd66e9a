"""Two separate OS processes share one prefix through Redis, via the store facade.

The writer process computes "KV" payloads (seeded random bytes per (group, chunk)) for a prompt
and saves them with `Store.save_tokens`; a second process, with its own store, cpu tier and
Redis connection, looks the same prompt up, finds the hit through the shared tier (one batched
existence check), loads it and must get back exactly the writer's bytes. This file is also the
child program: `python test_redis_shared.py writer|reader URL`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPT_TOKENS = 200
CHUNK_TOKENS = 32
# 200 tokens hold 6 full chunks of 32; a hit is at most prompt - 1 = 199 tokens, rounded down
# to a chunk: 192 = 6 chunks. Every group can restore it when every stored chunk is present.
EXPECTED_HIT = 192


def _setup(url: str):  # noqa: ANN202 - (store, tokens), imported inside the child
    from kvtier.core.geometry import Geometry, Group
    from kvtier.core.keys import Namespace
    from kvtier.core.plan import make_plan
    from kvtier.store.store import Store
    from kvtier.store.tiers.redis import RedisTier

    geometry = Geometry(groups=(
        Group("full", "full", 2, 16, bytes_per_token_per_layer=64),
        Group("swa", "sliding", 2, 16, bytes_per_token_per_layer=32, window=64),
    ), tokens_per_hash=16, name="redis-shared-test")
    plan = make_plan(geometry, chunk_tokens=CHUNK_TOKENS)
    ns = Namespace(model="redis-shared-test", geometry_fingerprint=geometry.fingerprint(),
                   dtype="bfloat16")
    tier = RedisTier.from_url(url, namespace_id=ns.id, socket_timeout_s=2.0)
    store = Store(plan, ns, cpu_bytes=1 << 20, shared=[tier])
    tokens = [(7 * t + 3) % 5000 for t in range(PROMPT_TOKENS)]
    return store, plan, tokens


def _payload(plan, g: int, i: int):  # noqa: ANN001, ANN202
    import torch

    gen = torch.Generator().manual_seed(1000 * g + i)
    return torch.randint(0, 256, (plan.groups[g].chunk_bytes,), dtype=torch.uint8, generator=gen)


def _sha(t) -> str:  # noqa: ANN001
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def child(role: str, url: str) -> dict[str, object]:
    import torch

    store, plan, tokens = _setup(url)
    n = PROMPT_TOKENS // CHUNK_TOKENS
    if role == "writer":
        payloads = {(g, i): _payload(plan, g, i) for g in range(len(plan.groups)) for i in range(n)}
        stored = store.save_tokens(tokens, payloads)
        out = {"stored": stored, "sha": {f"{g},{i}": _sha(t) for (g, i), t in payloads.items()}}
    else:
        hit = store.lookup_tokens(tokens)
        buffers = {(g, i): torch.zeros(plan.groups[g].chunk_bytes, dtype=torch.uint8)
                   for g in range(len(plan.groups)) for i in range(n)}
        restored = store.load(hit, buffers)
        loaded = hit.buffers_needed()
        again = store.lookup_tokens(tokens)  # promoted: now served by this process's cpu tier
        out = {
            "hit_tokens": hit.tokens, "restored": restored,
            "sha": {f"{g},{i}": _sha(buffers[(g, i)]) for g, i in loaded},
            "again_tiers": sorted({ld.tier for loads in again.chunks for ld in loads}),
        }
    store.close()
    return out


def _run_child(role: str, url: str) -> dict[str, object]:
    seed = {"writer": "1", "reader": "2"}[role]  # two hash salts: nothing may depend on them
    env = dict(os.environ, PYTHONHASHSEED=seed)
    proc = subprocess.run([sys.executable, __file__, role, url], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_restores_the_first_ones_prefix_bit_exact() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from redis_servers import redis_server

    with redis_server() as srv:
        w = _run_child("writer", srv.url)
        assert w["stored"] > 0
        # every chunk of both groups is some hit's (window 64 > chunk 32): 2 groups x 6 chunks
        assert int(srv.cli("dbsize")) == 2 * 6
        r = _run_child("reader", srv.url)
    assert r["hit_tokens"] == EXPECTED_HIT and r["restored"] == EXPECTED_HIT
    assert r["sha"], "the reader loaded nothing"
    for key, digest in r["sha"].items():  # every loaded chunk: the writer's exact bytes
        assert digest == w["sha"][key], key
    assert r["again_tiers"] == ["cpu"]


def test_the_store_goes_on_when_redis_is_down() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    import torch
    from redis_servers import free_port

    store, plan, tokens = _setup(f"redis://127.0.0.1:{free_port()}/0")
    n = PROMPT_TOKENS // CHUNK_TOKENS
    payloads = {(g, i): _payload(plan, g, i) for g in range(len(plan.groups)) for i in range(n)}
    assert store.save_tokens(tokens, payloads) > 0  # the cpu tier still takes them
    hit = store.lookup_tokens(tokens)
    assert hit.tokens == EXPECTED_HIT  # served locally; the dead shared tier is a miss
    buffers = {k: torch.zeros_like(v) for k, v in payloads.items()}
    assert store.load(hit, buffers) == EXPECTED_HIT
    assert all(torch.equal(buffers[k], payloads[k]) for k in hit.buffers_needed())
    tier = store.shared[0]
    assert tier.metrics()["up"] is False and tier.failed_writes > 0  # type: ignore[attr-defined]
    store.close()


def test_a_chunk_evicted_between_lookup_and_load_shrinks_the_hit() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    import torch
    from redis_servers import redis_server

    from kvtier.store.store import Store

    with redis_server() as srv:
        writer, plan, tokens = _setup(srv.url)
        n = PROMPT_TOKENS // CHUNK_TOKENS
        payloads = {(g, i): _payload(plan, g, i) for g in range(len(plan.groups)) for i in range(n)}
        writer.save_tokens(tokens, payloads)
        tier = writer.shared[0]
        reader = Store(plan, writer.namespace, shared=[tier])  # nothing local: all from Redis
        hit = reader.lookup_tokens(tokens)
        assert hit.tokens == EXPECTED_HIT
        # Redis evicts chunk 3 of the full-attention group after the lookup
        gone = tier.key(reader.header(hit.chunk_hashes[3], 0, 3))  # type: ignore[attr-defined]
        srv.cli("del", gone)
        buffers = {k: torch.zeros_like(v) for k, v in payloads.items()}
        # the full group now restores chunks 0-2 only: T = 96; the sliding group (W = 64)
        # needs tokens [33, 96) = its chunks 1 and 2, which are there
        assert reader.load(hit, buffers) == 96
        for g, i in ((0, 0), (0, 1), (0, 2), (1, 1), (1, 2)):
            assert torch.equal(buffers[(g, i)], payloads[(g, i)])
        assert tier.metrics()["vanished"] == 1  # type: ignore[attr-defined]
        reader.close()
        writer.close()


def test_a_prefix_from_redis_is_read_in_one_batched_call() -> None:
    """A whole prefix's chunks come back in one `read_many` (one round trip per node), never one
    `read` per chunk: over a network each call is a round trip."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    import torch
    from redis_servers import redis_server

    from kvtier.store.store import Store
    from kvtier.store.tiers.redis import RedisTier

    class CountingRedisTier(RedisTier):  # the real tier; it only counts the calls it gets
        calls: dict[str, int]

        def read(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
            self.calls["read"] += 1
            return super().read(*a, **k)

        def read_many(self, items):  # noqa: ANN001, ANN201
            self.calls["read_many"] += 1
            return super().read_many(items)

    with redis_server() as srv:
        writer, plan, tokens = _setup(srv.url)
        n = PROMPT_TOKENS // CHUNK_TOKENS
        payloads = {(g, i): _payload(plan, g, i) for g in range(len(plan.groups)) for i in range(n)}
        writer.save_tokens(tokens, payloads)
        tier = CountingRedisTier.from_url(srv.url, namespace_id=writer.namespace.id)
        tier.calls = {"read": 0, "read_many": 0}
        reader = Store(plan, writer.namespace, cpu_bytes=1 << 20, shared=[tier])
        hit = reader.lookup_tokens(tokens)
        buffers = {k: torch.zeros_like(v) for k, v in payloads.items()}
        assert reader.load(hit, buffers) == EXPECTED_HIT
        assert all(torch.equal(buffers[k], payloads[k]) for k in hit.buffers_needed())
        # full group: 6 chunks; sliding (W = 64) at T = 192: tokens [129, 192) = chunks 4, 5
        assert len(hit.buffers_needed()) == 6 + 2
        assert tier.calls == {"read": 0, "read_many": 1}
        reader.close()
        writer.close()



def test_a_save_larger_than_the_cpu_tier_still_reaches_redis_whole() -> None:
    """Write-through: every chunk new to this store goes to the shared tier, also those the cpu
    tier took and then evicted within the same save (one chunk row of room for six)."""
    import torch

    from kvtier.store.store import Store
    from kvtier.store.tiers.redis import RedisTier
    from redis_servers import redis_server

    with redis_server() as srv:
        probe, plan, tokens = _setup(srv.url)
        probe.close()
        row = sum(gp.chunk_bytes for gp in plan.cacheable_groups)
        tier = RedisTier.from_url(srv.url, namespace_id=probe.namespace.id, socket_timeout_s=2.0)
        writer = Store(plan, probe.namespace, cpu_bytes=row, shared=[tier], placement="every")
        n = PROMPT_TOKENS // CHUNK_TOKENS
        payloads = {(g, i): _payload(plan, g, i) for g in range(len(plan.groups)) for i in range(n)}
        writer.save_tokens(tokens, payloads)
        reader_tier = RedisTier.from_url(srv.url, namespace_id=probe.namespace.id, socket_timeout_s=2.0)
        reader = Store(plan, probe.namespace, shared=[reader_tier])  # nothing local: all from Redis
        hit = reader.lookup_tokens(tokens)
        buffers = {k: torch.zeros_like(v) for k, v in payloads.items()}
        assert reader.load(hit, buffers) == EXPECTED_HIT
        assert all(torch.equal(buffers[k], payloads[k]) for k in hit.buffers_needed())
        reader.close()
        writer.close()

if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
