"""The disk tier: per-group slab files of fixed-size slots, header + checksum per slot.

Files: `ROOT/<namespace id>/g<group>-<slot bytes>.slab`. Slot s of a file starts at
`s * stride` (stride = 128-byte header + slot bytes, rounded up to 4 KiB) and holds the payload
header (`kvtier.payload`) followed by the payload. The slot size is in the file name, so a
restart with another plan (another chunk size) never reads a slab with the wrong stride, and
`kvtier inspect`/`check` read a directory without knowing the plan.

Write then publish: the payload is written first, then the header, whose checksum covers the
payload (fsync="always": one fdatasync after both, so a write is durable when it returns);
`free` zeroes the header. A crash at any point
leaves each slot either with its old header (whose checksum no longer matches a half-written
payload: a counted miss), with no header (a plain miss), or complete. Nothing reads back valid
but wrong; fsync only decides what survives a power loss, not what a process kill can do.

I/O is buffered `os.pwritev`/`os.preadv` straight from/into the caller's buffer (a memoryview
of its tensor): no intermediate copy, one syscall for header + payload on reads. Rejected:
O_DIRECT (needs aligned buffers the engine does not give us; the page cache is the point for
a cache re-read soon after it is written).

One writer per namespace directory: the constructor takes an exclusive `flock` on
`<namespace dir>/.lock` and raises `TierError` naming the holder when another process (or
another tier in this process) has it. The kernel drops the lock when its process dies, even by
SIGKILL, so a restart reopens the directory at once. Processes with different namespaces
(tensor-parallel ranks, other models) share one ROOT freely. A directory that cannot be
written (read-only file system) opens read-only: reads work, every write is a counted failure.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError, TierError
from kvtier.payload import (
    HEADER_BYTES,
    ChunkHeader,
    Rejected,
    as_bytes_view,
    decode_header,
    encode_header,
    mismatch,
    seal,
    verify,
)
from kvtier.tiers.base import SlotTier, TierLayout, log

FSYNC_POLICIES = ("never", "always")
ALIGN_BYTES = 4096
_ZERO_HEADER = bytes(HEADER_BYTES)
_SLAB_RE = re.compile(r"^g(\d+)-(\d+)\.slab$")


def slot_stride(slot_bytes: int) -> int:
    return -(-(HEADER_BYTES + slot_bytes) // ALIGN_BYTES) * ALIGN_BYTES


def slab_name(group: int, slot_bytes: int) -> str:
    return f"g{group:03d}-{slot_bytes}.slab"


class DiskTier(SlotTier):
    name = "disk"
    persistent = True

    def __init__(
        self, root: str | os.PathLike[str], layout: TierLayout, namespace_id: str, *,
        fsync: str = "never",
    ) -> None:
        super().__init__(layout)
        if fsync not in FSYNC_POLICIES:
            raise ConfigError(f"disk fsync policy {fsync!r} unknown; use one of: {', '.join(FSYNC_POLICIES)}")
        if not re.fullmatch(r"[0-9a-f]{16}", namespace_id):
            raise ConfigError(f"namespace id {namespace_id!r} must be 16 hex digits (keys.Namespace.id)")
        self.fsync = fsync
        self.namespace_id = namespace_id
        self.root = Path(root)
        self.dir = self.root / namespace_id
        self.strides = [slot_stride(b) for b in layout.slot_bytes]
        self.read_only = False
        self._lock_fd: int | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise TierError(f"disk tier cannot use {str(self.dir)!r}: {exc.strerror}") from None
            if not self.dir.is_dir():
                raise TierError(f"disk tier directory {str(self.dir)!r} does not exist and cannot be created: {exc.strerror}") from None
            self.read_only = True
            self.last_error = f"{self.dir} is read-only ({exc.strerror}); saves will fail"
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(self._lock_fd)
                self._lock_fd = None
                raise TierError(
                    f"disk tier directory {str(self.dir)!r} is in use by another writer (pid {holder}); "
                    "kvtier allows one writer per namespace directory: give each process its own "
                    "directory, or stop the other one"
                ) from None
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        flags = os.O_RDONLY if self.read_only else os.O_RDWR | os.O_CREAT
        self._fds: list[int | None] = []
        for g, (b, n) in enumerate(zip(layout.slot_bytes, layout.num_slots)):
            path = self.dir / slab_name(g, b)
            if n == 0 or (self.read_only and not path.exists()):
                self._fds.append(None)
                continue
            fd = os.open(path, flags, 0o644)
            if not self.read_only and os.fstat(fd).st_size > n * self.strides[g]:
                os.ftruncate(fd, n * self.strides[g])  # capacity shrank: slots past it are gone
            self._fds.append(fd)

    # -- contract ------------------------------------------------------------------------
    def write(self, group: int, slot: int, header: ChunkHeader, data: object) -> bool:
        n = header.payload_bytes
        self._check(group, slot, n)
        src = as_bytes_view(data)
        if len(src) != n:
            raise ValueError(f"data has {len(src)} bytes, header says {n}")
        fd = self._fds[group]
        if self.read_only or fd is None:
            return self._failed_write(group, slot, self.last_error or "read-only directory")
        off = slot * self.strides[group]
        sealed = seal(header, src)
        try:
            _pwrite_all(fd, src, off + HEADER_BYTES)
            os.pwrite(fd, encode_header(sealed), off)  # publish
            if self.fsync == "always":
                # one flush, not one per write: until it returns, a power loss may persist the
                # header without the payload, which the checksum turns into a miss
                os.fdatasync(fd)
        except OSError as exc:
            try:  # best effort: never leave an old header over a half-new payload
                os.pwrite(fd, _ZERO_HEADER, off)
            except OSError:
                pass
            return self._failed_write(group, slot, f"{exc.strerror} ({exc.errno})")
        self.writes += 1
        self.bytes_written += n
        return True

    def read(self, group: int, slot: int, header: ChunkHeader, out: object) -> bool:
        self._check(group, slot)
        self.reads += 1
        fd = self._fds[group]
        n = header.payload_bytes
        dst = as_bytes_view(out)[:n]
        if fd is None:
            self.misses += 1
            return False
        hbuf = bytearray(HEADER_BYTES)  # per call: reads from several threads stay independent
        try:
            got = os.preadv(fd, [hbuf, dst], slot * self.strides[group])
        except OSError as exc:
            return self._drop_corrupt(group, slot, f"read error: {exc.strerror}")
        if got == 0:
            self.misses += 1
            return False
        stored = decode_header(hbuf if got >= HEADER_BYTES else hbuf[:got])
        if isinstance(stored, Rejected):
            if stored.reason.startswith("empty slot"):
                self.misses += 1
                return False
            return self._drop_corrupt(group, slot, stored.reason)
        why = mismatch(stored, header)
        if why is None and got < HEADER_BYTES + n:
            why = f"payload truncated: {got - HEADER_BYTES} of {n} bytes"
        if why is None:
            why = verify(stored, dst)
        if why is not None:
            return self._drop_corrupt(group, slot, why)
        self.bytes_read += n
        return True

    def free(self, group: int, slot: int) -> None:
        self._check(group, slot)
        fd = self._fds[group]
        if fd is None or self.read_only:
            return
        try:
            os.pwrite(fd, _ZERO_HEADER, slot * self.strides[group])
        except OSError:
            pass  # a slot we cannot zero still fails its header/checksum checks on read

    def list(self) -> Iterator[tuple[int, int, ChunkHeader]]:
        """Valid headers of this namespace in the current layout, oldest first.

        A slot whose header is bad (torn, flipped, newer format, another namespace or group)
        is dropped as it is found and counted in `corrupt_dropped`: a restart cleans up.
        """
        found: list[tuple[int, int, int, ChunkHeader]] = []
        for g, fd in enumerate(self._fds):
            if fd is None:
                continue
            for s, h in _scan_fd(fd, self.strides[g], self.layout.num_slots[g]):
                if isinstance(h, Rejected):
                    why: str | None = h.reason
                elif h.namespace_id != self.namespace_id:
                    why = f"foreign namespace {h.namespace_id}"
                elif h.group != g:
                    why = f"group {h.group} in group {g}'s file"
                else:
                    why = None
                if why is not None:
                    self.corrupt_dropped += 1
                    log.warning("tier disk: dropped group %d slot %d at scan: %s", g, s, why)
                    self.free(g, s)
                    continue
                found.append((h.created_ns, g, s, h))
        found.sort(key=lambda t: (t[0], t[1], t[2]))
        for _, g, s, h in found:
            yield g, s, h

    def close(self) -> None:
        for fd in self._fds:
            if fd is not None:
                os.close(fd)
        self._fds = [None] * len(self._fds)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    total = len(view)
    while done < total:
        wrote = os.pwrite(fd, view[done:], offset + done)
        if wrote <= 0:
            raise OSError(errno.EIO, "short write")
        done += wrote


def _scan_fd(fd: int, stride: int, max_slots: int | None) -> Iterator[tuple[int, ChunkHeader | Rejected]]:
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


# -- directory scans for `kvtier inspect` / `kvtier check` (no layout, no lock needed) -------
@dataclass(frozen=True, slots=True)
class SlotRecord:
    path: Path
    namespace_id: str
    group: int
    slot: int
    slot_bytes: int
    header: ChunkHeader | Rejected
    problem: str | None  # None: header valid (and payload verified when asked)


def scan_dir(root: str | os.PathLike[str], *, verify_payloads: bool = False) -> Iterator[SlotRecord]:
    """Every non-empty slot under ROOT (all namespaces), with what is wrong with it, if anything."""
    rootp = Path(root)
    if not rootp.is_dir():
        raise ConfigError(f"{str(root)!r} is not a directory; give a disk tier's root directory")
    for nsdir in sorted(p for p in rootp.iterdir() if p.is_dir()):
        for path in sorted(nsdir.iterdir()):
            m = _SLAB_RE.match(path.name)
            if not m:
                continue
            group, slot_bytes = int(m.group(1)), int(m.group(2))
            stride = slot_stride(slot_bytes)
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                for s, h in _scan_fd(fd, stride, None):
                    problem = _problem(fd, s * stride, size, nsdir.name, group, slot_bytes, h, verify_payloads)
                    yield SlotRecord(path, nsdir.name, group, s, slot_bytes, h, problem)
            finally:
                os.close(fd)


def _problem(fd: int, off: int, size: int, ns: str, group: int, slot_bytes: int,
             h: ChunkHeader | Rejected, verify_payloads: bool) -> str | None:
    if isinstance(h, Rejected):
        return h.reason
    if h.namespace_id != ns:
        return f"foreign namespace {h.namespace_id} in directory {ns}"
    if h.group != group:
        return f"group {h.group} in group {group}'s file"
    if h.payload_bytes > slot_bytes:
        return f"{h.payload_bytes} payload bytes exceed the slot's {slot_bytes}"
    if off + HEADER_BYTES + h.payload_bytes > size:
        return f"payload truncated: file ends {size - off - HEADER_BYTES} bytes into the payload"
    if verify_payloads:
        data = os.pread(fd, h.payload_bytes, off + HEADER_BYTES)
        return verify(h, data)
    return None


def drop_slot(path: Path, slot: int, slot_bytes: int) -> None:
    """Zero one slot's header (used by `kvtier check --fix`)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, _ZERO_HEADER, slot * slot_stride(slot_bytes))
    finally:
        os.close(fd)
