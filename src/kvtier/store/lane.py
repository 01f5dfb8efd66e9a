"""One background thread that runs disk and Redis I/O off an engine's thread, in FIFO order.

Nothing here knows an engine. Its users are the vLLM halves: the worker's write-behind and
reads (integrations/vllm/worker.py), the scheduler's Redis lookups and lookup promotions.

Rule: `submit_store` and `submit_load` never wait for a disk or a network. The worker copies
pages into a host buffer (a memory copy) and writes the cpu tier inline; every disk and Redis
read and write runs here, in submission order (one FIFO, so a load queued after a store of the
same slot reads what that store wrote). Back-pressure: writes wait in the queue up to
`max_bytes`; a write that would pass it is dropped and counted by the caller, never waited on.
Reads are never dropped (a load vLLM scheduled must finish, as a hit or a counted miss).

A chunk whose slow-tier write was dropped or is still queued when a load reads its slot is a
header mismatch there: a counted miss, recomputed, never wrong KV.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("kvtier.vllm")  # its users' logger, as before it moved here


class Lane:
    def __init__(self, name: str, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._queue: deque[tuple[Callable[[], None], int]] = deque()
        self._cond = threading.Condition()
        self._pending_bytes = 0  # bytes of queued writes (reads are not counted)
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{name}", daemon=True)
        self._thread.start()
        # a process that exits without vLLM's shutdown still lands what it queued (a daemon
        # thread is alive while atexit handlers run)
        atexit.register(self.close)

    def submit(self, fn: Callable[[], None], write_bytes: int = 0) -> bool:
        """Queue `fn`; False (nothing queued) when it is a write that would pass `max_bytes`."""
        with self._cond:
            if self._closed:
                return False
            # an empty queue admits any write (one store job may be larger than the limit)
            if write_bytes and self._pending_bytes and self._pending_bytes + write_bytes > self.max_bytes:
                return False
            self._pending_bytes += write_bytes
            self._queue.append((fn, write_bytes))
            self._cond.notify()
        return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has run (shutdown, tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 30.0) -> bool:
        """Run what is queued (up to `timeout`), drop the rest, stop the thread. True when the
        thread has stopped, so its owner may close what the queued work used."""
        atexit.unregister(self.close)
        if not self._closed:
            self.drain(timeout)
            with self._cond:
                self._closed = True
                self._queue.clear()  # what did not run in time is dropped, not run later
                self._pending_bytes = 0
                self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                fn, nbytes = self._queue.popleft()
                self._busy = True
            try:
                fn()
            except Exception:  # noqa: BLE001 - a tier error must not kill the lane
                log.exception("kvtier: background tier I/O failed")
            finally:
                with self._cond:
                    self._pending_bytes -= nbytes
                    self._busy = False
                    self._cond.notify_all()
