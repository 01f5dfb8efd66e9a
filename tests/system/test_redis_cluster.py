"""The redis tier on a real 3-master Redis Cluster: keys spread over every node, the groups of
one chunk share a node (hash tag), a prefix loads bit-exact in one batched call, and a master
killed mid-run is a counted miss until it is back."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier.store.payload import ChunkHeader, make_header
from kvtier.store.tiers.redis import RedisOptions, RedisTier

sys.path.insert(0, str(Path(__file__).parents[1]))
from redis_servers import RedisClusterServers, cli, redis_cluster  # noqa: E402

NS = "c1c1c1c1c1c1c1c1"
GROUP_BYTES = (3000, 1100)  # a two-group hybrid geometry, unequal chunk sizes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hdr(i: int, g: int) -> ChunkHeader:
    return make_header(NS, (1000 + i).to_bytes(4, "little") * 8, g, 128 * i, 128 * (i + 1),
                       GROUP_BYTES[g])


def data(i: int, g: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * i + g)
    return torch.randint(0, 256, (GROUP_BYTES[g],), dtype=torch.uint8, generator=gen)


@pytest.fixture(scope="module")
def cluster():
    with redis_cluster() as cl:
        yield cl


@pytest.fixture
def tier(cluster: RedisClusterServers):
    for p in cluster.ports:
        cli(p, "flushall")
    clock = Clock()
    t = RedisTier(RedisOptions(url=cluster.url, socket_timeout_s=0.5, connect_timeout_s=0.5,
                               backoff_initial_s=1.0), namespace_id=NS, clock=clock)
    t.test_clock = clock  # type: ignore[attr-defined]
    yield t
    t.close()


def items(n: int) -> list[tuple[int, int, ChunkHeader, torch.Tensor]]:
    return [(g, 0, hdr(i, g), data(i, g)) for i in range(n) for g in (0, 1)]


def test_a_prefix_spreads_over_every_node_and_loads_bit_exact(
        tier: RedisTier, cluster: RedisClusterServers) -> None:
    n = 24
    assert tier.write_many(items(n)) == [True] * (2 * n)
    per_node = [int(cli(p, "dbsize")) for p in cluster.ports]
    assert sum(per_node) == 2 * n and all(c > 0 for c in per_node), per_node
    # one chunk's groups sit on one node (the hash tag is the chunk hash)
    for i in range(n):
        slots = {int(cli(cluster.ports[0], "cluster", "keyslot", tier.key(hdr(i, g))))
                 for g in (0, 1)}
        assert len(slots) == 1
    assert tier.exists_many([hdr(i, g) for i in range(n + 2) for g in (0, 1)]) == \
        [True] * (2 * n) + [False] * 4
    outs = [torch.zeros(GROUP_BYTES[g], dtype=torch.uint8) for i in range(n) for g in (0, 1)]
    ok = tier.read_many([(g, 0, h, o) for (g, _, h, _), o in zip(items(n), outs)])
    assert ok == [True] * (2 * n)
    assert all(torch.equal(o, d) for o, (_, _, _, d) in zip(outs, items(n)))
    assert {h.key for _, _, h in tier.list()} == {hdr(i, g).key for i in range(n) for g in (0, 1)}


def test_a_master_killed_mid_run_is_a_miss_then_recovers(
        tier: RedisTier, cluster: RedisClusterServers) -> None:
    n = 12
    assert all(tier.write_many(items(n)))
    victim = cluster.nodes[1]
    victim.kill()
    try:
        outs = [torch.zeros(GROUP_BYTES[g], dtype=torch.uint8) for i in range(n) for g in (0, 1)]
        t0 = time.monotonic()
        ok = tier.read_many([(g, 0, h, o) for (g, _, h, _), o in zip(items(n), outs)])
        assert time.monotonic() - t0 < 3.0
        assert not any(ok) and tier.metrics()["up"] is False  # the breaker is open
        assert tier.write_many(items(1)) == [False, False]
    finally:
        victim.start()  # same dir: nodes.conf brings it back with its slots, but empty
    deadline = time.monotonic() + 20
    while not all("cluster_state:ok" in cli(p, "cluster", "info") for p in cluster.ports):
        assert time.monotonic() < deadline, "cluster did not recover"
        time.sleep(0.05)
    tier.test_clock.now += 60  # type: ignore[attr-defined]  # past any backoff
    outs = [torch.zeros(GROUP_BYTES[g], dtype=torch.uint8) for i in range(n) for g in (0, 1)]
    ok = tier.read_many([(g, 0, h, o) for (g, _, h, _), o in zip(items(n), outs)])
    assert tier.up
    on_victim = {tier.key(hdr(i, g)) for i in range(n) for g in (0, 1)
                 if _owner(cluster, tier.key(hdr(i, g))) == victim.port}
    for (_, _, h, d), o, good in zip(items(n), outs, ok):
        if good:
            assert torch.equal(o, d)
        else:
            assert tier.key(h) in on_victim  # only what died with the node is lost
    assert sum(ok) == 2 * n - len(on_victim) and on_victim


def _owner(cluster: RedisClusterServers, key: str) -> int:
    slot = int(cli(cluster.ports[0], "cluster", "keyslot", key))
    for line in cli(cluster.ports[0], "cluster", "nodes").splitlines():
        parts = line.split()
        port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
        for rng in parts[8:]:
            lo, _, hi = rng.partition("-")
            if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                return port
    raise AssertionError(f"no owner for slot {slot}")
