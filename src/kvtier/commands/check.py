"""`kvtier check DIR [--fix]`: verify every slot's header and payload checksum in a disk tier.

Exit 0 when every slot is good (or every bad one was removed with --fix), 1 when bad slots
remain. --fix takes each namespace's writer lock, so it refuses to touch a directory a live
process is writing (stop it first); without --fix nothing is written. It locks, scans and drops
through the same namespace directory fds (`disk_scan.open_namespace_fds`), and a drop zeroes a
header only in the inode the scan read: run as root over a cache another user owns, it never
writes through a directory or file that user swapped in after the scan. A slab longer than its
file system can hold (`truncate -s 1T`) is one line, and read only as far as it could hold; it
does not change the exit code (a disk tier that opens it cuts it back to its capacity).
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "verify every checksum of a disk tier directory; --fix removes the bad slots"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="the disk tier's root directory (disk_dir)")
    p.add_argument("--fix", action="store_true", help="remove the bad slots (zero their headers)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from kvtier.errors import ConfigError, KvtierError
    from kvtier.store.tiers.disk_files import lock_for_tools, lock_holder
    from kvtier.store.tiers.disk_scan import Oversized, drop_slot, open_namespace_fds, scan_dir

    root = Path(args.dir)
    if not root.is_dir():
        raise ConfigError(f"{args.dir!r} is not a directory; give a disk tier's root directory")
    checked = 0
    bad = []
    fixed = 0
    removed: set[int] = set()
    oversized: list[Oversized] = []
    # one fd per namespace directory, from the lock through the scan to the drop: a directory
    # swapped for a symlink after the scan is never written through (reopening by path was)
    dir_fds = open_namespace_fds(root)
    try:
        if args.fix:  # lock every namespace before scanning: no writer changes what --fix saw
            for ns, dfd in dir_fds.items():
                if not lock_for_tools(dfd):
                    raise KvtierError(
                        f"namespace {ns} in {args.dir} is in use by pid {lock_holder(root / ns) or '?'}; "
                        "stop that process before `kvtier check --fix` (or run without --fix)")
        for rec in scan_dir(root, verify_payloads=True, dir_fds=dir_fds, oversized=oversized):
            checked += 1
            if rec.problem is not None:
                bad.append(rec)
        if args.fix:
            for rec in bad:  # entries that are not kvtier's slots are reported, never touched
                if drop_slot(dir_fds[rec.namespace_id], rec):
                    removed.add(id(rec))
            fixed = len(removed)
    finally:
        for fd in dir_fds.values():
            os.close(fd)  # releases the locks
    report = {
        "root": str(root),
        "checked": checked,
        "bad": [{"namespace": r.namespace_id, "group": r.group, "slot": r.slot, "file": r.path.name,
                 "problem": r.problem, "removed": id(r) in removed} for r in bad],
        "fixed": fixed,
        "oversized": [o.to_json() for o in oversized],
    }
    if args.json:
        print(json.dumps(report))
    else:
        for o in oversized:
            print(f"namespace {o.namespace_id} {o.message()}")
        for r in bad:
            print(f"bad: namespace {r.namespace_id} group {r.group} slot {r.slot} ({r.path.name}): {r.problem}"
                  + ((" -> removed" if id(r) in removed else " -> left alone (not a kvtier slot)") if args.fix else ""))
        print(f"{checked} slot(s) checked, {len(bad)} bad" + (f", {fixed} removed" if args.fix else ""))
        if bad and not args.fix:
            print("run `kvtier check --fix DIR` to remove the bad slots", file=sys.stderr)
    return 0 if not bad or fixed == len(bad) else 1
