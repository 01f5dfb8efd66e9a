"""The redis tier's save stream: SETs written straight to one connection, zero-copy, each value
sealed (checksum, MAC) on a helper thread while the one before it is on the wire.

A value is kvtier's 128-byte header followed by the payload (`redis_codec`). redis-py sends one
argument as one buffer, so a SET through it needs header and payload side by side in memory: a
copy of every payload into an arena before the batch could start (the `Arena` path, kept for
Redis Cluster, whose pipeline routes each key to its node and follows MOVED/ASK). Here the RESP
of each SET is written by hand, `$<length>\\r\\n` + header + the caller's payload buffer +
`\\r\\n`, in one gather write (`sendmsg`, `send_all`) on one connection of the client's pool:
the server sees one bulk string, so one SET stays atomic for every reader, and the payload goes
from the caller's tensor to the socket without a copy in this process.

Overlap. A value's header (its checksum, and its MAC with a secret) must be on the wire before
its payload, so it is computed before the value is sent; on the caller's thread that would keep
the server waiting for it, value after value (the server, not the client, bounds the send, so
the client's core idles while a value is on the wire). A helper
thread seals value k+1 while this thread sends value k (the C checksum and OpenSSL's MAC release
the GIL). The sender never waits for the helper: a value the helper has not finished when the
sender needs it is sealed by the sender (`_Sealer`), so a
helper that a busy host does not schedule never stalls the stream. This thread never returns
while the helper can still read the caller's buffers. The tier
hands work to the helper only while a core looks free (`SpareCore`, the disk tier's `auto`
rule): on busy cores a helper is no faster than inline (its CPU comes from the same cores). Loads (`get_stream`) read the replies off the socket straight into the
caller's buffers, checked as they land (`redis_reader`): no helper. Both streams run inside the
tier's call deadline: each sendmsg and receive of theirs ends by it (`redis_conn.DeadlineSocket`).

With a secret (AES-GMAC) every value is sealed inline on the sender, one `Keyed.seal` a value
(xxh3 in C, then one streamed OpenSSL GMAC of header and payload): a helper thread took the core
the server needs and saved slower (docs/redis.md, "Benchmark"). Keyed BLAKE3 (written only where
`cryptography` is missing) keeps the helper.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from kvtier.store.integrity import Keyed
from kvtier.store.payload import CHECKSUM_NONE, MAC_GMAC, ChunkHeader, encode_header, seal
from kvtier.store.tiers.redis_reader import ReplyReader, Streamed, read_reply, socket_of

CRLF = b"\r\n"
# a batch of fewer values (or fewer bytes) is sealed on the caller's thread: waking the helper
# costs more than it would save
OVERLAP_MIN_VALUES = 2
OVERLAP_MIN_BYTES = 256 << 10


class SpareCore:
    """Whether a core looks free for the sealing thread: the load average (which counts this
    process too) leaves half a core, on a host of at least 2; read at most once a second."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock, self._checked, self._free = clock, -1e9, False

    def __call__(self) -> bool:
        now = self._clock()
        if now - self._checked >= 1.0:
            self._checked = now
            cores = len(os.sched_getaffinity(0))
            self._free = cores >= 2 and cores - os.getloadavg()[0] >= 0.5
        return self._free


def seal_value(header: ChunkHeader, view: memoryview, keyed: Keyed | None) -> bytes:
    """The 128 encoded bytes of one value's sealed header (checksum if the header has none yet;
    MAC with a secret: `Keyed.seal` builds the header once where it can)."""
    if keyed is not None and (raw := keyed.seal(header, view)) is not None:
        return raw
    if header.checksum_kind == CHECKSUM_NONE:
        header = seal(header, view)
    if keyed is not None:
        header = keyed.sign(header, view)
    return encode_header(header)


def _bulk(arg: bytes | str | int) -> bytes:
    raw = arg if isinstance(arg, bytes) else str(arg).encode()
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


def _command(*args: bytes | str | int) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


class _Sealer:
    """Seals the values of one stream from two ends: the helper thread runs `run` (seal the next
    unclaimed value, repeat) while the sender asks `get(k)` for each value it is about to send.

    The sender never waits for the helper: a value the helper has not finished when the sender
    needs it (not claimed yet, or claimed by a helper the OS has not run since, or still being
    sealed) is sealed by the sender itself, and the helper's copy of it, if it ever finishes, is
    dropped. A seal is a pure function of the caller's header and bytes (a fresh salt and time
    aside), so either copy is that value's header. A helper that is behind (descheduled while
    the server and the sender hold the cores) costs the sender at most one seal a value, never a
    sleep."""

    def __init__(self, headers: Sequence[ChunkHeader], views: Sequence[memoryview],
                 keyed: Keyed | None) -> None:
        self.headers, self.views, self.keyed = headers, views, keyed
        n = len(headers)
        self.out: list[bytes | None] = [None] * n
        self.errors: list[BaseException | None] = [None] * n
        # value k is sealed once its lock is released; plain locks, held from the start: an Event
        # a value cost ~2 us to make (a Condition around a lock), a lock ~0.1 us
        self._done = [threading.Lock() for _ in range(n)]
        for lock in self._done:
            lock.acquire()
        self._lock = threading.Lock()
        self._next = 0  # the first value nobody has claimed
        self.stop = False

    def run(self) -> None:
        while True:
            with self._lock:
                if self.stop or self._next >= len(self.out):
                    return
                k = self._next
                self._next = k + 1
            try:
                self.out[k] = seal_value(self.headers[k], self.views[k], self.keyed)
            except BaseException as exc:  # handed to the sender, which raises it
                self.errors[k] = exc
            finally:
                self._done[k].release()

    def get(self, k: int) -> bytes:
        """Value k's sealed header: the helper's where it is done, else sealed here and now."""
        if self._done[k].acquire(blocking=False):
            err = self.errors[k]
            if err is not None:
                raise err
            out = self.out[k]
            assert out is not None
            return out
        with self._lock:
            self._next = max(self._next, k + 1)  # the helper skips what the sender does
        return seal_value(self.headers[k], self.views[k], self.keyed)

    def halt(self) -> None:
        """Claim every value left: the helper seals no more (it may finish the one it is on)."""
        with self._lock:
            self.stop = True


def plain_socket(conn: object) -> socket.socket | None:
    """The connection's socket where `sendmsg` can write it (a plain TCP or Unix socket, or the
    `DeadlineSocket` around one; not TLS, whose SSLSocket has no sendmsg), else None (then
    redis-py's send_packed_command)."""
    sock = socket_of(conn)
    raw = getattr(sock, "raw", sock)
    return sock if isinstance(raw, socket.socket) and not isinstance(raw, ssl.SSLSocket) else None  # type: ignore[return-value]


def send_all(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Write every byte of `parts`, in order, with one `sendmsg` (a gather write) per pass: a value's
    RESP head and its payload leave in one system call (redis-py's send_packed_command makes one
    `sendall` per part). A short write goes on from where it stopped; every pass ends by the
    call's deadline (`redis_conn.DeadlineSocket`), so a server that reads slowly cannot stretch
    a save pass by pass."""
    bufs = [memoryview(p).cast("B") for p in parts]  # lengths in bytes, whatever the item size
    while bufs:
        sent = sock.sendmsg(bufs)
        while sent and bufs:
            if sent >= len(bufs[0]):
                sent -= len(bufs.pop(0))
            else:
                bufs[0] = bufs[0][sent:]
                sent = 0
        while bufs and not len(bufs[0]):
            bufs.pop(0)


def get_connection(pool: object) -> object:
    try:
        return pool.get_connection()  # type: ignore[attr-defined]  # redis-py >= 5.3
    except TypeError:  # redis-py < 5.3 wants a command name
        return pool.get_connection("SET")  # type: ignore[attr-defined]


def set_stream(client: object, keys: Sequence[str], headers: Sequence[ChunkHeader],
               views: Sequence[memoryview], keyed: Keyed | None, ttl_ms: int | None,
               extra: Sequence[tuple[bytes | str | int, ...]], helper: Callable[[], Executor] | None,
               ) -> list[object]:
    """SET keys[k] = header k (sealed here) + views[k] on one connection of `client`'s pool, then
    the `extra` commands (the write budget's INCRBY/PEXPIRE); one reply per command, an error
    reply as its ResponseError. Raises what the connection raises (the caller's breaker decides);
    the connection is then dropped. `helper` gives the executor that seals ahead (None: seal on
    this thread)."""
    n = len(keys)
    sealer: _Sealer | None = None
    fut = None
    if (helper is not None and n >= OVERLAP_MIN_VALUES and sum(len(v) for v in views) >= OVERLAP_MIN_BYTES
            and (keyed is None or keyed.kind != MAC_GMAC)):  # an AES-GMAC seal runs inline (module docstring)
        sealer = _Sealer(headers, views, keyed)
        try:
            fut = helper().submit(sealer.run)
        except RuntimeError:  # the executor shut down under us (tier closing): seal here
            fut = None
    px = b"" if ttl_ms is None else _bulk(b"PX") + _bulk(ttl_ms)
    nargs = b"*3\r\n" if ttl_ms is None else b"*5\r\n"
    pool = client.connection_pool  # type: ignore[attr-defined]
    try:
        conn = get_connection(pool)
        try:
            tail = b""  # what ends the previous command, sent with the next one's head
            sock = None  # after the first send (which connects and checks health): one sendmsg a value
            for k in range(n):
                header = sealer.get(k) if sealer is not None else seal_value(headers[k], views[k], keyed)
                key = keys[k].encode()
                head = b"".join((tail, nargs, b"$3\r\nSET\r\n", _bulk(key),
                                 b"$%d\r\n" % (len(header) + len(views[k])), header))
                if sock is not None:
                    send_all(sock, [head, views[k]])
                else:
                    conn.send_packed_command([head, views[k]], check_health=k == 0)  # type: ignore[attr-defined]
                    sock = plain_socket(conn)
                tail = CRLF + px
            conn.send_packed_command([tail] + [_command(*c) for c in extra],  # type: ignore[attr-defined]
                                     check_health=n == 0)
            replies = _replies(conn, n + len(extra))
        except BaseException:
            conn.disconnect()  # type: ignore[attr-defined]  # never hand a half-sent stream to the pool
            raise
        finally:
            pool.release(conn)  # type: ignore[attr-defined]
    finally:
        if sealer is not None:
            sealer.halt()  # claims nothing more
        if fut is not None and not fut.cancel():  # not started yet: it never will
            fut.result()  # never return while the helper may still read the caller's buffers
    return [True if r in (b"OK", "OK", True) else r for r in replies]


def _replies(conn: object, count: int) -> list[object]:
    """The next `count` replies on `conn`, none a value (SET, INCRBY, PEXPIRE: `+OK`, integers,
    errors), an error reply as its ResponseError: read off the socket (`redis_reader`, whose
    caps hold), else through redis-py's parser."""
    from redis.exceptions import ResponseError

    sock = socket_of(conn)
    if sock is not None:
        reader = ReplyReader(sock)
        replies = [read_reply(reader, None) for _ in range(count)]
        reader.done()
        return replies
    replies = []
    for _ in range(count):
        try:
            replies.append(conn.read_response())  # type: ignore[attr-defined]
        except ResponseError as exc:  # this command's error (OOM, ...): a value, not a raise
            replies.append(exc)
    return replies


def get_stream(client: object, commands: Sequence[tuple[bytes | str | int, ...]], n: int,
               direct: Callable[[int, ReplyReader, int], Streamed],
               check: Callable[[int, bytes], None]) -> list[object]:
    """Send `commands` (the GET or GETEX of n keys, maybe followed by PEXPIREs) on one connection
    of `client`'s pool and read every reply in order. Off the connection's socket
    (`redis_reader`): value k goes to `direct(k, reader, length)`, which lands and checks it in
    the caller's buffer and returns its `Streamed` verdict. Where redis-py keeps no plain socket,
    through its parser: value k arrives as bytes and goes to `check(k, raw)`. Returns every
    reply, an error reply as its ResponseError; raises what the connection raises, after
    dropping it."""
    from redis.exceptions import ResponseError

    pool = client.connection_pool  # type: ignore[attr-defined]
    replies: list[object] = []
    conn = get_connection(pool)
    try:
        conn.send_packed_command([b"".join(_command(*c) for c in commands)])  # type: ignore[attr-defined]
        sock = socket_of(conn)
        if sock is not None:
            reader = ReplyReader(sock)
            for i in range(len(commands)):
                value = (lambda r, length, i=i: direct(i, r, length)) if i < n else None
                replies.append(read_reply(reader, value))
            reader.done()
            return replies
        for i in range(len(commands)):
            try:
                r = conn.read_response()  # type: ignore[attr-defined]
            except ResponseError as exc:  # this key's error (WRONGTYPE, ...): a value
                r = exc
            replies.append(r)
            if i < n and isinstance(r, bytes):
                check(i, r)
    except BaseException:
        conn.disconnect()  # type: ignore[attr-defined]  # never hand back a half-read stream
        raise
    finally:
        pool.release(conn)  # type: ignore[attr-defined]
    return replies
