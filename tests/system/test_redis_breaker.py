"""The redis tier's circuit breaker and log limiter with a fake clock (no server needed), and
the tier under concurrent threads against a real server."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvtier.store.payload import make_header
from kvtier.store.tiers.redis import RedisTier
from kvtier.store.tiers.redis_conn import Breaker, LogOnce

sys.path.insert(0, str(Path(__file__).parents[1]))
from redis_servers import redis_server  # noqa: E402

log = logging.getLogger("kvtier.test.breaker")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_to_the_cap_and_resets_on_success(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    b = Breaker(log, initial_s=0.5, max_s=4.0, clock=clock, describe="redis://x")
    assert b.allow() and b.up
    waits = []
    for _ in range(6):
        b.failure(ConnectionError("refused"))
        waits.append(b.retry_in_s)
        assert not b.allow()
        clock.now += b.retry_in_s
        assert b.allow()
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    b.success()
    assert b.up and b.allow() and b.retry_in_s == 0.0
    b.failure(ConnectionError("refused"))
    assert b.retry_in_s == 0.5  # a fresh outage starts from the initial backoff
    lines = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert len(lines) == 3  # down, back after 6 tries, down again
    assert "unreachable" in lines[0] and "back after 6 failed tries" in lines[1]


def test_log_once_holds_repeats_and_counts_them(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    lim = LogOnce(log, clock, interval_s=60.0)
    for _ in range(5):
        lim.warn("corrupt", "bad payload")
    lim.warn("budget", "at budget")  # another kind is not held back by the first
    clock.now += 61
    lim.warn("corrupt", "bad payload")
    lines = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert lines == ["bad payload", "at budget", "bad payload (4 more like it since the last line)"]


def test_concurrent_threads_read_what_they_wrote() -> None:
    ns = "7777777777777777"
    with redis_server() as srv:
        tier = RedisTier.from_url(srv.url, namespace_id=ns, max_connections=8)
        errors: list[str] = []

        def worker(t: int) -> None:
            gen = torch.Generator().manual_seed(t)
            for i in range(20):
                h = make_header(ns, bytes([t, i]) * 16, t % 3, 16 * i, 16 * (i + 1), 3000)
                d = torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=gen)
                out = torch.zeros(3000, dtype=torch.uint8)
                if not tier.write(t % 3, 0, h, d):
                    errors.append(f"write {t}/{i}")
                elif not (tier.read(t % 3, 0, h, out) and torch.equal(out, d)):
                    errors.append(f"read {t}/{i}")

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
        m = tier.metrics()
        assert m["writes"] == 80 and m["reads"] == 80 and m["misses"] == 0
        assert int(srv.cli("dbsize")) == 80
        tier.close()
