"""vLLM's GPU copy handler (`SingleDirectionOffloadingHandler`) on a CPU-only machine, for tests.

The KV tensors are CPU tensors of a subclass that claims `is_cuda`, so kvtier's worker takes its
GPU path through vLLM's handlers (copies.py's SlabCopier) and vLLM's own descriptor code computes every
pointer. What a GPU would do is emulated, asynchronously:

- `swap_blocks_batch` (the one batched copy) is queued, not run: a real GPU runs it later;
- each handler's transfers form one FIFO (vLLM chains a handler's pooled streams with
  `wait_event`); different handlers' FIFOs are independent, as a GPU's streams are, so a load
  handler's copy can run before a store handler's copy submitted earlier;
- an event recorded after a copy answers its first `query()` with False and runs its own FIFO
  up to itself at the second (or at `synchronize()`): a job never ends in the step it was
  submitted, and its copies run only when the worker asks whether they ran. A worker that
  reports a job done, or reads a slot, without asking its events, or that relies on one
  handler's copies having run before another's, sees the bytes as they were before the copy (a
  restored request's check, or a disk write, then finds them wrong);
- kvtier's own side stream (copies.SideStream: chunks without a cpu slot, through staging
  buffers) is emulated alike: the copies it is given run later, as one more FIFO;
- `tick()` runs everything queued (at the end of a scenario).

`transfers()` counts the batched copies queued since `installed()` began, `side_copies()` the
side stream's.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import torch

_lock = threading.RLock()  # the engine thread and kvtier's I/O thread (a store's disk write waits)
_chains: list = []  # every FIFO made (tick runs them all)
_local = threading.local()  # the stream a handler made current
_queued = 0  # batched copies queued so far
_base = 0  # _queued when installed() began
_side = [0, 0]  # side stream copies queued so far, and when installed() began


def transfers() -> int:
    return _queued - _base


def side_copies() -> int:
    return _side[0] - _side[1]


class FakeCuda(torch.Tensor):
    @property
    def is_cuda(self) -> bool:  # noqa: D102
        return True


class _Chain:
    """One FIFO of copies (the streams of one handler)."""

    def __init__(self) -> None:
        self.ops: list = []
        self.ran = 0
        _chains.append(self)

    def run_to(self, mark: int) -> None:
        with _lock:
            while self.ran < mark:
                op, self.ops[self.ran] = self.ops[self.ran], None
                op()
                self.ran += 1


def tick() -> None:
    """Run every queued copy (the 'GPU' catches up)."""
    for chain in list(_chains):
        chain.run_to(len(chain.ops))


def _swap(src, dst, sizes, is_src_access_order_any=False, **_):  # noqa: ANN001, ANN202
    global _queued
    ops = list(zip(src.tolist(), dst.tolist(), sizes.tolist()))  # descriptors are read at submit

    def run() -> None:
        for s, d, n in ops:
            ctypes.memmove(d, s, n)

    stream = getattr(_local, "stream", None)
    chain = stream.chain if stream is not None else _Chain()
    with _lock:
        chain.ops.append(run)
        _queued += 1


class _Event:
    def __init__(self, **_) -> None:  # noqa: ANN003
        self.chain: _Chain | None = None
        self.mark = 0
        self.asked = False

    def record(self, stream=None) -> None:  # noqa: ANN001
        self.chain = stream.chain if stream is not None else None
        self.mark = len(self.chain.ops) if self.chain is not None else 0
        self.asked = False

    def query(self) -> bool:
        if self.chain is None or self.chain.ran >= self.mark:
            return True
        if not self.asked:  # not yet: the 'GPU' is busy
            self.asked = True
            return False
        self.chain.run_to(self.mark)
        return True

    def synchronize(self) -> None:
        if self.chain is not None:
            self.chain.run_to(self.mark)

    def elapsed_time(self, _other) -> float:  # noqa: ANN001
        return 0.0


class _Stream:
    def __init__(self) -> None:
        self.chain = _Chain()

    def wait_stream(self, *_) -> None:  # noqa: ANN002 - the compute stream: the model ran already
        pass

    def wait_event(self, event: _Event) -> None:
        if event.chain is not None:  # after that event: the same FIFO
            self.chain = event.chain


class _FakeSide:
    """kvtier's SideStream (copies.py), its copies run later."""

    def __init__(self) -> None:
        self.chain = _Chain()

    def wait_compute(self) -> None:  # the model ran already
        pass

    def run(self, fn) -> None:  # noqa: ANN001
        with _lock:
            self.chain.ops.append(fn)
            _side[0] += 1

    def record(self, blocking: bool = False) -> _Event:
        event = _Event()
        event.chain, event.mark = self.chain, len(self.chain.ops)
        return event

    def synchronize(self) -> None:
        self.chain.run_to(len(self.chain.ops))


@contextlib.contextmanager
def _current(stream: _Stream):
    prev = getattr(_local, "stream", None)
    _local.stream = stream
    try:
        yield
    finally:
        _local.stream = prev


@contextlib.contextmanager
def installed():
    """vLLM's handler module patched for CPU tensors while inside; restored after."""
    import vllm.v1.kv_offload.cpu.gpu_worker as gw

    global _base
    _base = _queued
    _side[1] = _side[0]
    plat = gw.current_platform
    saved = [(plat, "Stream", getattr(plat, "Stream", None)),
             (plat, "current_stream", getattr(plat, "current_stream", None)),
             (plat, "stream", getattr(plat, "stream", None)),
             (torch, "Event", torch.Event), (gw, "_select_swap_blocks_fn", gw._select_swap_blocks_fn)]
    plat.Stream = _Stream
    plat.current_stream = lambda *a, **k: _Stream()
    plat.stream = _current
    torch.Event = _Event
    gw._select_swap_blocks_fn = lambda *a, **k: _swap
    # kvtier's worker sees vLLM's KV tensors (which vLLM rebuilds as plain tensors) as CUDA ones
    from kvtier.integrations.vllm import worker as kw

    init = kw.KvtierWorker.__init__

    def fake_init(self, ctx, kv_caches, metrics):  # noqa: ANN001, ANN202
        for t in kv_caches.tensors:
            t.tensor = t.tensor.as_subclass(FakeCuda)
        init(self, ctx, kv_caches, metrics)
        self.copies.stream = _FakeSide()  # staging copies later too (their host buffers stay unpinned)

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
