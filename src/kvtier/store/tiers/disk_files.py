"""The disk tier's slab files: names, strides, the namespace directory and its writer lock,
opening and sizing slab files, read-only mappings and page residency.

Files: `ROOT/<namespace id>/g<group>-<slot bytes>.kvslab`. Slot s of a file starts at
`s * stride` (stride = one 4 KiB page for the 128-byte payload header, then the slot bytes
rounded up to 4 KiB) and holds the header, zero padding, and the payload from `DATA_OFFSET`
on. The slot size is in the file name, so a restart with another plan never reads a slab with
the wrong stride, and `kvtier inspect`/`check` (`disk_scan`) read a directory without a plan.

One writer per namespace directory: `open_namespace_dir` takes an exclusive `flock` on
`<namespace dir>/.lock` and raises `TierError` naming the holder when another process (or another
tier in this process) has it. The kernel drops the lock when its process dies, even by SIGKILL.
A directory that cannot be written (read-only file system) opens read-only.

Split out of `disk.py` (which keeps the read and write paths) because managing files is its own
job; `disk_scan.py` is the third (directory scans for the tools).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import re
from collections.abc import Iterator
from pathlib import Path

from kvtier.errors import TierError
from kvtier.store.payload import HEADER_BYTES, ChunkHeader, Rejected, decode_header
from kvtier.store.tiers.base import TierLayout, log

ALIGN_BYTES = 4096
DATA_OFFSET = ALIGN_BYTES  # a slot's payload starts one page in: page-aligned in file and page cache
ZERO_HEADER = bytes(HEADER_BYTES)
PAD = bytearray(DATA_OFFSET - HEADER_BYTES)  # preadv's sink for the padding (contents unused)
SLAB_RE = re.compile(r"^g(\d+)-(\d+)\.kvslab$")


def _load_mincore():  # type: ignore[no-untyped-def]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):  # pragma: no cover - not Linux/BSD
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _load_mincore()
_PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(b & 1 for b in range(256))

Mapping = tuple[mmap.mmap, memoryview, int]  # the map, a view of it, its base address


def slot_stride(slot_bytes: int) -> int:
    return DATA_OFFSET + -(-slot_bytes // ALIGN_BYTES) * ALIGN_BYTES


def slab_name(group: int, slot_bytes: int) -> str:
    return f"g{group:03d}-{slot_bytes}.kvslab"


def open_namespace_dir(path: Path) -> tuple[int | None, str | None]:
    """Create `path` if needed and take its writer lock: (lock fd, None), or (None, why it is
    read-only) where the directory exists but cannot be written. Raises `TierError` when another
    writer holds the lock or the directory can be neither created nor read."""
    lock_fd: int | None = None
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise TierError(f"disk tier cannot use {str(path)!r}: {exc.strerror}") from None
        if not path.is_dir():
            raise TierError(f"disk tier directory {str(path)!r} does not exist and cannot be created: {exc.strerror}") from None
        return None, f"{path} is read-only ({exc.strerror}); saves will fail"
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(lock_fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(lock_fd)
        raise TierError(
            f"disk tier directory {str(path)!r} is in use by another writer (pid {holder}); "
            "kvtier allows one writer per namespace directory: give each process its own "
            "directory, or stop the other one"
        ) from None
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
    return lock_fd, None


def open_slabs(path: Path, layout: TierLayout, strides: list[int], read_only: bool) -> list[int | None]:
    """One fd per group (None: no slots, or absent in a read-only directory), each file sized to
    its capacity (sparse), so every slot lies inside the file and inside its mapping."""
    flags = os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT
    old = sorted(p.name for p in path.glob("g*-*.slab")) if path.is_dir() else []
    if old:  # the layout before payloads were page-aligned: never read, only in the way
        log.warning("tier disk: %s holds %d slab file(s) of an older kvtier layout (%s%s), which this "
                    "version ignores; delete them to free the space", path, len(old),
                    ", ".join(old[:3]), ", ..." if len(old) > 3 else "")
    fds: list[int | None] = []
    for g, (b, n) in enumerate(zip(layout.slot_bytes, layout.num_slots)):
        slab = path / slab_name(g, b)
        if n == 0 or (read_only and not slab.exists()):
            fds.append(None)
            continue
        fd = os.open(slab, flags, 0o644)
        size = os.fstat(fd).st_size
        if not read_only and size > n * strides[g]:
            os.ftruncate(fd, n * strides[g])  # capacity shrank: slots past it are gone
        elif not read_only and size < n * strides[g]:
            # new or grown: a sparse tail (no blocks used). Where the file may not grow (a file
            # size limit), it grows as slots are written and slots past its size are read with
            # preadv.
            try:
                os.ftruncate(fd, n * strides[g])
            except OSError as exc:
                log.warning("tier disk: cannot size %s to %d bytes (%s); slots past %d bytes are "
                            "read without the mapping", slab, n * strides[g], exc.strerror, size)
        fds.append(fd)
    return fds


def map_file(fd: int) -> Mapping | None:
    """A read-only shared mapping of the whole file, or None (no mincore, empty file, no mmap)."""
    if _MINCORE is None:
        return None
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    try:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError):  # a file system without mmap: the preadv path only
        return None
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch
        mm.close()
        return None
    view = memoryview(mm)
    return mm, view, int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def unmap(m: Mapping) -> None:
    m[1].release()
    try:
        m[0].close()
    except BufferError:  # pragma: no cover - a view still exported: freed with it
        pass


def resident(base: int, off: int, length: int) -> bool:
    """Whether every page of [off, off + length) of the mapping at `base` is in the page cache."""
    start = (base + off) // _PAGE * _PAGE
    end = base + off + length
    pages = -(-(end - start) // _PAGE)
    vec = ctypes.create_string_buffer(pages)
    if _MINCORE(start, end - start, vec) != 0:
        return False
    # bit 0 of each byte: page resident; the other bits are reserved
    return b"\0" not in vec.raw[:pages].translate(_LOW_BIT)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    total = len(view)
    while done < total:
        wrote = os.pwrite(fd, view[done:], offset + done)
        if wrote <= 0:
            raise OSError(errno.EIO, "short write")
        done += wrote


def scan_fd(fd: int, stride: int, max_slots: int | None) -> Iterator[tuple[int, ChunkHeader | Rejected]]:
    """(slot, decoded header) of every slot of a slab file whose header is not all zeros."""
    size = os.fstat(fd).st_size
    count = -(-size // stride)
    if max_slots is not None:
        count = min(count, max_slots)
    for s in range(count):
        raw = os.pread(fd, HEADER_BYTES, s * stride)
        h = decode_header(raw)
        if isinstance(h, Rejected) and h.reason.startswith("empty slot"):
            continue
        yield s, h
