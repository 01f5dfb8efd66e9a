"""The redis tier's save stream: SETs written straight to one connection, zero-copy, each value
sealed (checksum, MAC) on the sender just before it is sent.

A value is kvtier's 128-byte header followed by the payload (`redis_codec`). redis-py sends one
argument as one buffer, so a SET through it needs header and payload side by side in memory: a
copy of every payload into an arena before the batch could start (the `Arena` path, kept for
Redis Cluster, whose pipeline routes each key to its node and follows MOVED/ASK). Here the RESP
of each SET is written by hand, `$<length>\\r\\n` + header + the caller's payload buffer +
`\\r\\n`, in one gather write (`sendmsg`, `send_all`) on one connection of the client's pool:
the server sees one bulk string, so one SET stays atomic for every reader, and the payload goes
from the caller's tensor to the socket without a copy in this process.

One thread, no helper. A value's header (its checksum, and its MAC with a secret) must be on the
wire before its payload, so the sender seals value k, then sends it: the seal reads the payload
into this core's L2 and the kernel's copy into the socket then reads it from there. On loopback
the sender's core is busy for the whole send (the kernel's copy and both ends of TCP run there:
measured, its CPU time equals the wall time) and the server's core nearly so, so a helper
thread sealing ahead found no idle core to use; it was also fast only while both cores were warm
(a wake-up a value). Measured in one process (issue 41): inline 0.91 of raw redis-py, the helper
0.81 (docs/redis.md, "Benchmark"). Loads (`get_stream`) read the replies off the socket straight
into the caller's buffers, checked as they land (`redis_reader`). Both streams run inside the
tier's call deadline: each sendmsg and receive of theirs ends by it (`redis_conn.DeadlineSocket`).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Sequence

from kvtier.store.integrity import Keyed
from kvtier.store.payload import (CHECKSUM_NONE, CHECKSUM_XXH3, DEFAULT_CHECKSUM, ChunkHeader, as_bytes_view,
                                  checksum, encode_header, encode_sealed, seal)
from kvtier.store.tiers.redis_reader import ReplyReader, Streamed, read_reply, socket_of

CRLF = b"\r\n"


def seal_value(header: ChunkHeader, view: memoryview, keyed: Keyed | None) -> bytes:
    """The 128 encoded bytes of one value's sealed header (checksum if the header has none yet;
    MAC with a secret: `Keyed.seal` builds the header once where it can). An unkeyed xxh3 seal
    packs its bytes in one go (`encode_sealed`): no ChunkHeader is built and encoded a value."""
    if keyed is None:
        if (header.checksum_kind == CHECKSUM_NONE and DEFAULT_CHECKSUM == CHECKSUM_XXH3
                and as_bytes_view(view).nbytes == header.payload_bytes):
            return encode_sealed(header, checksum(view, CHECKSUM_XXH3), time.time_ns())
    elif (raw := keyed.seal(header, view)) is not None:
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


def plain_socket(conn: object) -> socket.socket | None:
    """The connection's socket where `sendmsg` can write it (a plain TCP or Unix socket, or the
    `DeadlineSocket` around one; not TLS, whose SSLSocket has no sendmsg), else None (then
    redis-py's send_packed_command)."""
    sock = socket_of(conn)
    raw = getattr(sock, "raw", sock)
    return sock if isinstance(raw, socket.socket) and not isinstance(raw, ssl.SSLSocket) else None  # type: ignore[return-value]


def send_all(sock: socket.socket, parts: list[bytes | memoryview], nbytes: int | None = None) -> None:
    """Write every byte of `parts`, in order, with one `sendmsg` (a gather write) per pass: a value's
    RESP head and its payload leave in one system call (redis-py's send_packed_command makes one
    `sendall` per part). A short write goes on from where it stopped; every pass ends by the
    call's deadline (`redis_conn.DeadlineSocket`), so a server that reads slowly cannot stretch
    a save pass by pass. `nbytes` (the parts' total in bytes, when the caller knows it) lets a
    write that fits in one pass skip building byte views of the parts (~2 us a value)."""
    sent = sock.sendmsg(parts) if nbytes is not None else 0
    if sent == nbytes:
        return
    bufs = [memoryview(p).cast("B") for p in parts]  # lengths in bytes, whatever the item size
    while bufs:
        while sent and bufs:
            if sent >= len(bufs[0]):
                sent -= len(bufs.pop(0))
            else:
                bufs[0] = bufs[0][sent:]
                sent = 0
        while bufs and not len(bufs[0]):
            bufs.pop(0)
        if bufs:
            sent = sock.sendmsg(bufs)


def get_connection(pool: object) -> object:
    try:
        return pool.get_connection()  # type: ignore[attr-defined]  # redis-py >= 5.3
    except TypeError:  # redis-py < 5.3 wants a command name
        return pool.get_connection("SET")  # type: ignore[attr-defined]


def set_stream(client: object, keys: Sequence[str], headers: Sequence[ChunkHeader],
               views: Sequence[memoryview], keyed: Keyed | None, ttl_ms: int | None,
               extra: Sequence[tuple[bytes | str | int, ...]],
               seal: Callable[[ChunkHeader, memoryview, Keyed | None], bytes] | None = None) -> list[object]:
    """SET keys[k] = header k (sealed here, just before value k is sent) + views[k] on one
    connection of `client`'s pool, then the `extra` commands (the write budget's INCRBY/PEXPIRE);
    one reply per command, an error reply as its ResponseError. Raises what the connection
    raises (the caller's breaker decides); the connection is then dropped. `seal` replaces
    `seal_value` (the bench's wire floor: a fixed header, no pass over the bytes)."""
    n = len(keys)
    seal = seal or seal_value
    px = b"" if ttl_ms is None else _bulk(b"PX") + _bulk(ttl_ms)
    nargs = b"*3\r\n" if ttl_ms is None else b"*5\r\n"
    pool = client.connection_pool  # type: ignore[attr-defined]
    conn = get_connection(pool)
    try:
        tail = b""  # what ends the previous command, sent with the next one's head
        sock = None  # after the first send (which connects and checks health): one sendmsg a value
        set_ = nargs + b"$3\r\nSET\r\n"
        for k in range(n):
            header, view = seal(headers[k], views[k], keyed), views[k]
            key = keys[k].encode()
            size = view.nbytes if isinstance(view, memoryview) else len(view)
            head = b"%s%s$%d\r\n%s\r\n$%d\r\n%s" % (tail, set_, len(key), key, len(header) + size, header)
            if sock is not None:
                send_all(sock, [head, view], len(head) + size)
            else:
                conn.send_packed_command([head, view], check_health=k == 0)  # type: ignore[attr-defined]
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
    return [True if r in (b"OK", "OK", True) else r for r in replies]


def _replies(conn: object, count: int) -> list[object]:
    """The next `count` replies on `conn`, none a value (SET, INCRBY, PEXPIRE: `+OK`, integers,
    errors), an error reply as its ResponseError: read off the socket (`redis_reader`, whose
    caps hold), else through redis-py's parser."""
    from redis.exceptions import ResponseError

    sock = socket_of(conn)
    replies: list[object] = []
    if sock is not None:
        reader = ReplyReader(sock)
        while len(replies) < count:
            replies += [True] * reader.oks(count - len(replies))
            if len(replies) < count:
                replies.append(read_reply(reader, None))
        reader.done()
        return replies
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
