"""The redis tier behind Sentinel: it finds the master through the sentinels, and when the
master is killed it misses (counted) until Sentinel promotes the replica, then reads the
replicated payloads bit-exact from the new master by itself."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.store.payload import ChunkHeader, make_header
from kvtier.store.tiers.redis import RedisOptions, RedisTier
from kvtier.store.tiers.redis_conn import sentinel_parts

sys.path.insert(0, str(Path(__file__).parents[1]))
from redis_servers import redis_sentinel  # noqa: E402

NS = "5e5e5e5e5e5e5e5e"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hdr(i: int) -> ChunkHeader:
    return make_header(NS, bytes([i + 1]) * 32, 0, 16 * i, 16 * (i + 1), 5000)


def data(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (5000,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(i))


def test_sentinel_url_forms() -> None:
    assert sentinel_parts("redis+sentinel://a:1,b:2/svc") == ([("a", 1), ("b", 2)], "svc", 0)
    assert sentinel_parts("rediss+sentinel://u:p@a:1/svc/3") == ([("a", 1)], "svc", 3)
    for bad in ("redis+sentinel://a:1", "redis+sentinel://a/svc", "redis+sentinel://a:1/svc/x"):
        with pytest.raises(ConfigError, match="SERVICE"):
            RedisOptions(url=bad)


def test_failover_to_the_replica() -> None:
    with redis_sentinel() as st:
        clock = Clock()
        tier = RedisTier(RedisOptions(url=st.url, socket_timeout_s=0.5, connect_timeout_s=0.5,
                                      backoff_initial_s=0.5), namespace_id=NS, clock=clock)
        assert tier.write_many([(0, 0, hdr(i), data(i)) for i in range(4)]) == [True] * 4
        assert st.master.cli("wait", "1", "2000").strip() == "1"  # replicated before the kill
        old_master = st.master.port
        st.master.kill()
        outs = [torch.zeros(5000, dtype=torch.uint8) for _ in range(4)]
        assert tier.read_many([(0, 0, hdr(i), o) for i, o in enumerate(outs)]) == [False] * 4
        assert tier.metrics()["up"] is False
        deadline = time.monotonic() + 30
        while st.master_port() == old_master:  # Sentinel promotes the replica
            assert time.monotonic() < deadline, "no failover"
            time.sleep(0.1)
        assert st.master_port() == st.replica.port
        clock.now += 60  # past the backoff: the next call asks the sentinels again
        deadline = time.monotonic() + 30  # Sentinel ends the failover once the replica says
        # role:master; until then the tier is told "no master" (a counted miss) and retries
        while not tier.read_many([(0, 0, hdr(i), o) for i, o in enumerate(outs)]) == [True] * 4:
            assert time.monotonic() < deadline, (
                tier.last_error, tier.metrics(), st.replica.cli("role").split()[:1],
                st.replica.cli("dbsize").strip(), st.sentinel_masters())
            clock.now += 60
            time.sleep(0.1)
        assert all(torch.equal(o, data(i)) for i, o in enumerate(outs))
        assert tier.write_many([(0, 0, hdr(9), data(9))]) == [True]
        tier.close()
