"""A small pool of host byte buffers, reused by size instead of allocated per call.

The vLLM worker stages disk and Redis reads and stores without a cpu slot in these (pinned on a
GPU, so a copy to or from the device is asynchronous); the scheduler's lookup promoter reads
into them. `take` and `give` may run on two threads at once (the engine's and the I/O lane's):
a deque's pop and append are atomic, so no lock is needed.

Reused, not allocated per call: pinned allocations are slow (they page-lock memory), and a chunk
is megabytes: a step would pay for it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

POOL_BUFFERS = 8  # buffers kept per size (the vLLM worker's staging pool, the promoter's read pool)


class BufferPool:
    def __init__(self, keep: int = POOL_BUFFERS, pin: bool = False) -> None:
        """`keep`: buffers kept per size; `pin`: new buffers are page-locked (CUDA present)."""
        self.keep = keep
        self.pin = pin
        self._free: dict[int, deque[torch.Tensor]] = {}

    def take(self, nbytes: int, zero: bool = False) -> torch.Tensor:
        """A uint8 buffer of `nbytes` from the pool (or a new one). zero=True for a store: the
        positions a partial chunk does not hold are stored as zeros, never as whatever the buffer
        held (it would go to disk and Redis under a valid checksum)."""
        q = self._free.get(nbytes)
        try:
            buf = q.pop() if q else None
        except IndexError:  # emptied by the other thread in between
            buf = None
        if buf is None:
            import torch  # here, not at import: the scheduler's promoter module loads without it

            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        if zero:
            buf.zero_()
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer no copy reads any more; kept for reuse up to `keep` per size."""
        q = self._free.setdefault(buf.numel(), deque())
        if len(q) < self.keep:
            q.append(buf)
