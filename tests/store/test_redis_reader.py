"""`redis_reader`: RESP replies read off a real socket (a socketpair; the server side is written
here byte for byte), values landed and checked in the caller's buffer. What it must keep: every
reply type a load stream can get parsed in step, however the bytes are split across receives; a
value it will not restore is read past exactly (the next reply still parses) and never written
into the caller's buffer unless it was checked there; nothing read past the last reply."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from kvtier.store import integrity as I
from kvtier.store import payload as P
from kvtier.store.tiers.redis_reader import ReplyReader, Streamed, read_reply, read_value

pytest.importorskip("redis")
from redis.exceptions import ResponseError  # noqa: E402

NS = "0123456789abcdef"
N = 300_000


def _value(data: bytes, keyed: I.Keyed | None = None, i: int = 1) -> tuple[P.ChunkHeader, bytes]:
    h = P.make_header(NS, bytes([i]) * 32, 0, 0, 128, len(data))
    sealed = P.seal(h, data)
    if keyed is not None:
        sealed = keyed.sign(sealed, data)
    return h, P.encode_header(sealed) + data


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _serve(wire: bytes, piece: int) -> tuple[socket.socket, threading.Thread]:
    a, b = socket.socketpair()
    a.settimeout(10)

    def send() -> None:
        for k in range(0, len(wire), piece):
            b.sendall(wire[k:k + piece])
        b.close()

    t = threading.Thread(target=send)
    t.start()
    return a, t


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
def test_every_reply_type_parses_in_step_however_the_bytes_arrive(piece: int) -> None:
    data = os.urandom(N) if piece > 1 else os.urandom(5000)
    expected, raw = _value(data)
    wire = (_bulk(raw) + b"$-1\r\n" + b"_\r\n" + b":1\r\n" + b"-WRONGTYPE no\r\n" + b"!5\r\nhello\r\n"
            + b"+OK\r\n" + _bulk(b"plain"))
    sock, t = _serve(wire, piece)
    r = ReplyReader(sock)
    dst = memoryview(bytearray(len(data)))
    got = read_reply(r, lambda rr, n: read_value(rr, n, expected, dst, None))
    assert isinstance(got, Streamed) and got.why is None and bytes(dst) == data
    assert read_reply(r, None) is None and read_reply(r, None) is None
    assert read_reply(r, None) == 1
    e = read_reply(r, None)
    assert isinstance(e, ResponseError) and str(e) == "WRONGTYPE no"
    e = read_reply(r, None)
    assert isinstance(e, ResponseError) and str(e) == "hello"
    assert read_reply(r, None) == "OK" and read_reply(r, None) == b"plain"
    r.done()
    t.join()
    sock.close()


def _stream(values: list[bytes], piece: int = 65536) -> tuple[ReplyReader, socket.socket, threading.Thread]:
    sock, t = _serve(b"".join(_bulk(v) for v in values), piece)
    return ReplyReader(sock), sock, t


def test_a_value_not_restored_is_read_past_exactly_and_never_lands_in_the_buffer() -> None:
    keyed = I.Keyed(b"k" * 32)
    good = os.urandom(N)
    want, good_raw = _value(good, keyed, i=1)
    _, other_chunk = _value(os.urandom(N), keyed, i=2)  # another chunk's header
    broken = bytearray(good_raw)
    broken[P.HEADER_BYTES + 1000] ^= 1
    _, unkeyed = _value(b"\x66" * N, None, i=1)  # a forger without the secret (no MAC)
    short = good_raw[:60]
    truncated = good_raw[:-10]
    r, sock, t = _stream([other_chunk, bytes(broken), unkeyed, short, truncated, good_raw])
    reasons = []
    for k in range(5):
        dst = memoryview(bytearray(b"\x00" * N))
        got = read_reply(r, lambda rr, n: read_value(rr, n, want, dst, keyed))
        reasons.append(got.why)
        if k != 1:  # value 1 is MACed: checked where it landed (then its checksum says broken)
            assert not any(dst), got.why  # read past, not into the caller's buffer
    assert reasons[0] == "another chunk's hash"
    assert reasons[1] == "payload checksum mismatch" and not I.mac_only(reasons[1])  # dropped
    assert reasons[2] == I.NO_MAC and I.mac_only(reasons[2])
    assert reasons[3].startswith("header truncated")
    assert reasons[4] == f"payload truncated: {N - 10} of {N} bytes"
    dst = memoryview(bytearray(N))
    got = read_reply(r, lambda rr, n: read_value(rr, n, want, dst, keyed))
    assert got.why is None and bytes(dst) == good  # still in step after all of them
    r.done()
    t.join()
    sock.close()


def test_a_broken_payload_without_a_secret_is_a_checksum_mismatch() -> None:
    data = os.urandom(N)
    want, raw = _value(data)
    bad = bytearray(raw)
    bad[-1] ^= 0x80
    r, sock, t = _stream([bytes(bad)])
    got = read_reply(r, lambda rr, n: read_value(rr, n, want, memoryview(bytearray(N)), None))
    assert got.why == "payload checksum mismatch"
    r.done()
    t.join()
    sock.close()


def test_a_reply_type_a_load_never_gets_is_a_protocol_error() -> None:
    sock, t = _serve(b"*1\r\n$1\r\na\r\n", 4096)
    with pytest.raises(ConnectionError, match="reply type"):
        read_reply(ReplyReader(sock), None)
    t.join()
    sock.close()


def test_bytes_after_the_last_reply_are_never_left_for_the_next_caller() -> None:
    sock, t = _serve(b":1\r\n:2\r\n", 4096)
    t.join()  # both replies are there to be read in one receive
    r = ReplyReader(sock)
    assert read_reply(r, None) == 1
    with pytest.raises(ConnectionError, match="unexpected bytes"):
        r.done()
    sock.close()


def test_a_connection_closed_mid_value_raises_rather_than_returning_a_short_value() -> None:
    data = os.urandom(N)
    want, raw = _value(data)
    sock, t = _serve(_bulk(raw)[: N // 2], 65536)
    with pytest.raises(ConnectionError, match="closed"):
        read_reply(ReplyReader(sock), lambda rr, n: read_value(rr, n, want, memoryview(bytearray(N)), None))
    t.join()
    sock.close()


class _Conn:  # what redis_wire._replies reads: a redis-py connection's `_sock`
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock


@pytest.mark.parametrize("piece", [1, 3, 7, 4096])
def test_a_saves_replies_are_read_in_step_and_every_non_ok_keeps_its_place(piece: int) -> None:
    """The save's replies take a fast path for runs of `+OK` (`ReplyReader.oks`, compared a
    block at a time); an error, an integer (the budget's INCRBY) or a status that only starts
    like OK is read in its place, whatever the receives cut, and nothing past the last reply is
    taken (a leftover is a protocol error, as before)."""
    from kvtier.store.tiers.redis_reader import ProtocolError
    from kvtier.store.tiers.redis_wire import _replies

    wire = b"+OK\r\n" * 9 + b"-OOM no\r\n" + b"+OKAY\r\n" + b"+OK\r\n" * 3 + b":42\r\n"
    sock, t = _serve(wire, piece)
    got = _replies(_Conn(sock), 15)
    t.join()
    sock.close()
    assert [g in (True, "OK") for g in got] == [True] * 9 + [False, False] + [True] * 3 + [False]
    assert isinstance(got[9], ResponseError) and str(got[9]) == "OOM no"
    assert got[10] == "OKAY" and got[14] == 42
    sock, t = _serve(b"+OK\r\n" * 3, piece)
    t.join()  # the third reply is in the socket before the read: a leftover the reader can see
    with pytest.raises(ProtocolError):  # one reply more than was asked for
        _replies(_Conn(sock), 2)
    sock.close()
