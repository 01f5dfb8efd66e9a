"""`kvtier inspect DIR`: what a disk tier directory holds (namespaces, groups, chunks, bytes, age).

A slab longer than its file system can hold (`truncate -s 1T`) is one line, and its slots are
counted and read only as far as it could hold (`disk_scan.Oversized`)."""

from __future__ import annotations

import argparse
import json
import time

HELP = "show what a disk tier directory holds: namespaces, groups, chunks, bytes, age"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="the disk tier's root directory (disk_dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def lock_holder(nsdir: object) -> str | None:
    """The pid holding a namespace directory's writer lock, or None when nobody holds it."""
    from pathlib import Path

    from kvtier.store.tiers.disk_files import lock_holder as holder

    return holder(Path(str(nsdir)))


def summarize(root: str) -> dict[str, object]:
    import os
    import stat
    from pathlib import Path

    from kvtier.store.payload import ChunkHeader
    from kvtier.store.tiers.disk_files import SLAB_RE, slot_stride
    from kvtier.store.tiers.disk_scan import Oversized, namespace_dirs, scan_dir

    now = time.time_ns()
    spaces: dict[str, dict[str, object]] = {}
    for nsdir in namespace_dirs(Path(root)) if Path(root).is_dir() else ():
        groups = {}
        for f in sorted(nsdir.iterdir()):
            m = SLAB_RE.match(f.name)
            if m:
                g, sb = int(m.group(1)), int(m.group(2))
                st = os.lstat(f)
                size = st.st_size if stat.S_ISREG(st.st_mode) else 0  # odd entries: reported bad
                groups[(g, sb)] = {"group": g, "slot_bytes": sb, "file": f.name,
                                   "file_bytes": size,
                                   "slots_in_file": -(-size // slot_stride(sb)),
                                   "chunks": 0, "payload_bytes": 0, "bad": 0,
                                   "oldest_age_s": None, "newest_age_s": None}
        spaces[nsdir.name] = {"namespace": nsdir.name, "in_use_by_pid": lock_holder(nsdir), "groups": groups}
    oversized: list[Oversized] = []
    for rec in scan_dir(root, oversized=oversized):
        d = spaces[rec.namespace_id]["groups"][(rec.group, rec.slot_bytes)]  # type: ignore[index]
        if rec.problem is not None or not isinstance(rec.header, ChunkHeader):
            d["bad"] += 1
            continue
        d["chunks"] += 1
        d["payload_bytes"] += rec.header.payload_bytes
        age = max(0.0, (now - rec.header.created_ns) / 1e9)
        d["oldest_age_s"] = age if d["oldest_age_s"] is None else max(d["oldest_age_s"], age)
        d["newest_age_s"] = age if d["newest_age_s"] is None else min(d["newest_age_s"], age)
    for o in oversized:
        spaces[o.namespace_id]["groups"][(o.group, o.slot_bytes)]["slots_in_file"] = o.slots  # type: ignore[index]
    out_spaces = []
    for ns in spaces.values():
        gl = list(ns["groups"].values())  # type: ignore[union-attr]
        out_spaces.append({**ns, "groups": gl, "chunks": sum(g["chunks"] for g in gl),
                           "payload_bytes": sum(g["payload_bytes"] for g in gl),
                           "file_bytes": sum(g["file_bytes"] for g in gl), "bad": sum(g["bad"] for g in gl)})
    return {
        "root": str(root),
        "namespaces": out_spaces,
        "chunks": sum(n["chunks"] for n in out_spaces),
        "payload_bytes": sum(n["payload_bytes"] for n in out_spaces),
        "file_bytes": sum(n["file_bytes"] for n in out_spaces),
        "bad": sum(n["bad"] for n in out_spaces),
        "oversized": [o.to_json() for o in oversized],
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtier.errors import ConfigError

    if not Path(args.dir).is_dir():
        raise ConfigError(f"{args.dir!r} is not a directory; give a disk tier's root directory")
    info = summarize(args.dir)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{info['root']}: {len(info['namespaces'])} namespace(s), {info['chunks']} chunks, "
          f"{_human(info['payload_bytes'])} of payload in {_human(info['file_bytes'])} of files"
          + (f", {info['bad']} bad slot(s) (run `kvtier check --fix`)" if info["bad"] else ""))
    for o in info["oversized"]:  # type: ignore[attr-defined]
        print(f"namespace {o['namespace']} {o['message']}")
    for ns in info["namespaces"]:
        use = f"  in use by pid {ns['in_use_by_pid']}" if ns["in_use_by_pid"] else ""
        print(f"\nnamespace {ns['namespace']}{use}")
        print(f"  {'group':>5}  {'slot bytes':>12}  {'chunks':>7}  {'payload':>10}  {'oldest':>7}  {'newest':>7}  bad")
        for g in ns["groups"]:
            print(f"  {g['group']:>5}  {g['slot_bytes']:>12}  {g['chunks']:>7}  {_human(g['payload_bytes']):>10}  "
                  f"{_age(g['oldest_age_s']):>7}  {_age(g['newest_age_s']):>7}  {g['bad']}")
    return 0
