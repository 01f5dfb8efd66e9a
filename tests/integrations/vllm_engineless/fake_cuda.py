"""vLLM's GPU copy handler (`SingleDirectionOffloadingHandler`) on a CPU-only machine, for tests.

The KV tensors are CPU tensors of a subclass that claims `is_cuda`, so kvtier's worker takes its
GPU path through vLLM's handlers (copier.py) and vLLM's own descriptor code computes every
pointer. What a GPU would do is emulated, asynchronously:

- `swap_blocks_batch` (the one batched copy) is queued, not run: a real GPU runs it later;
- an event recorded after it answers its first `query()` with False and runs the queue up to
  itself at the second (or at `synchronize()`), so a job never ends in the step it was submitted,
  and its copies run only when the worker asks whether they ran: a worker that reports a job done,
  or reads a slot, without asking its events sees the bytes as they were before the copy (a
  restored request's check, or a disk write, then finds them wrong);
- `tick()` runs everything queued (at the end of a scenario).

Streams are one FIFO (stricter ordering than a GPU, never looser within a handler).
`transfers()` counts the batched copies queued since `installed()` began.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import torch

_lock = threading.RLock()  # the engine thread and kvtier's I/O thread (a store's disk write waits)
_queue: list = []  # closures of queued copies
_ran = 0  # copies run so far
_queued = 0  # copies queued so far
_base = 0  # _queued when installed() began


def transfers() -> int:
    return _queued - _base


class FakeCuda(torch.Tensor):
    @property
    def is_cuda(self) -> bool:  # noqa: D102
        return True


def tick() -> None:
    """Run every queued copy (the 'GPU' catches up)."""
    _upto(_queued)


def _upto(mark: int) -> None:
    global _ran
    with _lock:
        while _ran < mark and _queue:
            _queue.pop(0)()
            _ran += 1


def _swap(src, dst, sizes, is_src_access_order_any=False, **_):  # noqa: ANN001, ANN202
    global _queued
    ops = list(zip(src.tolist(), dst.tolist(), sizes.tolist()))  # descriptors are read at submit

    def run() -> None:
        for s, d, n in ops:
            ctypes.memmove(d, s, n)

    with _lock:
        _queue.append(run)
        _queued += 1


class _Event:
    def __init__(self, **_) -> None:  # noqa: ANN003
        self.mark = 0
        self.asked = False

    def record(self, *_) -> None:  # noqa: ANN002
        self.mark = _queued
        self.asked = False

    def query(self) -> bool:
        if _ran >= self.mark:
            return True
        if not self.asked:  # not yet: the 'GPU' is busy
            self.asked = True
            return False
        _upto(self.mark)
        return True

    def synchronize(self) -> None:
        _upto(self.mark)

    def elapsed_time(self, _other) -> float:  # noqa: ANN001
        return 0.0


class _Stream:
    def wait_stream(self, *_) -> None:  # noqa: ANN002
        pass

    def wait_event(self, *_) -> None:  # noqa: ANN002
        pass


@contextlib.contextmanager
def installed():
    """vLLM's handler module patched for CPU tensors while inside; restored after."""
    import vllm.v1.kv_offload.cpu.gpu_worker as gw

    global _base
    _base = _queued
    plat = gw.current_platform
    saved = [(plat, "Stream", getattr(plat, "Stream", None)),
             (plat, "current_stream", getattr(plat, "current_stream", None)),
             (plat, "stream", getattr(plat, "stream", None)),
             (torch, "Event", torch.Event), (gw, "_select_swap_blocks_fn", gw._select_swap_blocks_fn)]
    plat.Stream = _Stream
    plat.current_stream = lambda *a, **k: _Stream()
    plat.stream = lambda s: contextlib.nullcontext()
    torch.Event = _Event
    gw._select_swap_blocks_fn = lambda *a, **k: _swap
    # kvtier's worker sees vLLM's KV tensors (which vLLM rebuilds as plain tensors) as CUDA ones
    from kvtier.integrations.vllm import worker as kw

    init = kw.KvtierWorker.__init__

    def fake_init(self, ctx, kv_caches, metrics):  # noqa: ANN001, ANN202
        for t in kv_caches.tensors:
            t.tensor = t.tensor.as_subclass(FakeCuda)
        init(self, ctx, kv_caches, metrics)

    saved.append((kw.KvtierWorker, "__init__", init))
    kw.KvtierWorker.__init__ = fake_init
    try:
        yield
    finally:
        tick()
        for obj, name, value in saved:
            if value is None:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
