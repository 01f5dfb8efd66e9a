"""Directory scans of disk tiers for `kvtier inspect` / `kvtier check`: every slot under a root,
all namespaces, with what is wrong with it; no layout, no plan.

The tools read directories other people may have written to, so they trust nothing in them:
only kvtier's own namespace directories (16 hex digits, real directories) are read, only regular
files named like slabs are opened (`lstat` first, then `O_NOFOLLOW | O_NONBLOCK`, so a symlink
is never followed and a FIFO never blocks), anything else named like a slab is one line in the
report (`slot` -1), payloads are verified in bounded pieces (a header claiming gigabytes
allocates nothing), and `drop_slot` zeroes a header only where kvtier's magic is.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.store.payload import MAGIC, ChunkHeader, Rejected, StreamingChecksum, unverifiable
from kvtier.store.tiers.disk_files import DATA_OFFSET, OPEN_FLAGS, SLAB_RE, ZERO_HEADER, scan_fd, slot_stride

NAMESPACE_RE = re.compile(r"^[0-9a-f]{16}$")
VERIFY_PIECE = 1 << 20  # bytes read at a time when a tool verifies a payload


@dataclass(frozen=True, slots=True)
class SlotRecord:
    path: Path
    namespace_id: str
    group: int
    slot: int  # -1: the entry itself is wrong (not a regular file), no slot was read
    slot_bytes: int
    header: ChunkHeader | Rejected
    problem: str | None  # None: header valid (and payload verified when asked)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


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


def scan_dir(root: str | os.PathLike[str], *, verify_payloads: bool = False) -> Iterator[SlotRecord]:
    """Every non-empty slot under ROOT (all namespaces), with what is wrong with it, if anything."""
    rootp = Path(root)
    if not rootp.is_dir():
        raise ConfigError(f"{str(root)!r} is not a directory; give a disk tier's root directory")
    for nsdir in namespace_dirs(rootp):
        try:
            entries = sorted(nsdir.iterdir())
        except OSError:
            continue
        for path in entries:
            m = SLAB_RE.match(path.name)
            if not m:
                continue
            group, slot_bytes = int(m.group(1)), int(m.group(2))
            rejected = Rejected("not a slab")
            try:
                st = os.lstat(path)
            except OSError as exc:
                yield SlotRecord(path, nsdir.name, group, -1, slot_bytes, rejected, f"unreadable ({exc.strerror})")
                continue
            if not stat.S_ISREG(st.st_mode):
                yield SlotRecord(path, nsdir.name, group, -1, slot_bytes, rejected,
                                 f"{_kind(st.st_mode)} named like a slab file; not kvtier's, left alone")
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
            except OSError as exc:
                yield SlotRecord(path, nsdir.name, group, -1, slot_bytes, rejected, f"unreadable ({exc.strerror})")
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped after the lstat
                    yield SlotRecord(path, nsdir.name, group, -1, slot_bytes, rejected, "not a regular file")
                    continue
                stride = slot_stride(slot_bytes)
                size = os.fstat(fd).st_size
                for s, h in scan_fd(fd, stride, None):
                    problem = _problem(fd, s * stride, size, nsdir.name, group, slot_bytes, h, verify_payloads)
                    yield SlotRecord(path, nsdir.name, group, s, slot_bytes, h, problem)
            except OSError as exc:
                yield SlotRecord(path, nsdir.name, group, -1, slot_bytes, rejected, f"read error ({exc.strerror})")
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


def drop_slot(path: Path, slot: int, slot_bytes: int) -> bool:
    """Zero one slot's header (`kvtier check --fix`), only where kvtier's magic is: a file kvtier
    did not write is never changed. Whether it zeroed anything."""
    if slot < 0:
        return False
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        off = slot * slot_stride(slot_bytes)
        if os.pread(fd, len(MAGIC), off) != MAGIC:
            return False
        os.pwrite(fd, ZERO_HEADER, off)
        return True
    finally:
        os.close(fd)
