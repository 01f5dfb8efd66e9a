"""Start-up adoption of what a previous engine left in the disk tier (the manager's index).

Not the Store's rebuild (store/store.py `_rebuild`), on purpose: the two read the same files
but decide differently, and one function would change one of them.
- The scheduler owns no bytes: it reads the directory with `disk_scan.scan_dir` (no torch, no
  tier opened) and never frees a slot it rejects (the worker's disk tier, which owns the files,
  overwrites it when its slot is handed out). The Store owns its DiskTier and frees what its
  index refuses.
- With tensor parallel, a chunk here is adopted only where every rank's file names it at that
  slot (each rank writes its own shard under its own namespace); the Store has one rank.
- Validation: here a record must be of this plan's cacheable group with its chunk size (another
  chunk size is another plan's slab); the Store checks the header's token span and dtype too,
  for payloads it wrote itself with those fields.
- A reset is durable: `mark_reset` writes the time of the reset into the disk directory, and a
  record written before it is not adopted (the reset dropped it; a restart must not bring it back).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from kvtier.index.index import Index

from .common import SpecContext
from .counters import Metrics

log = logging.getLogger("kvtier.vllm")


def rebuild_from_disk(ctx: SpecContext, index: Index, metrics: Metrics) -> int:
    """Adopt into `index` what a previous process left in the disk tier (same namespace and
    layout), oldest first; the number of chunks adopted (also counted `rebuilt_chunks`)."""
    root = ctx.disk_root
    if root is None or not root.is_dir():
        return 0
    from kvtier.store.tiers.disk_scan import scan_dir  # no torch

    ns = ctx.namespace
    reset_ns = reset_time(root)
    ranks: dict[str, dict] = {i: {} for i in ctx.rank_namespace_ids()}  # (group, slot) -> hash
    found: list[tuple[int, bytes, int, int]] = []
    for rec in scan_dir(root):
        h = rec.header
        if rec.namespace_id not in ranks or rec.problem is not None or isinstance(h, str):
            continue
        g = rec.group
        if g >= len(ctx.plan.groups) or not ctx.plan.groups[g].cacheable:
            continue
        if rec.slot_bytes != ctx.plan.groups[g].chunk_bytes:
            continue  # another chunk size: another plan's slab
        if h.created_ns <= reset_ns:  # type: ignore[union-attr]
            continue  # written before a reset that dropped it
        ranks[rec.namespace_id][(g, rec.slot)] = h.chunk_hash  # type: ignore[union-attr]
        if rec.namespace_id == ns.id:
            found.append((h.created_ns, h.chunk_hash, g, rec.slot))  # type: ignore[union-attr]
    found = [f for f in found if all(held.get((f[2], f[3])) == f[1] for held in ranks.values())]
    found.sort()
    rejected = index.rebuild((h, g, "disk", s) for _, h, g, s in found)
    adopted = len(found) - len(rejected)
    metrics.add("rebuilt_chunks", adopted)
    log.info("kvtier: adopted %d chunks from %s", adopted, root)
    return adopted


RESET_FILE = "reset-ns"  # in the disk directory: the wall-clock time of the last reset, in ns


def mark_reset(root: Path | None) -> None:
    """A reset dropped every chunk: records written until now are never adopted again. Written
    atomically (a rename) and durably (the file and the directory fsynced), so a crash leaves
    the old mark or the new one. An I/O error is logged, never raised into vLLM's reset (the
    reset itself happened)."""
    if root is None or not root.is_dir():
        return
    tmp = root / f".{RESET_FILE}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, f"{time.time_ns()}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, root / RESET_FILE)
        dfd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        log.warning("kvtier: the reset could not be marked in %s (%s): a restart may adopt chunks it dropped", root, e)


def reset_time(root: Path) -> int:
    """The time `mark_reset` wrote, 0 when none (or unreadable: nothing is refused then)."""
    try:
        return int((root / RESET_FILE).read_text().strip())
    except (OSError, ValueError):
        return 0
