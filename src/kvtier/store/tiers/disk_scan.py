"""Directory scans of disk tiers for `kvtier inspect` / `kvtier check`: every slot under a root,
all namespaces, with what is wrong with it; no layout, no plan.

The tools read directories other people may have written to, so they trust nothing in them:
only kvtier's own namespace directories (16 hex digits, real directories) are read, only regular
files named like slabs are opened (`lstat` first, then `O_NOFOLLOW | O_NONBLOCK`, so a symlink
is never followed and a FIFO never blocks), anything else named like a slab is one line in the
report (`slot` -1), payloads are verified in bounded pieces (a header claiming gigabytes
allocates nothing), and `drop_slot` zeroes a header only where kvtier's magic is.

A scan reads each namespace directory through an fd opened relative to the root's fd without
following a link (`open_namespace_fds`), and records the `(st_dev, st_ino)` of every slab it
read. `kvtier check --fix` keeps those fds from the lock through the scan to the drop: the drop
opens the slab relative to the directory fd it scanned and zeroes nothing unless it is the same
inode. Reopening by path after the scan (the first design) let the cache's owner swap the
namespace directory for a symlink to another user's between scan and drop (`O_NOFOLLOW` guards
the last component only): `check --fix` run as root then zeroed a header in that user's cache.

A scan costs the slots a slab holds, not its length: holes are skipped (`SEEK_DATA`/`SEEK_HOLE`:
a header in a hole reads as zeros, an empty slot), and no slot past what the slab's file system
can hold is read. A disk tier sizes each slab to its capacity, which it must be able to fill, so
a slab longer than its file system (`truncate -s 1T`) was not sized by a tier; it is one
`Oversized` line, and the rest of it is ignored.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.units import human_bytes
from kvtier.errors import ConfigError
from kvtier.store.payload import (
    HEADER_BYTES,
    MAGIC,
    ChunkHeader,
    Rejected,
    StreamingChecksum,
    decode_header,
    unverifiable,
)
from kvtier.store.tiers.disk_files import (
    DATA_OFFSET,
    OPEN_FLAGS,
    SLAB_RE,
    ZERO_HEADER,
    kind_of,
    slot_stride,
)

NAMESPACE_RE = re.compile(r"^[0-9a-f]{16}$")
VERIFY_PIECE = 1 << 20  # bytes read at a time when a tool verifies a payload
SEEK_DATA: int | None = getattr(os, "SEEK_DATA", None)  # Linux, macOS, the BSDs
SEEK_HOLE: int | None = getattr(os, "SEEK_HOLE", None)


@dataclass(frozen=True, slots=True)
class SlotRecord:
    path: Path
    namespace_id: str
    group: int
    slot: int  # -1: the entry itself is wrong (not a regular file), no slot was read
    slot_bytes: int
    header: ChunkHeader | Rejected
    problem: str | None  # None: header valid (and payload verified when asked)
    file_id: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the slab read; `drop_slot` writes only it


@dataclass(frozen=True, slots=True)
class Oversized:
    """A slab file longer than its file system can hold: only its first `slots` slots are read."""

    path: Path
    namespace_id: str
    group: int
    slot_bytes: int
    file_bytes: int
    slots: int
    fs_bytes: int

    @property
    def read_bytes(self) -> int:
        return self.slots * slot_stride(self.slot_bytes)

    def message(self) -> str:
        return (f"{self.path.name}: {human_bytes(self.file_bytes)}, larger than the {self.slots} slots x "
                f"{human_bytes(slot_stride(self.slot_bytes))} its file system ({human_bytes(self.fs_bytes)}) "
                "can hold; the rest is ignored")

    def to_json(self) -> dict[str, object]:
        return {"namespace": self.namespace_id, "group": self.group, "file": self.path.name,
                "file_bytes": self.file_bytes, "read_bytes": self.read_bytes, "message": self.message()}


def slab_slots(fd: int, file_bytes: int, stride: int) -> tuple[int, int | None]:
    """(slots to read, the file system's bytes when the file is longer than it can hold, else
    None). A file system that reports no size bounds nothing."""
    slots = -(-file_bytes // stride)
    try:
        vfs = os.fstatvfs(fd)
    except OSError:
        return slots, None
    fs_bytes = vfs.f_blocks * vfs.f_frsize
    if fs_bytes <= 0 or slots * stride <= fs_bytes:
        return slots, None
    return max(1, fs_bytes // stride), fs_bytes


def scan_slab(fd: int, stride: int, slots: int) -> Iterator[tuple[int, ChunkHeader | Rejected]]:
    """(slot, decoded header) of every slot below `slots` whose header is not all zeros, reading
    only headers that lie in the file's data."""
    for s in _data_slots(fd, stride, slots):
        h = decode_header(os.pread(fd, HEADER_BYTES, s * stride))
        if isinstance(h, Rejected) and h.reason.startswith("empty slot"):
            continue
        yield s, h


def _data_slots(fd: int, stride: int, slots: int) -> Iterator[int]:
    """Slots below `slots` whose header overlaps the file's data, in order. A header in a hole
    reads as zeros, so holes are skipped by SEEK_DATA/SEEK_HOLE rather than read; where the file
    system cannot say (no SEEK_DATA, EINVAL, ENOTSUP), every slot is data."""
    end = slots * stride
    off = nxt = 0
    while off < end:
        try:
            if SEEK_DATA is None or SEEK_HOLE is None:
                raise OSError(errno.EINVAL, "no SEEK_DATA")
            data = os.lseek(fd, off, SEEK_DATA)
            hole = os.lseek(fd, data, SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data at or past `off`
                return
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            data, hole = off, end
        first = max(nxt, (data - HEADER_BYTES) // stride + 1)  # s * stride + HEADER_BYTES > data
        nxt = max(nxt, min(slots, -(-hole // stride)))  # s * stride < hole
        yield from range(first, nxt)
        off = hole



def namespace_dirs(root: Path) -> list[Path]:
    """kvtier's namespace directories under a disk tier root: real directories named by a
    namespace id. Anything else there is not kvtier's and is left alone."""
    out = []
    for p in sorted(root.iterdir()):
        try:
            if NAMESPACE_RE.match(p.name) and stat.S_ISDIR(os.lstat(p).st_mode):
                out.append(p)
        except OSError:
            continue
    return out


def open_namespace_fds(root: str | os.PathLike[str]) -> dict[str, int]:
    """{namespace id: directory fd} of kvtier's namespace directories under a disk tier root, each
    opened relative to the root's fd without following a link (a symlink or a non-directory is
    skipped). The caller closes them. Raises ConfigError when ROOT is not a directory."""
    try:
        rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        raise ConfigError(f"{str(root)!r} is not a directory; give a disk tier's root directory") from None
    out: dict[str, int] = {}
    try:
        for name in sorted(os.listdir(rfd)):
            if not NAMESPACE_RE.match(name):
                continue
            try:
                out[name] = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | OPEN_FLAGS, dir_fd=rfd)
            except OSError:  # ELOOP: a symlink; ENOTDIR: not a directory; not kvtier's
                continue
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    finally:
        os.close(rfd)
    return out


def scan_dir(root: str | os.PathLike[str], *, verify_payloads: bool = False,
             dir_fds: Mapping[str, int] | None = None,
             oversized: list[Oversized] | None = None) -> Iterator[SlotRecord]:
    """Every non-empty slot under ROOT (all namespaces), with what is wrong with it, if anything.
    `dir_fds` (from `open_namespace_fds`, kept by the caller, as `check --fix` does to drop
    through them): scan those directories; else they are opened and closed here. Slab files
    longer than their file system can hold are appended to `oversized`."""
    rootp = Path(root)
    if not rootp.is_dir():
        raise ConfigError(f"{str(root)!r} is not a directory; give a disk tier's root directory")
    fds = open_namespace_fds(rootp) if dir_fds is None else dir_fds
    try:
        for ns in sorted(fds):
            yield from _scan_namespace(rootp / ns, ns, fds[ns], verify_payloads, oversized)
    finally:
        if dir_fds is None:
            for fd in fds.values():
                os.close(fd)


def _scan_namespace(nsdir: Path, ns: str, dfd: int, verify_payloads: bool,
                    oversized: list[Oversized] | None) -> Iterator[SlotRecord]:
    try:
        names = sorted(os.listdir(dfd))
    except OSError:
        return
    for name in names:
        m = SLAB_RE.match(name)
        if not m:
            continue
        path = nsdir / name
        group, slot_bytes = int(m.group(1)), int(m.group(2))
        rejected = Rejected("not a slab")
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError as exc:
            yield SlotRecord(path, ns, group, -1, slot_bytes, rejected, f"unreadable ({exc.strerror})")
            continue
        if not stat.S_ISREG(st.st_mode):
            yield SlotRecord(path, ns, group, -1, slot_bytes, rejected,
                             f"{kind_of(st.st_mode)} named like a slab file; not kvtier's, left alone")
            continue
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS, dir_fd=dfd)
        except OSError as exc:
            yield SlotRecord(path, ns, group, -1, slot_bytes, rejected, f"unreadable ({exc.strerror})")
            continue
        try:
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode):  # swapped after the lstat
                yield SlotRecord(path, ns, group, -1, slot_bytes, rejected, "not a regular file")
                continue
            file_id = (fst.st_dev, fst.st_ino)
            stride = slot_stride(slot_bytes)
            slots, fs_bytes = slab_slots(fd, fst.st_size, stride)
            if fs_bytes is not None and oversized is not None:
                oversized.append(Oversized(path, ns, group, slot_bytes, fst.st_size, slots, fs_bytes))
            for s, h in scan_slab(fd, stride, slots):
                problem = _problem(fd, s * stride, fst.st_size, ns, group, slot_bytes, h, verify_payloads)
                yield SlotRecord(path, ns, group, s, slot_bytes, h, problem, file_id)
        except OSError as exc:
            yield SlotRecord(path, ns, group, -1, slot_bytes, rejected, f"read error ({exc.strerror})")
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
    if off + DATA_OFFSET + h.payload_bytes > size:
        return f"payload truncated: file ends {max(0, size - off - DATA_OFFSET)} bytes into the payload"
    if verify_payloads:
        return _verify_in_pieces(fd, off + DATA_OFFSET, h)
    return None


def _verify_in_pieces(fd: int, start: int, h: ChunkHeader) -> str | None:
    """The payload checksum read VERIFY_PIECE bytes at a time: memory stays bounded whatever the
    header claims."""
    why = unverifiable(h)
    if why is not None:
        return why
    summer = StreamingChecksum(h.checksum_kind)
    done = 0
    while done < h.payload_bytes:
        piece = os.pread(fd, min(VERIFY_PIECE, h.payload_bytes - done), start + done)
        if not piece:
            return f"payload truncated: {done} of {h.payload_bytes} bytes"
        summer.update(piece)
        done += len(piece)
    return None if summer.value() == h.checksum else "payload checksum mismatch"


def drop_slot(dir_fd: int, rec: SlotRecord) -> bool:
    """Zero the header of the slot `rec` names (`kvtier check --fix`): in the file opened relative
    to `dir_fd`, the namespace directory fd the scan read it through, only when that file is the
    inode the scan read (`rec.file_id`), and only where kvtier's magic is: a file kvtier did not
    write, or one swapped in since the scan, is never changed. Whether it zeroed anything."""
    if rec.slot < 0:
        return False
    try:
        fd = os.open(rec.path.name, os.O_RDWR | os.O_NONBLOCK | OPEN_FLAGS, dir_fd=dir_fd)
    except OSError:  # gone, or a symlink now: nothing of what was scanned to drop
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != rec.file_id:
            return False
        off = rec.slot * slot_stride(rec.slot_bytes)
        if os.pread(fd, len(MAGIC), off) != MAGIC:
            return False
        os.pwrite(fd, ZERO_HEADER, off)
        return True
    finally:
        os.close(fd)
