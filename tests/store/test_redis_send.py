"""redis_wire.send_all: a value's RESP head and payload leave whole and in order, with one gather
write a pass, through short writes (a small send buffer, a slow reader)."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from kvtier.store.tiers.redis_wire import send_all


@pytest.mark.parametrize("told", [False, True])
def test_short_writes_go_on_where_they_stopped(told: bool) -> None:
    """Whether or not the caller tells the total (`nbytes`, the save stream's first-pass fast
    path), a short write goes on from the byte where it stopped."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # every sendmsg writes a part of the rest
    a.settimeout(10)  # as redis-py sets it: a send returns what fit (blocking, it would wait for all)
    parts = [b"", b"*3\r\n$3\r\nSET\r\n", memoryview(os.urandom(1 << 20)), b"", memoryview(os.urandom(77)), b"\r\n"]
    want = b"".join(bytes(p) for p in parts)
    got = bytearray()

    def reader() -> None:
        while len(got) < len(want):
            chunk = b.recv(3000)  # slower than the writer: short writes on its side
            if not chunk:
                break
            got.extend(chunk)

    t = threading.Thread(target=reader)
    t.start()
    calls = []
    real = a.sendmsg

    class Counting:  # counts the passes (socket.sendmsg cannot be patched on the object)
        def sendmsg(self, bufs):  # noqa: ANN001, ANN202
            calls.append(sum(len(x) for x in bufs))
            return real(bufs)

    send_all(Counting(), parts, len(want) if told else None)  # type: ignore[arg-type]
    t.join(10)
    a.close()
    b.close()
    assert bytes(got) == want
    assert len(calls) > 1 and calls[0] == len(want)  # short writes happened, the first pass offered all
    assert all(x > y for x, y in zip(calls, calls[1:]))  # each pass offered only what was left


def test_everything_in_one_pass_when_it_fits() -> None:
    a, b = socket.socketpair()
    calls = []
    real = a.sendmsg

    class Counting:
        def sendmsg(self, bufs):  # noqa: ANN001, ANN202
            calls.append(len(bufs))
            return real(bufs)

    send_all(Counting(), [b"head", memoryview(b"payload"), b"\r\n"])  # type: ignore[arg-type]
    assert b.recv(100) == b"headpayload\r\n" and calls == [3]
    a.close()
    b.close()


@pytest.mark.parametrize("told", [False, True])
def test_parts_of_wide_items_are_counted_in_bytes(told: bool) -> None:
    """A part whose items are wider than a byte (uint16 here) is sent whole: short writes are
    counted in bytes, not items."""
    import numpy as np

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.settimeout(10)
    wide = np.arange(1 << 18, dtype=np.uint16)
    want = b"hd" + wide.tobytes()
    got = bytearray()
    t = threading.Thread(target=lambda: [got.extend(b.recv(65536)) for _ in iter(lambda: len(got) < len(want), False)])
    t.start()
    send_all(a, [b"hd", wide], len(want) if told else None)  # type: ignore[list-item]
    t.join(10)
    a.close()
    b.close()
    assert bytes(got) == want


@pytest.mark.parametrize("n", [1, 240, 241, 4096, 300_001])
def test_an_unkeyed_seal_packed_in_one_go_is_the_header_encode_header_gives(n: int) -> None:
    """`seal_value` without a secret packs the header in one go (`payload.encode_sealed`), not
    through a ChunkHeader and `encode_header` a value: the same 128 bytes but the creation time,
    decoding to a header whose checksum verifies the bytes (format 1, no MAC)."""
    from kvtier.store import payload as P
    from kvtier.store.tiers.redis_wire import seal_value

    data = os.urandom(n)
    h = P.make_header("0123456789abcdef", b"\x07" * 20, 3, 64, 128, n, "bfloat16")
    raw = seal_value(h, memoryview(data), None)
    got = P.decode_header(raw)
    assert not isinstance(got, P.Rejected) and P.verify(got, data) is None
    assert got.format_version == P.FORMAT_VERSION and not got.mac and got.mac_kind == 0
    assert raw == P.encode_header(got)
    want = P.encode_header(P.seal(h, data))
    assert raw[:84] == want[:84] and raw[92:124] == want[92:124]  # all but created_ns and the CRC
