"""The redis tier against a server that lies about lengths or drips its bytes: real sockets (a
socketpair, or a tiny RESP server on loopback written here), no redis-server.

What it must keep: a length the server sends never sizes an allocation past the reply caps (a
reply that is not a value) or past the chunk asked for (a value); a call ends by its deadline,
`socket_timeout_s` after it began, however the server spaces its bytes, and is a counted miss
or failed save; a connection left out of step is dropped, never reused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from kvtier.store.payload import HEADER_BYTES, encode_header, make_header, seal
from kvtier.store.tiers.redis import RedisOptions, RedisTier

pytest.importorskip("redis")

NS = "5a5a5a5a01234567"
DEADLINE_S = 1.0
DRIP_S = 0.3  # one byte this often: each receive comes well within socket_timeout_s
GIVE_UP_S = 5.0  # a hostile server stops here (closes), so an unbounded call still ends
# the call ends by its deadline; the upper bound leaves a loaded 2-core machine 1.5 s of noise
LATE_S = (DEADLINE_S * 0.9, DEADLINE_S + 1.5)


# -- item: lengths the server sends ---------------------------------------------------------------

# Each case runs in a child process under an address-space limit: a reader that trusted these
# lengths would otherwise fill 1-2 GiB of a shared machine before failing.
_CHILD = r"""
import json, resource, socket, sys, tracemalloc
import redis.exceptions  # imported by the reader on first use: not a reply's allocation
from kvtier.store.payload import encode_header, make_header, seal
from kvtier.store.tiers.redis_reader import ReplyReader, read_reply, read_value

with open("/proc/self/statm") as f:
    vm = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
h = make_header("5a5a5a5a01234567", b"\x01" * 32, 0, 0, 64, 4096)
header = encode_header(seal(h, bytes(4096)))
cases = {
    "blob error as a GET reply": (b"!2147483648\r\n", True),
    "bulk reply to PEXPIRE": (b"$1073741824\r\n", False),
    "array count": (b"*2147483647\r\n", False),
    "map count": (b"%2147483647\r\n", False),
    "GET value longer than its chunk": (b"$2147483648\r\n" + header, True),
    "bulk length with a sign": (b"$+5\r\nhello\r\n", False),
}
tracemalloc.start()
out = {}
for name, (wire, is_value) in cases.items():
    a, b = socket.socketpair()
    a.settimeout(2)
    b.sendall(wire)  # and nothing more: a reader that waits for the rest times out
    dst = memoryview(bytearray(4096))
    value = (lambda r, n: read_value(r, n, h, dst, None)) if is_value else None
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        got = read_reply(ReplyReader(a), value)
        outcome = f"returned {got!r}"[:120]
    except BaseException as exc:
        outcome = f"{type(exc).__name__}: {exc}"[:200]
    out[name] = [outcome, tracemalloc.get_traced_memory()[1] - before]
    a.close(); b.close()
print(json.dumps(out))
"""


def test_a_length_the_server_sends_never_sizes_an_allocation() -> None:
    """A blob error `!2147483648` where a GET's value was due, `$1073741824` answering a PEXPIRE,
    array or map counts of 2**31-1, and a GET value longer than the chunk it was asked for: each
    a protocol error (a ConnectionError: the stream drops its connection) raised before reading
    the reply's body, with less than 1 MiB allocated."""
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    for name, (outcome, peak) in out.items():
        kind = "OversizedValue" if name.startswith("GET value") else "ProtocolError"
        assert outcome.startswith(kind + ":"), (name, outcome)
        assert peak < 1 << 20, (name, peak)


def test_a_protocol_error_is_a_connection_error() -> None:
    from kvtier.store.tiers.redis_conn import is_connection_error
    from kvtier.store.tiers.redis_reader import OversizedValue, ProtocolError

    assert issubclass(OversizedValue, ProtocolError) and issubclass(ProtocolError, ConnectionError)
    assert is_connection_error(ProtocolError("x"))  # any caller that does not know it drops the stream


# -- item: a server that spaces its bytes ----------------------------------------------------------


def _command(buf: bytes) -> tuple[bytes, int] | None:
    """(command name, length) of the first whole RESP command in `buf`, or None if incomplete."""
    if not buf.startswith(b"*"):
        raise AssertionError(f"not a RESP command: {buf[:40]!r}")
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    pos, name = end + 2, b""
    for k in range(int(buf[1:end])):
        e = buf.find(b"\r\n", pos)
        if e < 0:
            return None
        n = int(buf[pos + 1:e])
        if len(buf) < e + 2 + n + 2:
            return None
        if k == 0:
            name = buf[e + 2:e + 2 + n].upper()
        pos = e + 2 + n + 2
    return name, pos


class Hostile:
    """A loopback TCP server that answers redis-py's handshake (HELLO is unknown, anything else
    `+OK`) until it
    sees the first bytes of a command named in `trigger` (any command when empty), then hands the
    connection to `act(conn)` and closes it when that returns. Every action gives up after
    GIVE_UP_S, so a client with no deadline still ends, late."""

    def __init__(self, act: Callable[[socket.socket], None], trigger: tuple[bytes, ...]) -> None:
        self.act, self.trigger = act, trigger
        self.stop = threading.Event()
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.lsock.settimeout(0.2)
        self.port = self.lsock.getsockname()[1]
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.lsock.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(GIVE_UP_S)
        buf = b""
        try:
            while not self.stop.is_set():
                while buf:
                    if not self.trigger or any(b"\r\n" + t + b"\r\n" in buf[:64].upper() for t in self.trigger):
                        self.act(conn)
                        return
                    got = _command(buf)
                    if got is None:
                        break
                    buf = buf[got[1]:]
                    # RESP2: redis-py falls back to it when HELLO is unknown
                    conn.sendall(b"-ERR unknown command\r\n" if got[0] == b"HELLO" else b"+OK\r\n")
                more = conn.recv(65536)
                if not more:
                    return
                buf += more
        except OSError:
            pass
        finally:
            conn.close()

    def drip(self, reply: bytes) -> Callable[[socket.socket], None]:
        """One byte of `reply` every DRIP_S (each receive comes well within socket_timeout_s)."""
        def act(conn: socket.socket) -> None:
            t0 = time.monotonic()
            for k in range(len(reply)):
                if self.stop.wait(DRIP_S) or time.monotonic() - t0 > GIVE_UP_S:
                    return
                conn.sendall(reply[k:k + 1])
        return act

    def close(self) -> None:
        self.stop.set()
        self.lsock.close()
        for t in self.threads:
            t.join(GIVE_UP_S + 2)


def _hdr(i: int, nbytes: int = 4096):  # noqa: ANN202
    return make_header(NS, i.to_bytes(4, "little") * 8, 0, 64 * i, 64 * (i + 1), nbytes)


def _tier(port: int) -> RedisTier:
    return RedisTier(RedisOptions(url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=DEADLINE_S,
                                  connect_timeout_s=DEADLINE_S), namespace_id=NS)


def _value(i: int, nbytes: int = 4096) -> bytes:
    data = os.urandom(nbytes)
    return encode_header(seal(_hdr(i, nbytes), data)) + data


@pytest.mark.parametrize("where", ["handshake", "lookup", "load"])
def test_a_drip_ends_by_the_calls_deadline_as_a_counted_miss(where: str) -> None:
    """One byte every 0.3 s with socket_timeout_s=1: each receive is in time, the call is not.
    In redis-py's connection handshake (an endless `+OK...` line), in a lookup's EXISTS pipeline
    (an integer of 22 digits), in a load's GET stream (a whole value): the call ends about
    socket_timeout_s after it began (before: when the server stopped, ~5 s here; 55 min for a
    4 KiB value), a counted miss, and the breaker opens."""
    reply = {"handshake": b"+" + b"OK" * 40 + b"\r\n",
             "lookup": b":" + b"0" * 21 + b"1\r\n",
             "load": b"$%d\r\n%s\r\n" % (HEADER_BYTES + 4096, _value(1))}[where]
    trigger = {"handshake": (), "lookup": (b"EXISTS",), "load": (b"GET", b"GETEX")}[where]
    server = Hostile(lambda conn: None, trigger)
    server.act = server.drip(reply)
    tier = _tier(server.port)
    try:
        t0 = time.monotonic()
        if where == "lookup":
            got = tier.exists_many([_hdr(1)])
        else:
            got = tier.read_many([(0, 0, _hdr(1), bytearray(4096))])
        took = time.monotonic() - t0
        m = tier.metrics()
    finally:
        tier.close()
        server.close()
    assert got == [False]
    assert LATE_S[0] <= took <= LATE_S[1], f"{where}: the call took {took:.2f} s"
    assert m["up"] is False and m["connection_failures"] == 1
    if where != "lookup":  # a lookup counts no reads: its miss is the False
        assert m["misses"] == 1 and m["reads"] == 1 and m["skipped_reads"] == 1
    assert "Timeout" in (tier.last_error or ""), tier.last_error


def _slow_reader(server: Hostile, piece: int, every_s: float) -> Callable[[socket.socket], None]:
    """Reads `piece` bytes every `every_s` (0 bytes: never reads again), never answers."""
    def act(conn: socket.socket) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < GIVE_UP_S and not server.stop.wait(every_s):
            if piece and not conn.recv(piece):
                return
    return act


@pytest.mark.parametrize("reader", ["never reads", "reads slowly"])
def test_a_save_ends_by_its_deadline_as_a_failed_save(reader: str) -> None:
    """A server that stops reading once the SETs begin (the socket buffers fill), or reads 256 KiB
    every 0.2 s (every sendmsg moves a little, well within socket_timeout_s): the save of 24 MiB
    ends about socket_timeout_s after it began (before, for the slow reader: when the server
    gave up, ~5 s here), every value a failed save, and the breaker opens."""
    server = Hostile(lambda conn: None, (b"SET",))
    server.act = _slow_reader(server, 0, 0.05) if reader == "never reads" else _slow_reader(server, 256 << 10, 0.2)
    tier = _tier(server.port)
    n, size = 24, 1 << 20
    items = [(0, 0, _hdr(i, size), bytearray(os.urandom(size))) for i in range(n)]
    try:
        t0 = time.monotonic()
        ok = tier.write_many(items)
        took = time.monotonic() - t0
        m = tier.metrics()
    finally:
        tier.close()
        server.close()
    assert ok == [False] * n
    assert LATE_S[0] <= took <= LATE_S[1], f"{reader}: the save took {took:.2f} s"
    assert m["failed_writes"] == n and m["writes"] == 0 and m["skipped_saves"] == n
    assert m["up"] is False and m["connection_failures"] == 1


def test_the_deadline_holds_inside_a_call_and_the_sockets_own_timeout_outside() -> None:
    """Inside `call_deadline` a receive waits only for the time left, and once past it raises
    without waiting; outside, the socket has redis-py's own timeout back (a pooled connection used
    by a caller with no deadline behaves as redis-py set it); nested, the earlier deadline holds."""
    from kvtier.store.tiers.redis_conn import DeadlineSocket, call_deadline

    a, b = socket.socketpair()
    a.settimeout(5.0)
    sock = DeadlineSocket(a)
    b.sendall(b"xy")
    with call_deadline(30.0), call_deadline(0.5):
        assert sock.recv(1) == b"x" and 0 < a.gettimeout() <= 0.5
    assert sock.recv(1) == b"y" and a.gettimeout() == sock.gettimeout() == 5.0
    with call_deadline(0.3):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            sock.recv(1)  # nothing comes: the time left, not the socket's 5 s
        assert 0.25 <= time.monotonic() - t0 <= 1.8
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline"):
            sock.recv(1)  # past it: raised before waiting at all
        assert time.monotonic() - t0 < 0.1
    a.close()
    b.close()
