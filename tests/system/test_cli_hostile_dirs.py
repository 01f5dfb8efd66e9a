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


# -- issue 28, item 3: `check --fix` as root zeroed a header in a directory swapped in mid-run ----
def _one_slot_tier(root: Path, corrupt: bool) -> Path:
    """root/NS with one chunk in slot 0 of group 0 (its payload flipped when `corrupt`); the slab."""
    import torch

    from kvtier.store.tiers.base import TierLayout
    from kvtier.store.tiers.disk import DiskTier
    from kvtier.store.tiers.disk_files import DATA_OFFSET, slab_name

    tier = DiskTier(root, TierLayout(slot_bytes=(4096,), num_slots=(2,)), NS)
    assert tier.write(0, 0, make_header(NS, b"\x09" * 16, 0, 0, 16, 4096), torch.ones(4096, dtype=torch.uint8))
    tier.close()
    slab = root / NS / slab_name(0, 4096)
    if corrupt:
        buf = bytearray(slab.read_bytes())
        buf[DATA_OFFSET + 7] ^= 0xFF
        slab.write_bytes(bytes(buf))
    return slab


def _check_fix_with_swap(monkeypatch, capsys, root: Path, swap) -> dict:  # type: ignore[no-untyped-def]
    """Run `kvtier check --fix` in this process; `swap()` runs once, after the scan and before the
    first drop (the window a local user races for)."""
    import kvtier.store.tiers.disk_scan as disk_scan
    from kvtier.cli import main

    real = disk_scan.drop_slot
    swapped: list[bool] = []

    def drop_after_swap(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not swapped:
            swap()
            swapped.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(disk_scan, "drop_slot", drop_after_swap)
    main(["check", "--fix", "--json", str(root)])
    assert swapped, "the scan found nothing to drop"
    return json.loads(capsys.readouterr().out)


def test_fix_never_zeroes_through_a_directory_swapped_in_after_the_scan(tmp_path: Path, monkeypatch, capsys) -> None:
    """The cache's owner swaps its namespace directory for a symlink to another user's once the
    scan is done: root's drop reopened the slab by path and followed the directory link
    (`O_NOFOLLOW` guards the last component only), zeroing the victim's valid header."""
    root, victim = tmp_path / "cache", tmp_path / "victim"
    mine = _one_slot_tier(root, corrupt=True)
    theirs = _one_slot_tier(victim, corrupt=False)
    before = theirs.read_bytes()

    def swap() -> None:
        os.rename(root / NS, root / "scanned")
        os.symlink(victim / NS, root / NS)

    report = _check_fix_with_swap(monkeypatch, capsys, root, swap)
    assert theirs.read_bytes() == before  # the victim's chunk is untouched
    assert [b["problem"] for b in report["bad"]] == ["payload checksum mismatch"]
    # what was scanned (now renamed) is what --fix dropped
    assert (root / "scanned" / mine.name).read_bytes()[:4] == bytes(4) and report["fixed"] == 1


def test_fix_never_zeroes_a_file_swapped_in_after_the_scan(tmp_path: Path, monkeypatch, capsys) -> None:
    """The slab itself replaced by a hard link to another user's slab (root may link any file):
    the drop compares the inode it opens with the one it scanned."""
    root, victim = tmp_path / "cache", tmp_path / "victim"
    mine = _one_slot_tier(root, corrupt=True)
    theirs = _one_slot_tier(victim, corrupt=False)
    before = theirs.read_bytes()

    def swap() -> None:
        os.unlink(mine)
        os.link(theirs, mine)

    report = _check_fix_with_swap(monkeypatch, capsys, root, swap)
    assert theirs.read_bytes() == before
    assert report["fixed"] == 0 and not report["bad"][0]["removed"]
