"""The cpu tier: one preallocated host slab per group, fixed-size slots, zero-copy views.

Each group g owns a `torch.uint8` tensor of shape `(num_slots[g], slot_bytes[g])`, allocated
once at construction (pinned when CUDA is present, so device<->host copies run async). An
unpinned slab is a private anonymous mapping, never touched here: a page is committed where a
slot is first written, and `release` gives back those of a pool that shrank (a learned share
lays a tier out for the most slots each group may get: base.SlotTier). Given
`host_register` (vLLM's own `host_register`/`host_unregister`, as the vLLM worker passes them),
a slab is plain memory registered after the fact, as vLLM's CPU tier does: PyTorch's pinned
allocator rounds a request up to a power of two, so a 20 GiB slab would lock 32 GiB; if
registration fails, PyTorch's pinned allocator is used, with a warning. A slot
is a row; `view(g, s, n)` is a zero-copy view of its first n bytes that a transfer engine can
copy into or out of directly.

Slot table: each slot has a record (`host_region.SLOT_RECORD` bytes): a sequence number, then
the header of the chunk it holds (zeros when empty). `begin` makes the number odd and clears the
header before new bytes arrive; `commit` writes the header and makes it even again; `free` clears
the header. So a reader that copies a slot without holding it (the vLLM worker's disk and Redis
write-behind) knows the copy is the chunk it meant when `generation` is the same after the copy
as when that chunk was committed (a seqlock; `fence` orders the number against the bytes). Memory
of these processes is trusted, so no payload checksum is computed here (the disk and redis tiers
checksum; a checksum here would halve cpu throughput for no gain).

Given a `HostRegion` (host_region.py), slabs and table live in a file two processes map, so the
vLLM scheduler's process can fill a slot the worker's process reads (promotion at lookup); every
header then lives in the table, never only in a process's memory. Another process of this user
may truncate that file, and a page past its end is SIGBUS: every operation here first asks the
region whether its file still spans the mapping (`HostRegion.intact`, one fstat). Once it does
not (for good): a header reads as empty (a counted miss), `begin` hands out a stand-in row and
counts a failed write, `commit` and `free` touch nothing, `generation` is a new odd number every
call (no copy taken before compares equal), and `view` raises: a fault inside a copy cannot
be resumed from Python, and a truncation drops privately mapped pages too.
One slab per group, not rows sized for all groups: with unequal groups those waste every byte
between a group's chunk size and the largest one.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import struct
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

from kvtier.store.payload import (
    HEADER_BYTES,
    MAGIC,
    ChunkHeader,
    as_bytes_view,
    decode_header,
    encode_header,
    mismatch,
    span_not_held,
)
from kvtier.store.tiers.base import SlotTier, TierLayout
from kvtier.store.tiers.host_region import SEQ_BYTES, SLOT_RECORD, HostRegion, RegionError

ZERO_HEADER = bytes(HEADER_BYTES)


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


def _pageable(shape: tuple[int, int]) -> torch.Tensor:
    """An unpinned slab: a private anonymous mapping (the tensor holds it), not malloc's memory,
    which may be pages touched before; untouched, so it commits no memory until written."""
    mm = mmap.mmap(-1, shape[0] * shape[1], flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0))
    return torch.frombuffer(mm, dtype=torch.uint8).view(shape)


def _slab(shape: tuple[int, int], pin: bool, register: HostRegister | None) -> tuple[torch.Tensor, bool]:
    """A host slab, page-locked when `pin`; (slab, registered through `register`)."""
    if shape[0] * shape[1] == 0:
        return torch.empty(shape, dtype=torch.uint8), False
    if not pin:
        return _pageable(shape), False
    if register is None:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True), False
    t = torch.empty(shape, dtype=torch.uint8)
    if register[0](t.data_ptr(), t.numel()):
        return t, True
    log.warning("cpu tier: host registration of %d bytes failed; using PyTorch's pinned allocator, "
                "which may lock up to twice that", t.numel())
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True), False


def register_region(t: torch.Tensor, register: HostRegister | None) -> bool:
    """Page-lock a slab of a shared region in place (it cannot be reallocated pinned: the other
    process maps this memory); False, with a warning, when it cannot be (copies are then
    synchronous, still correct)."""
    if register is None or t.numel() == 0:
        return False
    if register[0](t.data_ptr(), t.numel()):
        return True
    log.warning("cpu tier: host registration of a %d-byte shared slab failed; its copies run "
                "unpinned", t.numel())
    return False


_FENCE = threading.Lock()


def _lock_fence() -> None:
    """Without the C extension: a lock's acquire and release (enough on x86, whose stores and
    loads are each kept in order; not a full barrier on ARM)."""
    with _FENCE:
        pass


try:
    from kvtier.store._xxcopy import fence as _c_fence
except ImportError:  # installed without a C compiler, or an extension built before fence existed
    _c_fence = None
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        logging.getLogger("kvtier.cpu").warning(
            "kvtier: the C extension's memory fence is missing on %s, where a lock is not a full "
            "barrier; reinstall kvtier with a C compiler (pip install -e .) before sharing the cpu "
            "tier between processes", platform.machine())

# A full memory barrier between this thread's earlier and later memory accesses, for the seqlock
# above on weakly ordered CPUs (ARM): the C extension's __atomic_thread_fence(SEQ_CST).
fence: Callable[[], None] = _c_fence if _c_fence is not None else _lock_fence


_SEQ = struct.Struct("<Q")
PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(b & 1 for b in range(256))


def _load_libc():  # type: ignore[no-untyped-def]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    return libc


_LIBC = _load_libc()


def resident_in(addr: int, length: int) -> int:
    """Bytes of the pages spanning [addr, addr + length) that are in memory now (`mincore`)."""
    if length <= 0 or _LIBC is None:
        return 0
    start = addr // PAGE * PAGE
    pages = -(-(addr + length - start) // PAGE)
    vec = ctypes.create_string_buffer(pages)
    if _LIBC.mincore(start, pages * PAGE, vec) != 0:
        return 0
    return vec.raw[:pages].translate(_LOW_BIT).count(1) * PAGE  # bit 0: resident


def _table_words(table: memoryview, n: int) -> torch.Tensor:
    """A slot table as 8-byte words, a row per slot: word 0 the sequence number, then the header."""
    return torch.frombuffer(table, dtype=torch.int64, count=n * SLOT_RECORD // 8).view(n, SLOT_RECORD // 8)


class CpuTier(SlotTier):
    name = "cpu"

    def __init__(self, layout: TierLayout, *, pin_memory: bool | None = None,
                 host_register: HostRegister | None = None, region: HostRegion | None = None) -> None:
        super().__init__(layout)
        pin = _pin_default() if pin_memory is None else pin_memory
        self.pinned = pin
        self.region = region
        self._lost_seq = 1  # generation's answers once the region is lost: odd, never repeated
        self._stand_ins: dict[int, torch.Tensor] = {}  # begin's rows once the region is lost
        if region is not None:  # slabs and table in a file another process maps too
            if region.layout != layout:
                raise ValueError(f"host region laid out for {region.layout}, not {layout}")
            registered = [bool(pin and register_region(t, host_register)) for t in region.slabs]
            made = list(zip(region.slabs, registered))
            self._tables = region.tables
        else:
            made = [_slab((n, b) if n else (0, 0), pin, host_register)
                    for b, n in zip(layout.slot_bytes, layout.num_slots)]
            self._tables = [memoryview(bytearray(n * SLOT_RECORD)) for n in layout.num_slots]
        self.slabs: list[torch.Tensor] = [t for t, _ in made]
        # per slab: page-locked (registered, or allocated pinned), so a GPU may read it directly
        self.locked: list[bool] = ([reg for _, reg in made] if region is not None
                                   else [bool(pin and t.numel()) for t, _ in made])
        # registered slabs are unregistered by close(), or when the tier is collected unclosed
        self._unregister = [weakref.finalize(self, host_register[1], t.data_ptr())  # type: ignore[index]
                            for t, reg in made if reg]

    # -- the slot table ------------------------------------------------------------------------

    def _lost(self) -> bool:
        """Whether the host region's file no longer spans its mapping (host_region.py): no page
        of it may be touched then."""
        return self.region is not None and not self.region.intact()

    def unreserved(self, group: int, slot: int) -> bool:
        """Whether the slot's pages are not reserved in the host region (a learned share's pool
        grew and its pages are not had yet, or tmpfs had no room: host_region.py, "Reserved
        slots"): never written then."""
        return self.region is not None and slot >= self.region.reserved(group)

    def reserve(self, group: int, slots: int) -> None:
        """The group's pool grew to `slots`. Private memory is committed where written: nothing to
        do. A host region reserves the pages off the caller's thread (`HostRegion.resize`): the
        slots take writes once they are had (before that, or if a full tmpfs refuses them, each
        write there is a counted failed write)."""
        self._check_release(group, min(slots, self.layout.num_slots[group]))
        if self.region is not None:
            self.region.resize(group, slots)

    def generation(self, group: int, slot: int) -> int:
        """The slot's sequence number: odd while it is being written, changed by every `begin`."""
        if self._lost():  # as if being written, and never the number a committed chunk had
            self._lost_seq += 2
            return self._lost_seq
        return _SEQ.unpack_from(self._tables[group], slot * SLOT_RECORD)[0]

    def _set_header(self, group: int, slot: int, header: ChunkHeader | None, bump: bool) -> None:
        table, off = self._tables[group], slot * SLOT_RECORD
        seq = _SEQ.unpack_from(table, off)[0]
        if bump and not seq & 1:  # begin: odd before any byte changes
            _SEQ.pack_into(table, off, seq + 1)
            fence()
        table[off + SEQ_BYTES:off + SLOT_RECORD] = encode_header(header) if header is not None else ZERO_HEADER
        if header is not None and seq & 1:  # commit: even once bytes and header are in
            fence()
            _SEQ.pack_into(table, off, seq + 1)

    def view(self, group: int, slot: int, nbytes: int) -> torch.Tensor:
        """Zero-copy view of the first `nbytes` bytes of a slot."""
        self._check(group, slot, nbytes)
        if self._lost():  # a view could only fault later, where no check runs
            raise RegionError(f"host region {self.region.path!r} was truncated under its mapping, so its "  # type: ignore[union-attr]
                              "slots cannot be viewed; restart the engine and stop whatever truncates it")
        return self.slabs[group][slot, :nbytes]

    def header(self, group: int, slot: int) -> ChunkHeader | None:
        self._check(group, slot)
        if self._lost():
            return None
        off = slot * SLOT_RECORD + SEQ_BYTES
        # copied out first: another process may rewrite the record while this decodes it
        raw = bytes(self._tables[group][off:off + HEADER_BYTES])
        if raw[:4] != MAGIC:
            return None
        h = decode_header(raw)
        return h if isinstance(h, ChunkHeader) else None

    def write(self, group: int, slot: int, header: ChunkHeader, data: object) -> bool:
        n = header.payload_bytes
        self._check(group, slot, n)
        src_t = as_u8(data) if isinstance(data, torch.Tensor) else None
        src = as_bytes_view(data) if src_t is None else None
        got = src_t.numel() if src_t is not None else len(src)  # type: ignore[arg-type]
        if got != n:
            raise ValueError(f"data has {got} bytes, header says {n}")
        if self._lost():
            return self._failed_write(group, slot, "its host region file was truncated")
        row = self.begin(group, slot)  # a stand-in, counted, if the region was lost since
        if src_t is not None:
            row[:n].copy_(src_t)
        else:
            as_bytes_view(row[:n])[:] = src
        self.commit(group, slot, header)
        return self.region is None or not (self.region.lost or self.unreserved(group, slot))

    def begin(self, group: int, slot: int) -> torch.Tensor:
        """Start writing a slot in place: its sequence number turns odd and its header is dropped
        first (so no reader, and no background copy that compares `generation` afterwards, takes
        the slot for the old chunk while new bytes arrive), then the whole row is returned for the
        caller to fill. `commit` makes it readable. Bytes outside the span the header will name
        are whatever the slot held before: a caller of `holds` copies only the span (the vLLM
        worker does), and `read` copies the whole row, so a slot filled this way is read with
        `holds`. Every write goes through here (`write` too). With the region lost, the row is a
        stand-in of this process's own memory (the caller's fill goes nowhere) and the write is
        counted failed."""
        self._check(group, slot)
        lost = self._lost()
        if lost or self.unreserved(group, slot):
            self._failed_write(group, slot, "its host region file was truncated" if lost else
                               "its memory is not reserved (no room in the host region's tmpfs)")
            if group not in self._stand_ins:
                self._stand_ins[group] = torch.empty(self.layout.slot_bytes[group], dtype=torch.uint8)
            return self._stand_ins[group]
        self._set_header(group, slot, None, bump=True)
        return self.slabs[group][slot]

    def commit(self, group: int, slot: int, header: ChunkHeader) -> None:
        """The slot, filled in place since `begin`, now holds the chunk `header` names.

        The vLLM worker's GPU path commits when it submits the copy, before the bytes land: every
        reader is gated elsewhere (the index keeps the key pending until vLLM's `complete_store`,
        which follows the job's end; the job's disk and Redis writes wait for its copies). A new
        reader of the slot table must be gated the same way."""
        self._check(group, slot, header.payload_bytes)
        if self._lost() or self.unreserved(group, slot):  # nothing is published (begin said why)
            return
        self._set_header(group, slot, header, bump=False)
        self.writes += 1
        self.bytes_written += header.payload_bytes

    def holds(self, group: int, slot: int, header: ChunkHeader) -> bool:
        """`read`'s checks without the copy: whether the slot serves `header` (a caller then reads
        the slot's row in place). Counts a read, a miss or a dropped corrupt slot as `read` does."""
        self.reads += 1
        stored = self.header(group, slot)
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
        if self._lost():
            return
        self._set_header(group, slot, None, bump=False)

    def move(self, group: int, src: int, dst: int, header: ChunkHeader) -> bool:
        """`SlotTier.move`: `holds` checks `src` (counted as a read, or a miss or corrupt drop),
        the row is copied inside `begin`/`commit` (a reader comparing `generation` never takes
        a half-copied `dst`), with the header `src` had (`header` or a wider span of it), and
        counted as a write. The caller holds both slots: no other writer touches them."""
        self._check(group, src, header.payload_bytes)
        self._check(group, dst)
        if src == dst:
            raise ValueError(f"move of group {group} slot {src} onto itself")
        stored = self.header(group, src) if self.holds(group, src, header) else None
        if stored is None:
            self.free(group, dst)
            self.free(group, src)
            return False
        n = header.payload_bytes
        row = self.begin(group, dst)  # a stand-in, counted failed, if the region was lost since
        row[:n].copy_(self.slabs[group][src, :n])
        self.commit(group, dst, stored)
        self.free(group, src)
        return self.region is None or not (self.region.lost or self.unreserved(group, dst))

    def release(self, group: int, slots: int) -> int:
        """`SlotTier.release`. Each slot's sequence number is odd while its bytes go and changed
        after (a copy taken across it is disowned), its header cleared, and the whole pages of the
        slab from slot `slots` on given back (`madvise(MADV_DONTNEED)`: they read as zeros and
        are committed again when written; in a host region the count of reserved slots falls at
        once and the pages are punched off this thread, `HostRegion.resize`, counted in
        `region.released_bytes`, and reserved again by `reserve`); the page holding slot
        `slots - 1`'s last bytes is kept. A page-locked slab (pinned, registered) only has its
        headers cleared; a learned share is not used with those. Returns the bytes of memory
        given back now (resident before, `mincore`; 0 for a region or a locked slab)."""
        self._check_release(group, slots)
        n, b = self.layout.num_slots[group], self.layout.slot_bytes[group]
        if slots == n or self._lost():
            return 0
        words = _table_words(self._tables[group], n)[slots:]
        seq = words[:, 0].clone()
        words[:, 0] = seq | 1  # odd: being rewritten
        words[:, 1:] = 0  # headers cleared: every read is a miss from here on
        fence()
        freed = 0
        if self.region is not None and not self.locked[group]:
            self.region.resize(group, slots)  # punched off this thread: `region.released_bytes`
        elif self.region is None and not self.locked[group] and _LIBC is not None:
            base = self.slabs[group].data_ptr()
            start = -(-(base + slots * b) // PAGE) * PAGE  # a kept slot's last page stays
            end = -(-(base + n * b) // PAGE) * PAGE  # the mapping's last page is the slab's own
            if end > start:
                freed = resident_in(start, end - start)
                if _LIBC.madvise(start, end - start, mmap.MADV_DONTNEED) != 0:
                    freed = 0
                    self._warnings.warn("release", f"tier cpu: madvise of group {group}'s slots from "
                                        f"{slots} failed (errno {ctypes.get_errno()}); headers cleared only")
        fence()
        words[:, 0] = (seq | 1) + 1  # even again, and not the number any chunk was committed at
        return freed

    def resident_bytes(self) -> int:
        """Bytes of the slabs in memory now, page by page (`mincore`): what the tier commits."""
        if self._lost():
            return 0
        return sum(resident_in(t.data_ptr(), t.numel()) for t in self.slabs if t.numel())

    def close(self) -> None:
        """Unregister the slabs this tier registered (their owner synchronized its copies)."""
        for fin in self._unregister:
            fin()

    def list(self) -> Iterator[tuple[int, int, ChunkHeader]]:
        for g, n in enumerate(self.layout.num_slots):
            for s in range(n):
                h = self.header(g, s)
                if h is not None:
                    yield g, s, h
