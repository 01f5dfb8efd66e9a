"""`kvtier inspect` and `kvtier check [--fix]` on directories other people wrote to: they read
only kvtier's own namespace directories and regular files, never follow a link, never block on a
FIFO, never allocate what a header claims, and `--fix` changes only kvtier's own slot headers.
Every odd entry is a line in the report, never a traceback or a hang. Each test runs the real CLI
in a subprocess with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvtier.store.payload import CHECKSUM_XXH3, encode_header, make_header

NS = "00112233aabbccdd"
PHOTO = b"\xff\xd8\xff\xe0JFIF" + bytes(range(256)) * 40  # not kvtier's: no magic anywhere


def kvtier(*args: str, timeout: float = 60, limit_as: int | None = None) -> subprocess.CompletedProcess:
    pre = ""
    if limit_as is not None:  # bound the address space: an allocation of what a header claims fails
        pre = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit_as}, {limit_as})); "
    code = pre + "import sys; from kvtier.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


def test_fix_never_writes_a_file_kvtier_did_not_write(tmp_path: Path) -> None:
    root = tmp_path / "root"
    nsdir = root / NS
    nsdir.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "photo.jpg"
    victim.write_bytes(PHOTO)
    os.symlink(victim, nsdir / "g000-100.kvslab")  # a link named like a slab
    (nsdir / "g001-100.kvslab").write_bytes(PHOTO)  # a foreign file named like a slab
    photos = root / "photos"  # a directory that is not a namespace, holding slab-like names
    photos.mkdir()
    (photos / "g000-100.kvslab").write_bytes(PHOTO)
    proc = kvtier("check", "--fix", "--json", str(root))
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert victim.read_bytes() == PHOTO
    assert (nsdir / "g001-100.kvslab").read_bytes() == PHOTO
    assert (photos / "g000-100.kvslab").read_bytes() == PHOTO
    assert not (photos / ".lock").exists() and not (nsdir / ".lock").exists()
    files = sorted(b["file"] for b in report["bad"])
    assert files[0] == "g000-100.kvslab" and "g001-100.kvslab" in files  # reported, never removed
    assert not any(b["removed"] for b in report["bad"]) and report["fixed"] == 0
    assert proc.returncode == 1


def test_odd_entries_are_report_lines_not_tracebacks_or_hangs(tmp_path: Path) -> None:
    nsdir = tmp_path / NS
    nsdir.mkdir(mode=0o700)
    (nsdir / "g000-4096.kvslab").mkdir()  # a directory named like a slab
    os.mkfifo(nsdir / "g001-4096.kvslab")  # a FIFO: opening it for reading would block
    os.symlink(tmp_path / "gone", nsdir / "g002-4096.kvslab")  # a dangling symlink
    for args in (("inspect", "--json", str(tmp_path)), ("check", "--json", str(tmp_path)),
                 ("check", "--fix", "--json", str(tmp_path))):
        proc = kvtier(*args, timeout=30)
        assert "Traceback" not in proc.stderr, (args, proc.stderr)
        out = json.loads(proc.stdout)
        bad = out["bad"] if isinstance(out["bad"], int) else len(out["bad"])
        assert bad == 3, (args, out)
    problems = " ".join(b["problem"] for b in json.loads(kvtier("check", "--json", str(tmp_path)).stdout)["bad"])
    assert "a directory named like a slab" in problems and "a FIFO" in problems and "a symlink" in problems


def test_check_verifies_a_huge_claimed_payload_in_bounded_memory(tmp_path: Path) -> None:
    """A sparse 1.5 GiB slab whose header claims a 1.5 GiB payload: verified piece by piece under a
    1 GiB address-space limit (reading it whole raised MemoryError)."""
    slot_bytes = 3 << 29
    nsdir = tmp_path / NS
    nsdir.mkdir(mode=0o700)
    path = nsdir / f"g000-{slot_bytes}.kvslab"
    h = make_header(NS, b"\x01" * 16, 0, 0, 16, slot_bytes)
    sealed = type(h)(**{**{f: getattr(h, f) for f in h.__slots__}, "checksum": 12345,
                        "checksum_kind": CHECKSUM_XXH3})
    with open(path, "wb") as f:
        f.write(encode_header(sealed))
        f.truncate(4096 + slot_bytes)  # sparse: no blocks used
    proc = kvtier("check", "--json", str(tmp_path), timeout=120, limit_as=1 << 30)
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert [b["problem"] for b in report["bad"]] == ["payload checksum mismatch"]
