"""The tier contract run against the redis tier on a real redis-server (and a 3-master cluster),
plus what only a shared, key-addressed tier promises."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tier_contract import NS, TierContract, header, payload

from kvtier.store.tiers.redis import RedisTier

sys.path.insert(0, str(Path(__file__).parents[1]))
from redis_servers import redis_cluster, redis_server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    with redis_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster():
    with redis_cluster() as cl:
        yield cl


class RedisTierExtras:
    """A shared tier: a second process's tier sees what the first wrote, corrupt values are
    dropped for everyone."""

    def test_a_second_tier_on_the_same_server_reads_it(self, make_tier) -> None:
        a, b = make_tier(None), make_tier(None)
        h = header(60, 0)
        data = payload(60, h.payload_bytes)
        assert a.write(0, 0, h, data)
        assert b.exists_many([h, header(61, 0)]) == [True, False]
        out = torch.zeros(h.payload_bytes, dtype=torch.uint8)
        assert b.read(0, 7, h, out) and torch.equal(out, data)  # the slot number is ignored

    def test_free_with_a_header_removes_it_for_everyone(self, make_tier) -> None:
        a, b = make_tier(None), make_tier(None)
        h = header(62, 1)
        assert a.write(1, 0, h, payload(62, h.payload_bytes))
        b.free(1, 0, header=h)
        assert a.exists_many([h]) == [False]

    def test_foreign_payload_under_the_key_is_dropped(self, tier: RedisTier) -> None:
        h = header(63, 0)
        tier.write(0, 0, h, payload(63, h.payload_bytes))
        wrong_span = header(63, 0, nbytes=100)  # same key, another size: never restored
        assert tier.read(0, 0, wrong_span, torch.zeros(100, dtype=torch.uint8)) is False
        assert tier.corrupt_dropped == 1
        assert tier.exists_many([h]) == [False]


class TestRedisTier(TierContract, RedisTierExtras):
    @pytest.fixture
    def make_tier(self, server):
        server.cli("flushall")
        made: list[RedisTier] = []

        def make(layout):
            t = RedisTier.from_url(server.url, namespace_id=NS)
            made.append(t)
            return t

        yield make
        for t in made:
            t.close()


class TestRedisClusterTier(TierContract, RedisTierExtras):
    @pytest.fixture
    def make_tier(self, cluster):
        for port in cluster.ports:
            from redis_servers import cli

            cli(port, "flushall")
        made: list[RedisTier] = []

        def make(layout):
            t = RedisTier.from_url(cluster.url, namespace_id=NS)
            made.append(t)
            return t

        yield make
        for t in made:
            t.close()
