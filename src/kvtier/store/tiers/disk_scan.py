"""Directory scans of disk tiers for `kvtier inspect` / `kvtier check`: every slot under a root,
all namespaces, with what is wrong with it; no layout, no plan, no writer lock."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.store.payload import ChunkHeader, Rejected, verify
from kvtier.store.tiers.disk_files import DATA_OFFSET, SLAB_RE, ZERO_HEADER, scan_fd, slot_stride


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
            m = SLAB_RE.match(path.name)
            if not m:
                continue
            group, slot_bytes = int(m.group(1)), int(m.group(2))
            stride = slot_stride(slot_bytes)
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                for s, h in scan_fd(fd, stride, None):
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
    if off + DATA_OFFSET + h.payload_bytes > size:
        return f"payload truncated: file ends {max(0, size - off - DATA_OFFSET)} bytes into the payload"
    if verify_payloads:
        data = os.pread(fd, h.payload_bytes, off + DATA_OFFSET)
        return verify(h, data)
    return None


def drop_slot(path: Path, slot: int, slot_bytes: int) -> None:
    """Zero one slot's header (used by `kvtier check --fix`)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, ZERO_HEADER, slot * slot_stride(slot_bytes))
    finally:
        os.close(fd)
