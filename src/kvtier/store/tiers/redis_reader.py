"""The redis tier's load stream read straight off the socket: each value's payload lands in the
caller's buffer with one kernel copy, checked (MAC with a secret, else checksum) piece by piece
as it lands.

Why. redis-py's reply parser (the pure-Python one; hiredis is an optional C build) reads a reply
into its own buffer, then slices it out as a new `bytes`, and kvtier copied that into the
caller's buffer: three copies of every byte, two of them in Python's allocator, and the parser
dominated a load's time. Here the RESP reply
header (`$<length>\\r\\n`) and the chunk header are read into small buffers and the payload with
`recv_into` on slices of the caller's buffer. The stream (`redis_wire.get_stream`) sends every
command first and then reads every reply here, in order: values, nils, integers (PEXPIRE),
simple strings and errors; any other reply type is a protocol error, and the connection is
dropped, never handed back half-read.

Same verdicts as `redis_codec.restore` (the path of Redis Cluster and of a redis-py whose
connection has no plain socket): a bad or foreign chunk header, a length that is not the
header's, a checksum or MAC that fails. A value whose header is not the expected chunk's is
read past, unread. The caller's buffer holds unspecified bytes whenever the verdict is not None.

Lengths come from the server, so none sizes anything unchecked: a reply that is not a value (an
error, a status, an integer, a bulk string answering a PEXPIRE) is at most REPLY_MAX bytes, and a
value at most the chunk it was asked for (header + payload: the slot it lands in); past that, a
`ProtocolError` before its body is read (a value: `OversizedValue`). No array, map or set is a
reply to GET, GETEX or PEXPIRE, so any count is a protocol error before an element is read.

Rules this module keeps: it reads exactly the bytes of the replies it was asked for (the
connection goes back to the pool with nothing buffered here: leftovers are a protocol error), and
it needs the socket redis-py connected (`socket_of`; TLS sockets included, their `recv_into`
decrypts). That socket ends every receive by the call's deadline (`redis_conn.DeadlineSocket`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.store.integrity import NO_SECRET_FOR_MAC, Keyed
from kvtier.store.payload import (HEADER_BYTES, ChunkHeader, Rejected, StreamingChecksum, decode_header,
                                  mismatch, unverifiable, verify)

# the longest reply that is not a value (a line, a blob error, a bulk string answering PEXPIRE):
# Redis's own errors are under 1 KiB; longer is a protocol error, never an allocation
REPLY_MAX = 64 << 10
OK = b"+OK\r\n"  # the reply to a SET (`ReplyReader.oks`)
RECV_PIECE = 256 << 10  # at most this much per recv_into: the check reads it while it is in L2


class ProtocolError(ConnectionError):
    """The server sent what no command of this stream gets back (a type, a length, a missing CRLF):
    the stream is out of step, so its connection is dropped (a ConnectionError: every caller
    that drops a failed connection drops this one)."""


class OversizedValue(ProtocolError):
    """A value longer than the chunk it was asked for: not read, not even past (that would cost
    its whole length), so the stream stops there and its connection is dropped."""


class Streamed:
    """The reply of a value this reader already checked and copied: `why` is None when the
    caller's buffer holds the payload, else why it must not be used (`restore`'s reasons)."""

    __slots__ = ("why",)

    def __init__(self, why: str | None) -> None:
        self.why = why


def socket_of(conn: object) -> object | None:
    """The connected socket of a redis-py connection, or None where this redis-py keeps it
    elsewhere (then the caller uses the parser). redis-py has kept it in `_sock` since 2.x."""
    sock = getattr(conn, "_sock", None)
    return sock if sock is not None and hasattr(sock, "recv_into") else None


class ReplyReader:
    """RESP replies read off `sock` with no read-ahead past the last reply asked for: a line is
    read in small `recv_into`s and what follows it stays in `_pending` until asked for."""

    def __init__(self, sock: object) -> None:
        self._sock = sock
        self._buf = bytearray(4096)
        self._pending = memoryview(b"")  # received, not yet consumed

    def _fill(self) -> None:
        n = self._sock.recv_into(self._buf)  # type: ignore[attr-defined]
        if not n:
            raise ConnectionError("redis closed the connection in the middle of a reply")
        self._pending = memoryview(self._buf)[:n]

    def line(self) -> bytes:
        """One reply line, without its CRLF."""
        out = bytearray()
        while True:
            if not self._pending:
                self._fill()
            i = bytes(self._pending).find(b"\n")
            if i >= 0:
                out += self._pending[:i + 1]
                self._pending = self._pending[i + 1:]
                if out[-2:] != b"\r\n":
                    raise ProtocolError("redis reply line not ended by CRLF: the stream is out of step")
                return bytes(out[:-2])
            out += self._pending
            self._pending = memoryview(b"")
            if len(out) > REPLY_MAX:
                raise ProtocolError(f"redis reply line over {REPLY_MAX} bytes: not a reply this stream sent for")

    def oks(self, count: int) -> int:
        """Consume the `+OK` replies at the front, at most `count`; how many. A save's replies are
        nearly all `+OK`, compared here a block at a time (read_reply took ~3 us each, 5% of a
        save); anything else, or a reply cut between two receives, is left for `read_reply`."""
        got = 0
        while got < count:
            if not self._pending:
                self._fill()
            m = min(count - got, len(self._pending) // len(OK))
            block = self._pending[:m * len(OK)]
            if block != OK * m:  # some other reply in this block: count the +OKs before it
                m = 0
                while block[m * len(OK):(m + 1) * len(OK)] == OK:
                    m += 1
            self._pending = self._pending[m * len(OK):]
            got += m
            if self._pending or not m:  # another reply, or part of one: read_reply's
                return got
        return got

    def into(self, dst: memoryview, on_piece: Callable[[memoryview], None] | None = None) -> None:
        """Fill `dst` exactly, from what is pending, then straight from the socket; `on_piece`
        sees each piece right after it lands."""
        got, n = 0, len(dst)
        if self._pending:
            k = min(n, len(self._pending))
            dst[:k] = self._pending[:k]
            self._pending = self._pending[k:]
            if on_piece is not None and k:
                on_piece(dst[:k])
            got = k
        while got < n:
            k = self._sock.recv_into(dst[got:min(n, got + RECV_PIECE)])  # type: ignore[attr-defined]
            if not k:
                raise ConnectionError("redis closed the connection in the middle of a value")
            if on_piece is not None:
                on_piece(dst[got:got + k])
            got += k

    def skip(self, n: int, on_piece: Callable[[memoryview], None] | None = None) -> None:
        """Read past `n` bytes (through a scratch buffer, never the caller's)."""
        scratch = memoryview(bytearray(min(n, RECV_PIECE))) if n else memoryview(b"")
        while n:
            k = min(n, len(scratch))
            self.into(scratch[:k], on_piece)
            n -= k

    def crlf(self) -> None:
        end = bytearray(2)
        self.into(memoryview(end))
        if end != b"\r\n":
            raise ProtocolError("redis bulk reply not ended by CRLF: the stream is out of step")

    def done(self) -> None:
        """After the last reply: nothing may be left over (the connection goes back clean)."""
        if self._pending:
            raise ProtocolError(f"{len(self._pending)} unexpected bytes after the last redis reply")


def _integer(rest: bytes, what: str) -> int:
    """A RESP integer or length: ASCII digits after an optional `-`, at most 19 of them (int()
    would also take spaces, `+` and `_`)."""
    digits = rest[1:] if rest[:1] == b"-" else rest
    if not digits.isdigit() or len(digits) > 19:
        raise ProtocolError(f"redis {what} {rest[:40]!r} is not an integer: the stream is out of step")
    return int(rest)


def read_reply(r: ReplyReader, value: Callable[[ReplyReader, int], Streamed] | None) -> object:
    """One reply: a bulk string goes to `value(reader, length)` when given (it consumes exactly
    `length` bytes, or raises before reading any; its CRLF is read here), else returns as bytes;
    nil -> None; an integer -> int; a simple string -> str; an error -> a redis ResponseError (a
    value, not a raise). Anything else, or a reply that is not a value over REPLY_MAX bytes: a
    ProtocolError, raised before the reply's body is read."""
    from redis.exceptions import ResponseError

    line = r.line()
    kind, rest = line[:1], line[1:]
    if kind in (b"$", b"!"):
        n = _integer(rest, "length")
        if n < 0:
            if n == -1 and kind == b"$":
                return None  # RESP2 nil
            raise ProtocolError(f"redis length {n} where a length or $-1 (nil) was expected")
        if kind == b"$" and value is not None:
            got: object = value(r, n)  # bounded by the chunk it reads (`read_value`)
        elif n <= REPLY_MAX:
            buf = bytearray(n)
            r.into(memoryview(buf))
            got = bytes(buf) if kind == b"$" else ResponseError(buf.decode(errors="replace"))
        else:
            what = "a blob error" if kind == b"!" else "a bulk string for a command that gets no value"
            raise ProtocolError(f"redis sent {what} of {n} bytes; a reply that is not a value is "
                                f"at most {REPLY_MAX}: not a reply this stream sent for")
        r.crlf()
        return got
    if kind == b"_":
        return None  # RESP3 null
    if kind == b":":
        return _integer(rest, "integer")
    if kind == b"+":
        return rest.decode(errors="replace")
    if kind == b"-":
        return ResponseError(rest.decode(errors="replace"))
    if kind == b"#":
        return rest == b"t"
    raise ProtocolError(f"redis reply type {kind!r} where a value, nil, integer or error was expected")


def read_value(r: ReplyReader, length: int, expected: ChunkHeader, dst: memoryview,
               keyed: Keyed | None) -> Streamed:
    """Read one value of `length` bytes (chunk header + payload) into `dst`, checked as
    `redis_codec.restore` checks it (see there for the order and the reasons). A value longer
    than `expected`'s chunk is an OversizedValue, raised before a byte of it is read: it could
    never be restored, and reading past it would cost whatever length the server named."""
    slot = HEADER_BYTES + expected.payload_bytes
    if length > slot:
        raise OversizedValue(f"redis value of {length} bytes under the key of a chunk of {slot} "
                             "(header + payload): not read; its connection is dropped")
    if length < HEADER_BYTES:
        head = bytearray(length)
        r.into(memoryview(head))
        got = decode_header(head)
        return Streamed(got.reason if isinstance(got, Rejected) else "value shorter than a header")
    head = bytearray(HEADER_BYTES)
    r.into(memoryview(head))
    rest = length - HEADER_BYTES
    stored = decode_header(head)
    if isinstance(stored, Rejected):
        r.skip(rest)
        return Streamed(stored.reason)
    why = mismatch(stored, expected)
    n = stored.payload_bytes
    if why is None and rest != n:
        why = f"payload truncated: {rest} of {n} bytes"
    if why is not None:
        r.skip(rest)
        return Streamed(why)
    out = dst[:n]
    if keyed is not None and keyed.unverifiable(stored) is None:
        mac = keyed.stream(stored)  # the MAC alone: it covers header and bytes (integrity)
        r.into(out, mac.update)
        why = mac.verdict()
        # only a failed MAC needs the checksum: intact and another tenant's (kept) or broken
        return Streamed(None if why is None else verify(stored, out) or why)
    if keyed is None and not stored.mac:
        why = unverifiable(stored)
        if why is not None:
            r.skip(rest)
            return Streamed(why)
        summer = StreamingChecksum(stored.checksum_kind)
        r.into(out, summer.update)
        return Streamed(None if summer.value() == stored.checksum else "payload checksum mismatch")
    # never restored (a keyed reader of an unMACed value, an unkeyed reader of a MACed one): read
    # past it, never into the caller's buffer; the checksum only decides whether it is broken
    # (dropped) or some other writer's (kept)
    why = unverifiable(stored)
    if why is None:
        summer = StreamingChecksum(stored.checksum_kind)
        r.skip(rest, summer.update)
        why = None if summer.value() == stored.checksum else "payload checksum mismatch"
    else:
        r.skip(rest)
    return Streamed(why or (keyed.unverifiable(stored) if keyed is not None else NO_SECRET_FOR_MAC))
