"""The redis tier against a real redis-server that fails: down at start, killed mid-run and
restarted, hung (SIGSTOP), evicting under maxmemory, refusing writes (noeviction), and payloads
that are half-written, foreign or gone between lookup and load. Every case is a counted miss or
skipped save, one log line, never an exception and never wrong bytes; the tier comes back by
itself once its backoff deadline passes."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

from kvtier.store.payload import ChunkHeader, encode_header, make_header, seal
from kvtier.store.tiers.redis import RedisOptions, RedisTier

sys.path.insert(0, str(Path(__file__).parents[1]))
from redis_servers import RedisServer, free_port, redis_server  # noqa: E402

NS = "5a5a5a5a01234567"
LOGGER = "kvtier.store.tiers.redis"


class FakeClock:
    """The breaker's clock: tests move time instead of sleeping through backoffs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def hdr(i: int, nbytes: int = 4096, group: int = 0) -> ChunkHeader:
    return make_header(NS, i.to_bytes(4, "little") * 8, group, 64 * i, 64 * (i + 1), nbytes)


def data(i: int, nbytes: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def write(tier: RedisTier, ids: range, nbytes: int = 4096) -> list[bool]:
    return tier.write_many([(0, 0, hdr(i, nbytes), data(i, nbytes)) for i in ids])


def read(tier: RedisTier, ids: range, nbytes: int = 4096) -> tuple[list[bool], list[torch.Tensor]]:
    outs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in ids]
    ok = tier.read_many([(0, 0, hdr(i, nbytes), o) for i, o in zip(ids, outs)])
    return ok, outs


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def server(tmp_path: Path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def make(url: str, clock: FakeClock, **opts: object) -> RedisTier:
    # generous: one slow reply from a CPU-starved server would open the breaker for the rest of a
    # test whose clock never advances by itself (the hung-server test sets its own 0.2 s)
    opts.setdefault("socket_timeout_s", 5.0)
    opts.setdefault("connect_timeout_s", 5.0)
    return RedisTier(RedisOptions(url=url, backoff_initial_s=1.0, backoff_max_s=8.0, **opts),
                     namespace_id=NS, clock=clock)


def test_down_at_start_then_comes_up(tmp_path: Path, clock: FakeClock,
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    srv = RedisServer(tmp_path / "late")  # port reserved, nothing listening yet
    tier = make(srv.url, clock)
    for _ in range(20):  # inference goes on: every call is a value, not an exception
        assert write(tier, range(3)) == [False] * 3
        assert tier.exists_many([hdr(0)]) == [False]
        assert read(tier, range(2))[0] == [False, False]
    m = tier.metrics()
    assert m["up"] is False and m["connection_failures"] == 1  # one try, then the breaker skips
    assert m["failed_writes"] == 60 and m["misses"] == 40 and m["writes"] == 0
    assert len(warnings(caplog)) == 1 and "unreachable" in warnings(caplog)[0]
    srv.start()
    try:
        assert write(tier, range(1)) == [False]  # still inside the 1 s backoff: not even tried
        clock.advance(1.01)
        assert write(tier, range(3)) == [True] * 3
        ok, outs = read(tier, range(3))
        assert ok == [True] * 3 and all(torch.equal(o, data(i)) for i, o in enumerate(outs))
        assert tier.up and "is back" in warnings(caplog)[-1] and len(warnings(caplog)) == 2
    finally:
        srv.stop()
        tier.close()


def test_killed_mid_run_then_restarted(server: RedisServer, clock: FakeClock,
                                       caplog: pytest.LogCaptureFixture) -> None:
    tier = make(server.url, clock)
    assert write(tier, range(4)) == [True] * 4
    server.kill()  # SIGKILL
    ok, _ = read(tier, range(4))
    assert ok == [False] * 4
    failures = tier.metrics()["connection_failures"]
    clock.advance(1.01)  # the next try fails too: the backoff doubles (1 s -> 2 s)
    assert write(tier, range(4, 6)) == [False, False]
    assert tier.metrics()["connection_failures"] == failures + 1
    clock.advance(1.01)
    assert write(tier, range(4, 6)) == [False, False]  # 1 s later: inside the 2 s backoff
    assert tier.metrics()["connection_failures"] == failures + 1
    server.start()  # same port, empty (persistence is off)
    clock.advance(1.01)
    assert write(tier, range(4, 6)) == [True, True]
    ok, outs = read(tier, range(6))
    assert ok == [False] * 4 + [True] * 2  # what died with the server is a miss
    assert torch.equal(outs[5], data(5))
    assert len(warnings(caplog)) == 2  # "unreachable" once, "is back" once
    assert "Connection refused" in tier.last_error  # the message, not just redis-py's class
    tier.close()


def test_hung_server_costs_one_timeout_not_a_stall(server: RedisServer, clock: FakeClock) -> None:
    import redis.connection

    tier = make(server.url, clock, socket_timeout_s=0.2)
    assert write(tier, range(2)) == [True, True]
    # every command redis-py puts on a socket, counted: bounds noise cannot break (a slow machine
    # only lengthens times; a count of socket sends is the same on every machine)
    sends: list[float] = []
    real_send = redis.connection.AbstractConnection.send_packed_command

    def counting_send(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        sends.append(time.monotonic())
        return real_send(self, *a, **kw)

    before = tier.metrics()
    server.pause()  # SIGSTOP: the socket accepts, nothing answers
    try:
        redis.connection.AbstractConnection.send_packed_command = counting_send
        t0 = time.monotonic()
        assert read(tier, range(2))[0] == [False, False]
        first_s = time.monotonic() - t0
        first_sends = len(sends)
        for _ in range(50):
            assert read(tier, range(2))[0] == [False, False]
            assert write(tier, range(2, 3)) == [False]
    finally:
        redis.connection.AbstractConnection.send_packed_command = real_send
        server.resume()
    after = tier.metrics()
    assert first_s >= 0.2 * 0.9, first_s  # it waited for its socket timeout (noise only adds)
    assert first_sends == 1, sends  # one pipeline sent, then the timeout: no redis-py retries
    assert after["connection_failures"] == before["connection_failures"] + 1
    # the breaker skipped the next 100 calls without touching the socket
    assert len(sends) == first_sends, sends
    assert after["skipped_reads"] - before["skipped_reads"] == 2 + 50 * 2  # the timed-out read too
    assert after["skipped_saves"] - before["skipped_saves"] == 50
    clock.advance(1.01)
    ok, outs = read(tier, range(2))
    assert ok == [True, True] and torch.equal(outs[1], data(1))
    tier.close()


def test_evictions_under_maxmemory_are_misses_never_wrong_bytes(server: RedisServer,
                                                                clock: FakeClock) -> None:
    server.cli("config", "set", "maxmemory", "3mb")
    server.cli("config", "set", "maxmemory-policy", "allkeys-lru")
    tier = make(server.url, clock)
    n, size = 60, 100_000  # 6 MB of payloads into 3 MB
    assert all(write(tier, range(n), size))
    present = tier.exists_many([hdr(i, size) for i in range(n)])
    assert 0 < sum(present) < n  # Redis evicted some, kept some
    ok, outs = read(tier, range(n), size)
    assert sum(ok) > 0
    for i in range(n):
        if ok[i]:
            assert torch.equal(outs[i], data(i, size))
    assert tier.metrics()["vanished"] == n - sum(ok) and tier.up
    tier.close()


def test_noeviction_full_server_fails_saves_without_tripping(server: RedisServer,
                                                            clock: FakeClock) -> None:
    server.cli("config", "set", "maxmemory", "2mb")
    server.cli("config", "set", "maxmemory-policy", "noeviction")
    tier = make(server.url, clock)
    ok = write(tier, range(40), 100_000)
    assert ok[0] and not all(ok)  # OOM replies once full
    m = tier.metrics()
    assert m["failed_writes"] == ok.count(False) and m["up"] is True  # reads still served
    got, outs = read(tier, range(1), 100_000)
    assert got == [True] and torch.equal(outs[0], data(0, 100_000))
    tier.close()


def test_evicted_between_lookup_and_load(server: RedisServer, clock: FakeClock) -> None:
    tier = make(server.url, clock)
    write(tier, range(3))
    assert tier.exists_many([hdr(i) for i in range(3)]) == [True] * 3
    other = redis.Redis.from_url(server.url)
    other.delete(tier.key(hdr(1)))  # another process, or Redis's LRU, removes it meanwhile
    other.close()
    ok, outs = read(tier, range(3))
    assert ok == [True, False, True]
    assert torch.equal(outs[0], data(0)) and torch.equal(outs[2], data(2))
    assert tier.metrics()["vanished"] == 1 and tier.corrupt_dropped == 0
    tier.close()


@pytest.mark.parametrize("damage", ["header_only", "truncated", "flipped", "bad_magic", "foreign"])
def test_half_written_or_foreign_payload_is_a_miss_and_removed(
        server: RedisServer, clock: FakeClock, damage: str,
        caplog: pytest.LogCaptureFixture) -> None:
    tier = make(server.url, clock)
    h, d = hdr(7), data(7)
    sealed = seal(h, d)
    good = encode_header(sealed) + d.numpy().tobytes()
    bad = {
        "header_only": good[:128],
        "truncated": good[:-1000],
        "flipped": good[:2000] + bytes([good[2000] ^ 1]) + good[2001:],
        "bad_magic": b"XXXX" + good[4:],
        "foreign": encode_header(seal(hdr(8), data(8))) + data(8).numpy().tobytes(),
    }[damage]
    r = redis.Redis.from_url(server.url)
    r.set(tier.key(h), bad)
    out = torch.zeros(4096, dtype=torch.uint8)
    assert tier.read(0, 0, h, out) is False
    assert tier.corrupt_dropped == 1 and tier.misses == 1
    assert r.exists(tier.key(h)) == 0  # dropped, so no other process trips on it
    assert len(warnings(caplog)) == 1 and "bad payload" in warnings(caplog)[0]
    r.close()
    tier.close()


def test_a_value_longer_than_its_chunk_is_never_read_and_is_removed(
        server: RedisServer, clock: FakeClock) -> None:
    """A value under a chunk's key longer than that chunk (header + payload: the slot it would
    land in) is not read, not even past: the load stops there, its connection is dropped (the
    rest of its replies are unread), the batch is a counted miss, that key is removed as broken
    for everyone, and the breaker stays closed (a bad value, not a bad server). The next load,
    on a fresh connection, reads the others."""
    tier = make(server.url, clock)
    write(tier, range(3))
    h = hdr(1)
    r = redis.Redis.from_url(server.url)
    r.set(tier.key(h), encode_header(seal(h, data(1))) + data(1).numpy().tobytes() + bytes(1 << 20))
    ok, _ = read(tier, range(3))
    m = tier.metrics()
    assert ok == [False] * 3
    assert m["misses"] == 3 and m["corrupt_dropped"] == 1 and m["bytes_read"] == 0
    assert m["up"] is True and m["connection_failures"] == 0
    assert "OversizedValue" in tier.last_error and "1052800 bytes" in tier.last_error
    assert r.exists(tier.key(h)) == 0
    ok, outs = read(tier, range(3))
    assert ok == [True, False, True] and torch.equal(outs[2], data(2))
    r.close()
    tier.close()


def test_an_error_reply_is_a_counted_miss_that_says_why(server: RedisServer, clock: FakeClock,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    tier = make(server.url, clock)
    write(tier, range(2))
    r = redis.Redis.from_url(server.url)
    r.delete(tier.key(hdr(1)))
    r.rpush(tier.key(hdr(1)), b"x")  # GET on a list: a WRONGTYPE reply for that key alone
    ok, outs = read(tier, range(2))
    assert ok == [True, False] and torch.equal(outs[0], data(0))
    m = tier.metrics()
    assert m["errors"] == 1 and m["misses"] == 1 and m["up"] is True
    assert "WRONGTYPE" in tier.last_error
    assert len(warnings(caplog)) == 1 and "WRONGTYPE" in warnings(caplog)[0]
    r.close()
    tier.close()


def test_corrupt_payloads_log_one_line_not_a_flood(server: RedisServer, clock: FakeClock,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    tier = make(server.url, clock)
    r = redis.Redis.from_url(server.url)
    for i in range(30):
        r.set(tier.key(hdr(i)), b"garbage" * 100)
    assert read(tier, range(30))[0] == [False] * 30
    assert tier.corrupt_dropped == 30 and len(warnings(caplog)) == 1
    r.close()
    tier.close()


def test_ttl_and_touch_on_hit(server: RedisServer, clock: FakeClock) -> None:
    tier = make(server.url, clock, ttl_s=30.0)
    write(tier, range(1))
    r = redis.Redis.from_url(server.url)
    key = tier.key(hdr(0))
    assert 25_000 < r.pttl(key) <= 30_000
    r.pexpire(key, 5_000)
    assert read(tier, range(1))[0] == [True]
    assert r.pttl(key) > 25_000  # a hit renews the TTL (LRU-like expiry across processes)
    r.close()
    tier.close()


def test_ttl_renewal_without_getex(tmp_path: Path, clock: FakeClock,
                                   caplog: pytest.LogCaptureFixture) -> None:
    # a server without GETEX (Redis < 6.2), made by renaming the command away
    srv = RedisServer(tmp_path / "old", extra_args=("--rename-command", "GETEX", "")).start()
    try:
        tier = make(srv.url, clock, ttl_s=30.0)
        write(tier, range(2))
        r = redis.Redis.from_url(srv.url)
        r.pexpire(tier.key(hdr(0)), 5_000)
        for _ in range(2):  # the first read finds out, the second goes straight to GET+PEXPIRE
            ok, outs = read(tier, range(2))
            assert ok == [True, True] and torch.equal(outs[0], data(0))
        assert r.pttl(tier.key(hdr(0))) > 25_000
        assert sum("no GETEX" in m for m in warnings(caplog)) == 1
        assert tier.metrics()["errors"] == 0 and tier.misses == 0
        r.close()
        tier.close()
    finally:
        srv.stop()


def test_budget_bounds_bytes_per_ttl_window(server: RedisServer, clock: FakeClock) -> None:
    wall = FakeClock()
    budget = 3 * (4096 + 128)  # three payloads with their headers
    opts = RedisOptions(url=server.url, ttl_s=8.0, budget_bytes=budget)
    a = RedisTier(opts, namespace_id=NS, clock=clock, wall_clock=wall)
    b = RedisTier(opts, namespace_id=NS, clock=clock, wall_clock=wall)  # another process
    assert write(a, range(2)) == [True, True]
    assert write(b, range(2, 5)) == [True, False, False]  # b sees a's bytes in Redis
    assert b.metrics()["budget_skipped"] == 2 and b.failed_writes == 2
    r = redis.Redis.from_url(server.url)
    assert 0 < r.pttl(a.key(hdr(0))) <= 8_000  # hits do not renew TTLs under a budget
    wall.advance(8.0 * 1.25 + 2.0)  # the window of those writes has passed (they expired)
    assert write(a, range(5, 7)) == [True, True]
    r.close()
    a.close()
    b.close()


def test_a_budget_counter_that_is_not_an_integer_fails_the_write_as_a_value(server: RedisServer,
                                                                             clock: FakeClock) -> None:
    """Someone wrote text into the namespace's budget key: the save fails and is counted, it
    does not raise out of RedisTier.write (it raised ValueError)."""
    wall = FakeClock()
    opts = RedisOptions(url=server.url, ttl_s=8.0, budget_bytes=1 << 20)
    a = RedisTier(opts, namespace_id=NS, clock=clock, wall_clock=wall)
    r = redis.Redis.from_url(server.url)
    for key in a._budget.live_keys(NS):
        r.set(key, b"not-a-number")
    assert write(a, range(2)) == [False, False]
    assert a.failed_writes == 2 and a.metrics()["errors"] == 1
    assert "not an integer" in (a.last_error or "")
    r.close()
    a.close()


def test_auth_and_tls(tmp_path: Path, clock: FakeClock) -> None:
    with redis_server(tls=True, password="s3cret") as srv:
        assert srv.tls is not None
        srv.cli("acl", "setuser", "kv", "on", ">pw2", "~kvtier:*", "+@all")
        for user, pw in ((None, "s3cret"), ("kv", "pw2")):
            tier = make(srv.url, clock, username=user, password=pw,
                        tls_ca_path=str(srv.tls.ca))
            assert write(tier, range(2)) == [True, True]
            ok, outs = read(tier, range(2))
            assert ok == [True, True] and torch.equal(outs[1], data(1))
            big = 1 << 20  # many TLS records a value: read straight off the TLS socket, in step
            assert write(tier, range(10, 13), big) == [True] * 3
            ok, outs = read(tier, range(10, 13), big)
            assert ok == [True] * 3 and all(torch.equal(o, data(i, big)) for i, o in zip(range(10, 13), outs))
            tier.close()
        wrong = make(srv.url, clock, password="nope", tls_ca_path=str(srv.tls.ca))
        assert write(wrong, range(1)) == [False]  # refused: a counted failure, one log line
        assert wrong.metrics()["up"] is False and "Authentication" in wrong.last_error
        wrong.close()
        untrusted = make(srv.url, clock, password="s3cret")  # no CA: certificate not trusted
        assert write(untrusted, range(1)) == [False]
        untrusted.close()


def test_mutual_tls_needs_the_client_certificate(clock: FakeClock) -> None:
    with redis_server(mutual_tls=True) as srv:
        assert srv.tls is not None
        tier = make(srv.url, clock, tls_ca_path=str(srv.tls.ca),
                    tls_cert_path=str(srv.tls.client_cert), tls_key_path=str(srv.tls.client_key))
        assert write(tier, range(2)) == [True, True]
        ok, outs = read(tier, range(2))
        assert ok == [True, True] and torch.equal(outs[0], data(0))
        tier.close()
        anonymous = make(srv.url, clock, tls_ca_path=str(srv.tls.ca))  # no client certificate
        assert write(anonymous, range(1)) == [False] and anonymous.metrics()["up"] is False
        anonymous.close()
        assert int(srv.cli("dbsize")) == 2


def test_nothing_listening_is_fast(clock: FakeClock) -> None:
    tier = make(f"redis://127.0.0.1:{free_port()}/0", clock)
    t0 = time.monotonic()
    for _ in range(1000):
        tier.exists_many([hdr(0)])
    assert time.monotonic() - t0 < 1.0  # one refused connect, then the breaker answers
    tier.close()


def test_a_big_batch_on_a_healthy_link_gets_time_for_its_bytes(server, clock: FakeClock) -> None:
    """A call's deadline is socket_timeout_s plus its bytes at MIN_RATE_BYTES_S (a flat deadline
    cut a 64 MiB batch off below 64 MiB/s and opened the breaker), and a batch of 48 MiB through a
    real server is saved and read back whole under it."""
    from kvtier.store.tiers import redis as redis_tier

    nbytes = 4 << 20
    tier = make(server.url, clock, socket_timeout_s=0.5)
    try:
        assert tier._deadline_s(0) == 0.5  # a lookup: the flat part only
        assert tier._deadline_s(64 << 20) == pytest.approx(0.5 + (64 << 20) / redis_tier.MIN_RATE_BYTES_S)
        assert redis_tier.MIN_RATE_BYTES_S == 32 << 20  # docs/redis.md states it
        assert write(tier, range(12), nbytes) == [True] * 12, (tier.metrics(), tier.last_error)
        ok, outs = read(tier, range(12), nbytes)
        assert ok == [True] * 12 and all(torch.equal(o, data(i, nbytes)) for i, o in enumerate(outs))
        assert tier.up and tier.metrics()["failed_writes"] == 0
    finally:
        tier.close()
