"""The redis tier's save and load streams (`redis_wire`, `redis_reader`) and its write budget,
against a real redis-server: values go to the socket without a copy in the client, each sealed
(checksum, MAC) by the sender just before it is sent;
loads land each payload in the caller's buffer straight off the socket; a stream that fails
halfway never leaves a half-written command or a half-read reply on a pooled connection; the
budget's counters are read once per bucket, not before every batch."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import redis
import torch

from kvtier.store.integrity import Keyed
from kvtier.store.payload import HEADER_BYTES, MAC_BLAKE3, MAC_GMAC, decode_header
from kvtier.store.tiers import redis_wire
from kvtier.store.tiers.redis import RedisOptions, RedisTier

sys.path.insert(0, str(Path(__file__).parents[1]))
from redis_servers import have_redis, redis_server  # noqa: E402
from test_redis_faults import NS, FakeClock, data, hdr, read, write  # noqa: E402

SECRET = b"stream-tenant-" + b"s" * 18


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    if not have_redis():
        pytest.fail("redis-server is not installed; `make test` installs it (scripts/ensure-redis.sh)")
    with redis_server() as srv:
        yield srv


@pytest.mark.parametrize("kind", [None, MAC_GMAC, MAC_BLAKE3])
def test_a_save_streams_its_values_without_copying_them(server, monkeypatch, kind) -> None:
    """8 values of 512 KiB: nothing is laid out in the arena (before: every payload was copied
    into it, then the batch was sent); every value is sealed (checksum, or checksum and MAC) by
    the sender itself, each just before it is sent, and no thread is started (before: a helper
    thread sealed ahead while a core looked free, fast only while both cores were warm:
    redis_wire); each stored value is header + the caller's bytes, bit for bit."""
    if kind == MAC_BLAKE3:
        pytest.importorskip("blake3")
    secret = SECRET if kind else None
    sealed_on: list[str] = []
    real_seal = redis_wire.seal_value

    def spy(header, view, keyed):  # noqa: ANN001, ANN202
        sealed_on.append(threading.current_thread().name)
        return real_seal(header, view, keyed)

    monkeypatch.setattr(redis_wire, "seal_value", spy)
    n = 512 << 10
    tier = RedisTier(RedisOptions(url=server.url), namespace_id=NS,
                     keyed=Keyed(secret, kind=kind) if secret else None)
    threads = {t.ident for t in threading.enumerate()}
    assert write(tier, range(8), n) == [True] * 8
    assert {t.ident for t in threading.enumerate()} <= threads  # no helper thread
    assert len(tier._arena._buf) == 0  # no copy of any payload was made
    assert sealed_on == [threading.current_thread().name] * 8
    r = redis.Redis.from_url(server.url)
    for i in range(8):
        raw = r.get(tier.key(hdr(i, n)))
        h = decode_header(raw[:HEADER_BYTES])
        assert raw[HEADER_BYTES:] == data(i, n).numpy().tobytes() and h.payload_bytes == n
        assert bool(h.mac) == (secret is not None) and h.mac_kind == (kind or 0)
    ok, outs = read(tier, range(8), n)
    assert ok == [True] * 8 and all(torch.equal(o, data(i, n)) for i, o in zip(range(8), outs))
    assert tier.metrics()["writes"] == 8 and tier.metrics()["bytes_written"] == 8 * n
    r.close()
    tier.close()


def test_a_stream_that_fails_halfway_never_leaves_a_half_written_command(server, monkeypatch) -> None:
    """Sealing value 3 of 6 fails after values 0-2 went out (value 2 without its closing CRLF):
    the batch is a counted failure (never an exception into the engine), the connection is dropped rather than handed back to the pool
    mid-command, and the next save and load on the same tier are whole and right."""
    real = redis_wire.seal_value

    def failing(header, view, keyed):  # noqa: ANN001, ANN202
        if header.token_start == hdr(103).token_start:  # value 3, on whichever thread seals it
            raise RuntimeError("sealing failed")
        return real(header, view, keyed)

    tier = RedisTier(RedisOptions(url=server.url, max_connections=1), namespace_id=NS)
    monkeypatch.setattr(redis_wire, "seal_value", failing)
    assert write(tier, range(100, 106), 64 << 10) == [False] * 6
    m = tier.metrics()
    assert m["failed_writes"] == 6 and m["errors"] == 1 and m["writes"] == 0 and m["up"]
    monkeypatch.setattr(redis_wire, "seal_value", real)
    assert write(tier, range(110, 116), 64 << 10) == [True] * 6  # the one pooled connection works
    ok, outs = read(tier, range(110, 116), 64 << 10)
    assert ok == [True] * 6 and torch.equal(outs[5], data(115, 64 << 10))
    # values 0 and 1 went out whole (the server may have stored them before the connection was
    # reset: harmless, they read back right); value 2 lacked its closing CRLF: never stored
    r = redis.Redis.from_url(server.url)
    stored = [r.exists(tier.key(hdr(i, 64 << 10))) for i in range(100, 106)]
    assert stored[2:] == [0, 0, 0, 0]
    ok, outs = read(tier, range(100, 102), 64 << 10)
    assert ok == [bool(x) for x in stored[:2]]
    assert all(torch.equal(o, data(i, 64 << 10)) for i, o, y in zip(range(100, 102), outs, ok) if y)
    r.close()
    tier.close()


def test_the_budget_counters_are_read_once_per_bucket_not_before_every_batch(server) -> None:
    """Before: every save read the namespace's 5 budget counters first (a round trip per batch).
    Now they are read once per bucket; each write's INCRBY reply brings the current bucket's total
    (every process's bytes) back. The budget still holds across two tiers, and a stale view is
    read again after `refresh_s` or in a new bucket."""
    r = redis.Redis.from_url(server.url)
    r.config_resetstat()
    clock, wall = FakeClock(), FakeClock()
    size = 4096 + HEADER_BYTES
    opts = RedisOptions(url=server.url, ttl_s=8.0, budget_bytes=5 * size, key_prefix="budget-once")
    a = RedisTier(opts, namespace_id=NS, clock=clock, wall_clock=wall)
    b = RedisTier(opts, namespace_id=NS, clock=clock, wall_clock=wall)  # another process

    def gets() -> int:
        return int(r.info("commandstats").get("cmdstat_get", {}).get("calls", 0))

    assert write(a, range(0, 1)) == [True]
    assert write(a, range(1, 2)) == [True]  # known from the first write's INCRBY reply: no read
    assert write(b, range(2, 4)) == [True, True]  # b reads once: a's 2 payloads are there
    assert write(a, range(4, 5)) == [True]  # a has not seen b's bytes yet (approximate): 5 in all
    assert write(a, range(5, 6)) == [False]  # its INCRBY reply said 5: full, without a read
    # b last heard 4 (its own INCRBY reply) and has not seen a's payload since: it overshoots by
    # that one, the documented bound (what others wrote since this process's last write or read,
    # at most refresh_s ago); its reply says 6, so its next save is refused
    assert write(b, range(6, 7)) == [True]
    assert write(b, range(7, 8)) == [False]
    assert a.metrics()["budget_skipped"] == 1 and b.metrics()["budget_skipped"] == 1
    assert gets() == 2 * 5  # one read of the 5 counters by each tier (before: 7 reads)
    assert (a._budget.reads, b._budget.reads) == (1, 1)
    clock.advance(a._budget.refresh_s + 0.1)  # nothing learnt for refresh_s: read again
    assert write(a, range(8, 9)) == [False] and a._budget.reads == 2
    wall.advance(8.0 * 1.25 + 2.0)  # a later bucket: those writes have aged out
    assert write(a, range(9, 11)) == [True, True] and a._budget.reads == 3
    r.close()
    a.close()
    b.close()


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_load_lands_each_payload_straight_off_the_socket(server, monkeypatch, secret) -> None:
    """Before: redis-py's parser read each reply into its buffer and sliced a `bytes` out of it,
    which kvtier copied into the caller's buffer (the parser was 80% of a load). Now the replies
    are read off the socket by `redis_reader` and the payload lands in the caller's buffer: the
    parser and the bytes path (`restore`) are never used, with or without a secret, with TTL
    renewal (GETEX) or without; the values are right bit for bit and the pooled connection is
    clean for the next caller."""
    import kvtier.store.tiers.redis as redis_tier

    def never(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a load went through redis-py's parser / the bytes path")

    real_conn = redis_wire.get_connection

    def no_parser(pool):  # noqa: ANN001, ANN202
        conn = real_conn(pool)
        send = conn.send_packed_command

        def send_then_no_parser(*a, **k):  # noqa: ANN002, ANN003, ANN202
            send(*a, **k)  # its health check may use the parser: the replies may not
            conn.read_response = never

        conn.send_packed_command = send_then_no_parser
        return conn

    n = 256 << 10
    for ttl in (None, 60.0):
        tier = RedisTier(RedisOptions(url=server.url, max_connections=1, ttl_s=ttl), namespace_id=NS,
                         keyed=Keyed(secret) if secret else None)
        assert write(tier, range(40, 46), n) == [True] * 6
        monkeypatch.setattr(redis_tier, "restore", never)
        monkeypatch.setattr(redis_wire, "get_connection", no_parser)
        ok, outs = read(tier, range(40, 46), n)
        assert ok == [True] * 6 and all(torch.equal(o, data(i, n)) for i, o in zip(range(40, 46), outs))
        monkeypatch.undo()
        for conn in tier._get_client().connection_pool._available_connections:
            conn.__dict__.pop("read_response", None)
            conn.__dict__.pop("send_packed_command", None)
        assert tier.metrics()["bytes_read"] == 6 * n and tier.metrics()["up"]
        assert tier._get_client().ping()  # the one pooled connection is in step
        tier.close()


def test_a_load_whose_check_raises_is_a_counted_miss_and_the_connection_is_clean(server, monkeypatch) -> None:
    """A check that raises (a bug, not a bad value) halfway through a reply: the batch is a
    counted error, every chunk a miss, no exception into the engine; the half-read connection is
    dropped, never pooled, so the next load on the same one-connection pool reads every value
    right."""
    import kvtier.store.tiers.redis as redis_tier

    real = redis_tier.read_value
    tier = RedisTier(RedisOptions(url=server.url, max_connections=1), namespace_id=NS, keyed=Keyed(SECRET))
    assert write(tier, range(50, 56), 64 << 10) == [True] * 6

    def failing(r, length, header, dst, keyed):  # noqa: ANN001, ANN202
        if header.token_start == 64 * 52:
            r.into(dst[:100])  # part of the value read, the rest left on the socket
            raise RuntimeError("check failed")
        return real(r, length, header, dst, keyed)

    monkeypatch.setattr(redis_tier, "read_value", failing)
    ok, _ = read(tier, range(50, 56), 64 << 10)
    assert ok == [False] * 6 and tier.metrics()["errors"] == 1 and tier.metrics()["up"]
    monkeypatch.setattr(redis_tier, "read_value", real)
    ok, outs = read(tier, range(50, 56), 64 << 10)
    assert ok == [True] * 6 and torch.equal(outs[2], data(52, 64 << 10))
    tier.close()
