"""A TCP proxy on loopback that holds every chunk it forwards for a fixed delay, both ways.

Used to put a slow network between an engine and its Redis: each chunk read from one side is
written to the other `delay_s` after it arrived. Chunks are pipelined (a chunk that arrives while
an earlier one waits waits only its own delay), so this adds latency, as a longer wire does, not
a bandwidth cap; order is kept per direction. The rejected alternative, sleeping before each
write on the reading thread, makes a 3 MiB payload of 64 KiB reads cost 48 delays instead of one.

It listens on loopback only by default and adds no access of its own: any local user can connect
to it, so the server behind it must demand a password (`kvtier bench serve`'s own redis-server does).

One asyncio loop on a daemon thread; `stats()` counts connections, forwarded chunks and bytes,
so a benchmark can show that traffic really went through it.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

READ_BYTES = 65536
QUEUED_CHUNKS = 256  # per direction: a full queue stops reading (backpressure), never drops


@dataclass(frozen=True, slots=True)
class ProxyStats:
    connections: int
    forwarded_chunks: int
    forwarded_bytes: int


class DelayProxy:
    def __init__(self, target_host: str, target_port: int, delay_s: float,
                 host: str = "127.0.0.1") -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s={delay_s} must be >= 0")
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.host = host
        self.port = 0
        self._connections = self._chunks = self._bytes = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def __enter__(self) -> DelayProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> int:
        """Listen on a free port of `host`; returns it."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._handle, self.host, 0))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # reported to start()'s caller
                failed.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=main, name="kvtier-delay-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self.port

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            loop.stop()

        if loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), loop)
        thread.join(timeout=10)
        self._loop = self._thread = None

    def stats(self) -> ProxyStats:
        with self._lock:
            return ProxyStats(self._connections, self._chunks, self._bytes)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self._connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(self._pipe(client_r, up_w), self._pipe(up_r, client_w))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (client_w, up_w):
                w.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUED_CHUNKS)

        async def read() -> None:
            try:
                while data := await reader.read(READ_BYTES):
                    await queue.put((loop.time() + self.delay_s, data))
            finally:
                await queue.put(None)

        async def write() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                with self._lock:  # counted first: a byte the far side has read is always counted
                    self._chunks += 1
                    self._bytes += len(data)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()  # the other side's reader sees the end, as without the proxy

        await asyncio.gather(read(), write())
