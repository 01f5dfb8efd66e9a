"""The cpu tier: one preallocated host slab per group, fixed-size slots, zero-copy views.

Each group g owns a `torch.uint8` tensor of shape `(num_slots[g], slot_bytes[g])`, allocated
once at construction (pinned when CUDA is present, so device<->host copies run async). Given
`host_register` (vLLM's own `host_register`/`host_unregister`, as the vLLM worker passes them),
a slab is plain memory registered after the fact, as vLLM's CPU tier does: PyTorch's pinned
allocator rounds a request up to a power of two, so a 20 GiB slab would lock 32 GiB; if
registration fails, PyTorch's pinned allocator is used, with a warning. A slot
is a row; `view(g, s, n)` is a zero-copy view of its first n bytes that a transfer engine can
copy into or out of directly. The header of each occupied slot is kept beside the slab in a
Python list: memory of this process is trusted, so no payload checksum is computed here (the
disk and redis tiers checksum; a checksum here would halve cpu throughput for no gain).
Rejected alternative: one slab with rows sized for all groups (vLLM's layout); with unequal
groups it wastes every byte between a group's chunk size and the largest one.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator

import torch

from kvtier.store.payload import ChunkHeader, as_bytes_view, mismatch, span_not_held
from kvtier.store.tiers.base import SlotTier, TierLayout


def as_u8(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if t.dtype == torch.uint8 and t.dim() == 1:
        return t  # the common case, without a reshape dispatch
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


log = logging.getLogger("kvtier.cpu")


def _pin_default() -> bool:
    return torch.cuda.is_available()


HostRegister = tuple[Callable[[int, int], bool], Callable[[int], None]]  # (register, unregister)


def _slab(shape: tuple[int, int], pin: bool, register: HostRegister | None) -> tuple[torch.Tensor, bool]:
    """A host slab, page-locked when `pin`; (slab, registered through `register`)."""
    if not pin or register is None or shape[0] * shape[1] == 0:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=pin and shape[0] * shape[1] > 0), False
    t = torch.empty(shape, dtype=torch.uint8)
    if register[0](t.data_ptr(), t.numel()):
        return t, True
    log.warning("cpu tier: host registration of %d bytes failed; using PyTorch's pinned allocator, "
                "which may lock up to twice that", t.numel())
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True), False


class CpuTier(SlotTier):
    name = "cpu"

    def __init__(self, layout: TierLayout, *, pin_memory: bool | None = None,
                 host_register: HostRegister | None = None) -> None:
        super().__init__(layout)
        pin = _pin_default() if pin_memory is None else pin_memory
        self.pinned = pin
        made = [_slab((n, b) if n else (0, 0), pin, host_register)
                for b, n in zip(layout.slot_bytes, layout.num_slots)]
        self.slabs: list[torch.Tensor] = [t for t, _ in made]
        # registered slabs are unregistered by close(), or when the tier is collected unclosed
        self._unregister = [weakref.finalize(self, host_register[1], t.data_ptr())  # type: ignore[index]
                            for t, reg in made if reg]
        self._headers: list[list[ChunkHeader | None]] = [[None] * n for n in layout.num_slots]

    def view(self, group: int, slot: int, nbytes: int) -> torch.Tensor:
        """Zero-copy view of the first `nbytes` bytes of a slot."""
        self._check(group, slot, nbytes)
        return self.slabs[group][slot, :nbytes]

    def header(self, group: int, slot: int) -> ChunkHeader | None:
        self._check(group, slot)
        return self._headers[group][slot]

    def write(self, group: int, slot: int, header: ChunkHeader, data: object) -> bool:
        n = header.payload_bytes
        self._check(group, slot, n)
        dst = self.slabs[group][slot, :n]
        if isinstance(data, torch.Tensor):
            src_t = as_u8(data)
            if src_t.numel() != n:
                raise ValueError(f"data has {src_t.numel()} bytes, header says {n}")
            dst.copy_(src_t)
        else:
            src = as_bytes_view(data)
            if len(src) != n:
                raise ValueError(f"data has {len(src)} bytes, header says {n}")
            as_bytes_view(dst)[:] = src
        self._headers[group][slot] = header
        self.writes += 1
        self.bytes_written += n
        return True

    def begin(self, group: int, slot: int) -> torch.Tensor:
        """Start writing a slot in place: its header is dropped first (so no reader, and no
        background copy that checks `header(...) is h` afterwards, takes the slot for the old
        chunk while new bytes arrive), then the whole row is returned for the caller to fill.
        `commit` makes it readable. Bytes outside the span the header will name are whatever the
        slot held before: a caller of `holds` copies only the span (the vLLM worker does), and
        `read` copies the whole row, so a slot filled this way is read with `holds`. This is the
        only way bytes enter a slot that a background copy checks by header identity: `write`
        sets the header after the bytes."""
        self._check(group, slot)
        self._headers[group][slot] = None
        return self.slabs[group][slot]

    def commit(self, group: int, slot: int, header: ChunkHeader) -> None:
        """The slot, filled in place since `begin`, now holds the chunk `header` names."""
        self._check(group, slot, header.payload_bytes)
        self._headers[group][slot] = header
        self.writes += 1
        self.bytes_written += header.payload_bytes

    def holds(self, group: int, slot: int, header: ChunkHeader) -> bool:
        """`read`'s checks without the copy: whether the slot serves `header` (a caller then reads
        the slot's row in place). Counts a read, a miss or a dropped corrupt slot as `read` does."""
        self._check(group, slot)
        self.reads += 1
        stored = self._headers[group][slot]
        if stored is None:
            self.misses += 1
            return False
        why = mismatch(stored, header)
        if span_not_held(why):  # valid for the blocks it holds: a miss, the slot stays
            self.misses += 1
            return False
        if why is not None:
            return self._drop_corrupt(group, slot, why)
        self.bytes_read += header.payload_bytes
        return True

    def read(self, group: int, slot: int, header: ChunkHeader, out: object) -> bool:
        if not self.holds(group, slot, header):  # the checks and counters are holds'
            return False
        n = header.payload_bytes
        src = self.slabs[group][slot, :n]
        if isinstance(out, torch.Tensor):
            as_u8(out)[:n].copy_(src)
        else:
            as_bytes_view(out)[:n] = as_bytes_view(src)
        return True

    def free(self, group: int, slot: int) -> None:
        self._check(group, slot)
        self._headers[group][slot] = None

    def close(self) -> None:
        """Unregister the slabs this tier registered (their owner synchronized its copies)."""
        for fin in self._unregister:
            fin()

    def list(self) -> Iterator[tuple[int, int, ChunkHeader]]:
        for g, headers in enumerate(self._headers):
            for s, h in enumerate(headers):
                if h is not None:
                    yield g, s, h
