"""The delaying TCP proxy against a plain socket echo server: bytes intact, every chunk held
for the delay (both ways), pipelined rather than serialized, counted, and stopped for good."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.loadgen.proxy import DelayProxy


@pytest.fixture
def echo() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1]
    stop.set()
    srv.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = s.recv(n - len(buf))
        assert part, "the proxy closed the connection early"
        buf += part
    return bytes(buf)


def test_each_chunk_is_held_for_the_delay_both_ways(echo: int) -> None:
    with DelayProxy("127.0.0.1", echo, delay_s=0.1) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as s:
            t0 = time.perf_counter()
            s.sendall(b"hello")
            assert _recv_exactly(s, 5) == b"hello"
            rtt = time.perf_counter() - t0
        time.sleep(0.3)  # the close travels through the proxy too
        st = proxy.stats()
    assert rtt >= 0.2  # 0.1 s to the server and 0.1 s back
    assert st.connections == 1 and st.forwarded_bytes == 10 and st.forwarded_chunks == 2


def test_large_payloads_arrive_intact_and_the_delay_is_not_paid_per_chunk_in_series(echo: int) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB: at least 16 reads of 64 KiB each way
    with DelayProxy("127.0.0.1", echo, delay_s=0.5) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as s:
            t0 = time.perf_counter()
            sender = threading.Thread(target=s.sendall, args=(payload,))
            sender.start()
            got = _recv_exactly(s, len(payload))
            sender.join()
            elapsed = time.perf_counter() - t0
        st = proxy.stats()
    assert got == payload
    assert st.forwarded_chunks >= 32 and st.forwarded_bytes == 2 * len(payload)
    # delays paid in series would take >= 16 x 0.5 s one way; pipelined, about 2 delays (1 s).
    # The bound is the series minimum, not a margin over the pipelined time: with 0.1 s delays a
    # loaded machine passed 1.0 s against a 1.6 s bound; now the margin is about 7 s
    assert 1.0 <= elapsed < 8.0


def test_zero_delay_forwards_and_stop_closes_the_port(echo: int) -> None:
    proxy = DelayProxy("127.0.0.1", echo, delay_s=0.0)
    port = proxy.start()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"x" * 100)
        assert _recv_exactly(s, 100) == b"x" * 100
    proxy.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with pytest.raises(ValueError, match="delay_s=-1"):
        DelayProxy("127.0.0.1", echo, delay_s=-1)
