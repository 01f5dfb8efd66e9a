"""The redis tier's save stream: SETs written straight to one connection, zero-copy, each value
sealed (checksum, MAC) on a helper thread while the one before it is on the wire.

A value is kvtier's 128-byte header followed by the payload (`redis_codec`). redis-py sends one
argument as one buffer, so a SET through it needs header and payload side by side in memory: a
copy of every payload into an arena before the batch could start (the `Arena` path, kept for
Redis Cluster, whose pipeline routes each key to its node and follows MOVED/ASK). Here the RESP
of each SET is written by hand, `$<length>\\r\\n` + header + the caller's payload buffer +
`\\r\\n`, as separate `sendall`s on one connection of the client's pool: the server sees one bulk
string, so one SET stays atomic for every reader, and the payload goes from the caller's tensor
to the socket without a copy in this process.

Overlap. A value's header (its checksum, and its MAC with a secret) must be on the wire before
its payload, so it is computed before the value is sent; on the caller's thread that would keep
the server waiting for it, value after value (measured on the 2-core build machine: the arena
copy and the checksum were a third of a save's time, the MAC as much again; the server, not the
client, bounds the send, so the client's core idles while a value is on the wire). A helper
thread seals value k+1 while this thread sends value k (xxh3 and BLAKE3 release the GIL). This
thread never returns while the helper can still read the caller's buffers.

Rejected: waves of smaller redis-py pipelines, sealed one wave ahead: every wave waits for its
replies before the next is sent, and 4 waves of a 16 MiB batch cost 9% of the send (measured);
`MULTI; SET header; APPEND payload; EXEC` (atomic and copy-free here, but the server copies the
payload again in APPEND, and the server's core is the one that bounds a save).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from kvtier.store.integrity import Keyed
from kvtier.store.payload import CHECKSUM_NONE, ChunkHeader, encode_header, seal

CRLF = b"\r\n"
# a batch of fewer values (or fewer bytes) is sealed on the caller's thread: waking the helper
# costs more than it would save
OVERLAP_MIN_VALUES = 2
OVERLAP_MIN_BYTES = 256 << 10


def seal_value(header: ChunkHeader, view: memoryview, keyed: Keyed | None) -> tuple[ChunkHeader, bytes]:
    """The sealed header of one value (checksum if the header has none yet; MAC with a secret)
    and its 128 encoded bytes."""
    if header.checksum_kind == CHECKSUM_NONE:
        header = seal(header, view)
    if keyed is not None:
        header = keyed.sign(header, view)
    return header, encode_header(header)


def _bulk(arg: bytes | str | int) -> bytes:
    raw = arg if isinstance(arg, bytes) else str(arg).encode()
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


def _command(*args: bytes | str | int) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


class _Sealer:
    """Seals the values of one stream in order (on the helper thread); the sender waits for
    value k with `wait(k)`."""

    def __init__(self, headers: Sequence[ChunkHeader], views: Sequence[memoryview],
                 keyed: Keyed | None) -> None:
        self.headers, self.views, self.keyed = headers, views, keyed
        self.out: list[bytes] = []
        self.error: BaseException | None = None
        self.stop = False
        self._ready = threading.Semaphore(0)

    def run(self) -> None:
        try:
            for h, v in zip(self.headers, self.views):
                if self.stop:
                    return
                self.out.append(seal_value(h, v, self.keyed)[1])
                self._ready.release()
        except BaseException as exc:  # handed to the sender, which raises it
            self.error = exc
        finally:
            self._ready.release(len(self.headers) + 1)  # nobody waits for ever

    def wait(self, k: int) -> bytes:
        self._ready.acquire()
        if k >= len(self.out):
            raise self.error or RuntimeError("the sealing thread stopped early")
        return self.out[k]


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
    from redis.exceptions import ResponseError

    sealer = _Sealer(headers, views, keyed)
    n = len(keys)
    fut = None
    if helper is not None and n >= OVERLAP_MIN_VALUES and sum(len(v) for v in views) >= OVERLAP_MIN_BYTES:
        try:
            fut = helper().submit(sealer.run)
        except RuntimeError:  # the executor shut down under us (tier closing): seal here
            fut = None
    if fut is None:
        sealer.run()
    px = b"" if ttl_ms is None else _bulk(b"PX") + _bulk(ttl_ms)
    nargs = b"*3\r\n" if ttl_ms is None else b"*5\r\n"
    pool = client.connection_pool  # type: ignore[attr-defined]
    try:
        conn = get_connection(pool)
        try:
            tail = b""  # what ends the previous command, sent with the next one's head
            for k in range(n):
                header = sealer.wait(k)
                key = keys[k].encode()
                head = b"".join((tail, nargs, b"$3\r\nSET\r\n", _bulk(key),
                                 b"$%d\r\n" % (len(header) + len(views[k])), header))
                conn.send_packed_command([head, views[k]], check_health=k == 0)  # type: ignore[attr-defined]
                tail = CRLF + px
            conn.send_packed_command([tail] + [_command(*c) for c in extra],  # type: ignore[attr-defined]
                                     check_health=n == 0)
            replies: list[object] = []
            for _ in range(n + len(extra)):
                try:
                    replies.append(conn.read_response())  # type: ignore[attr-defined]
                except ResponseError as exc:  # this command's error (OOM, ...): a value, not a raise
                    replies.append(exc)
        except BaseException:
            conn.disconnect()  # type: ignore[attr-defined]  # never hand a half-sent stream to the pool
            raise
        finally:
            pool.release(conn)  # type: ignore[attr-defined]
    finally:
        sealer.stop = True
        if fut is not None:
            fut.result()  # never return while the helper may still read the caller's buffers
    return [True if r in (b"OK", "OK", True) else r for r in replies]
