"""The disk tier's files are private and never opened through someone else's link (issue:
hardening). Each test names the attack or careless setup it guards against."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvtier.errors import TierError
from kvtier.store.tiers.base import TierLayout
from kvtier.store.tiers.disk import DiskTier
from kvtier.store.tiers.disk_files import slab_name

NS = "00112233aabbccdd"
LAYOUT = TierLayout(slot_bytes=(4096, 1024), num_slots=(4, 3))


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_directories_are_0700_and_files_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)  # the usual umask left directories 0755 and files 0644
    try:
        tier = DiskTier(tmp_path / "root", LAYOUT, NS)
    finally:
        os.umask(old)
    try:
        assert mode(tmp_path / "root") == 0o700
        assert mode(tmp_path / "root" / NS) == 0o700
        names = sorted(p.name for p in (tmp_path / "root" / NS).iterdir())
        assert names == [".lock", slab_name(0, 4096), slab_name(1, 1024)]
        assert all(mode(tmp_path / "root" / NS / n) == 0o600 for n in names)
    finally:
        tier.close()


def test_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / NS).mkdir()
    os.chmod(tmp_path / NS, 0o777)  # another user could plant or swap slabs in it
    with pytest.raises(TierError, match=r"writable by group or others \(mode 777\); run `chmod 700") as err:
        DiskTier(tmp_path, LAYOUT, NS)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / NS).mkdir(mode=0o700)
    os.chown(tmp_path / NS, 65534, 65534)
    with pytest.raises(TierError, match="owned by uid 65534, not by this user"):
        DiskTier(tmp_path, LAYOUT, NS)


def test_a_symlinked_namespace_directory_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "root").mkdir()
    os.symlink(elsewhere, tmp_path / "root" / NS)
    with pytest.raises(TierError, match="not a symlink"):
        DiskTier(tmp_path / "root", LAYOUT, NS)
    assert list(elsewhere.iterdir()) == []  # nothing created through the link


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_linked_slab_never_writes_the_victim(tmp_path: Path, link: str) -> None:
    victim = tmp_path / "photo.jpg"
    victim.write_bytes(b"precious" * 1000)
    nsdir = tmp_path / "root" / NS
    nsdir.mkdir(parents=True, mode=0o700)
    (os.symlink if link == "symlink" else os.link)(victim, nsdir / slab_name(0, 4096))
    with pytest.raises((TierError, OSError)):
        DiskTier(tmp_path / "root", LAYOUT, NS)
    assert victim.read_bytes() == b"precious" * 1000  # not truncated, not written


def test_deleting_the_lock_file_lets_no_second_writer_in(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, LAYOUT, NS)
    try:
        os.unlink(tmp_path / NS / ".lock")  # a cleaner removing "stale" files
        with pytest.raises(TierError, match=f"pid {os.getpid()}|pid \\?"):
            DiskTier(tmp_path, LAYOUT, NS)
    finally:
        first.close()
    DiskTier(tmp_path, LAYOUT, NS).close()  # free once the first writer is gone


def test_a_too_small_read_buffer_raises_and_keeps_the_slot(tmp_path: Path) -> None:
    """A caller's short buffer is the caller's mistake: the valid slot stays (it was dropped as a
    'truncated payload' on the preadv path)."""
    import torch

    from kvtier.errors import ConfigError
    from kvtier.store.payload import make_header

    tier = DiskTier(tmp_path, LAYOUT, NS, mapped_reads=False)
    try:
        h = make_header(NS, b"\x05" * 16, 0, 0, 16, 4096)
        data = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
        assert tier.write(0, 1, h, data)
        with pytest.raises(ConfigError, match="read buffer of 1000 bytes is smaller than the payload's 4096"):
            tier.read(0, 1, h, torch.zeros(1000, dtype=torch.uint8))
        out = torch.zeros(4096, dtype=torch.uint8)
        assert tier.read(0, 1, h, out) and torch.equal(out, data)
        assert tier.corrupt_dropped == 0
    finally:
        tier.close()


def test_failing_writes_log_one_line_a_minute(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A full (here: closed) disk fails every chunk; the log gets one line, the counter all."""
    import torch

    from kvtier.store.payload import make_header

    tier = DiskTier(tmp_path, LAYOUT, NS)
    tier.close()
    data = torch.zeros(1024, dtype=torch.uint8)
    with caplog.at_level("WARNING", logger="kvtier.tiers"):
        for i in range(200):
            tier.write(1, i % 3, make_header(NS, bytes([i]) * 16, 1, 0, 16, 1024), data)
    assert tier.failed_writes == 200
    lines = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines[:5]]


# -- issue 28, item 1: directories made by earlier versions were left readable -----------------
def _old_version_dir(root: Path) -> Path:
    """A namespace directory as kvtier before the hardening left it: 0755, its slabs 0644."""
    import torch

    from kvtier.store.payload import make_header

    tier = DiskTier(root, LAYOUT, NS)
    assert tier.write(0, 1, make_header(NS, b"\x07" * 16, 0, 0, 16, 4096), torch.ones(4096, dtype=torch.uint8))
    tier.close()
    nsdir = root / NS
    for p in nsdir.iterdir():
        os.chmod(p, 0o644)
    os.chmod(nsdir, 0o755)
    return nsdir


@pytest.mark.parametrize("reader", [False, True])
def test_an_earlier_versions_readable_directory_is_tightened(
        tmp_path: Path, reader: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Another user could read the KV of a 0755 directory's 0644 slabs (prompts can be
    reconstructed from it); kvtier's own directory and slabs are made private on open."""
    import torch

    from kvtier.store.payload import make_header

    nsdir = _old_version_dir(tmp_path)
    with caplog.at_level("WARNING", logger="kvtier.tiers"):
        tier = DiskTier(tmp_path, LAYOUT, NS, reader=reader)
    try:
        assert mode(nsdir) == 0o700
        assert mode(nsdir / slab_name(0, 4096)) == 0o600 and mode(nsdir / slab_name(1, 1024)) == 0o600
        lines = [r.getMessage() for r in caplog.records if "tightened" in r.getMessage()]
        assert len(lines) == 1 and "755" in lines[0], lines
        out = torch.zeros(4096, dtype=torch.uint8)  # the KV it held is still there
        assert tier.read(0, 1, make_header(NS, b"\x07" * 16, 0, 0, 16, 4096), out) and int(out.sum()) == 4096
    finally:
        tier.close()


def test_a_readable_slab_in_a_private_directory_is_tightened(tmp_path: Path) -> None:
    nsdir = _old_version_dir(tmp_path)
    os.chmod(nsdir, 0o700)  # someone ran `chmod 700` on the directory only
    DiskTier(tmp_path, LAYOUT, NS).close()
    assert mode(nsdir / slab_name(0, 4096)) == 0o600


@pytest.mark.parametrize("reader", [False, True])
def test_a_readable_directory_that_is_not_kvtiers_is_refused(tmp_path: Path, reader: bool) -> None:
    """Nothing of kvtier's in it (no `.lock`, no slab): not ours to chmod, and never written into."""
    nsdir = tmp_path / NS
    nsdir.mkdir()
    os.chmod(nsdir, 0o755)
    (nsdir / "notes.txt").write_text("mine")
    with pytest.raises(TierError, match=r"readable by group or others \(mode 755\).*run `chmod 700") as err:
        DiskTier(tmp_path, LAYOUT, NS, reader=reader)
    assert "\n" not in str(err.value)
    assert mode(nsdir) == 0o755 and sorted(p.name for p in nsdir.iterdir()) == ["notes.txt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_readable_slab_of_another_user_is_refused_not_tightened(tmp_path: Path) -> None:
    nsdir = _old_version_dir(tmp_path)
    os.chmod(nsdir, 0o700)
    os.chown(nsdir / slab_name(0, 4096), 65534, 65534)
    with pytest.raises(TierError, match="not a private regular file"):
        DiskTier(tmp_path, LAYOUT, NS)
    assert mode(nsdir / slab_name(0, 4096)) == 0o644


# -- issue 28, item 7: a FIFO named like a slab hung the scheduler's read-only reader ------------
def _open_with_timeout(fn, timeout_s: float, fifo: Path):  # type: ignore[no-untyped-def]
    import threading

    result: list[object] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():  # hung in open(): let it go (a writer end unblocks it) and fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail(f"opening the disk tier hung for {timeout_s}s on the FIFO {fifo.name}")
    return result[0]


@pytest.mark.parametrize("reader", [False, True])
def test_a_fifo_named_like_a_slab_is_refused_without_hanging(tmp_path: Path, reader: bool) -> None:
    nsdir = tmp_path / NS
    nsdir.mkdir(mode=0o700)
    (nsdir / ".lock").touch(mode=0o600)
    fifo = nsdir / slab_name(0, 4096)
    os.mkfifo(fifo, 0o600)
    got = _open_with_timeout(lambda: DiskTier(tmp_path, LAYOUT, NS, reader=reader), 5.0, fifo)
    if isinstance(got, DiskTier):
        got.close()
    assert isinstance(got, TierError) and "a FIFO" in str(got), got
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # left alone


def test_a_fifo_named_lock_is_refused_in_one_line(tmp_path: Path) -> None:
    nsdir = tmp_path / NS
    nsdir.mkdir(mode=0o700)
    os.mkfifo(nsdir / ".lock", 0o600)
    got = _open_with_timeout(lambda: DiskTier(tmp_path, LAYOUT, NS), 5.0, nsdir / ".lock")
    assert isinstance(got, TierError) and "a FIFO" in str(got) and "\n" not in str(got), repr(got)


# -- issue 28, item 13: 500 corrupt drops were 500 log lines --------------------------------------
MANY = TierLayout(slot_bytes=(1024,), num_slots=(500,))


def _many_written(root: Path) -> DiskTier:
    import torch

    from kvtier.store.payload import make_header

    tier = DiskTier(root, MANY, NS, mapped_reads=False)
    data = torch.arange(1024, dtype=torch.int32).to(torch.uint8)
    for s in range(500):
        assert tier.write(0, s, make_header(NS, s.to_bytes(2, "big") * 8, 0, 0, 16, 1024), data)
    return tier


def _flip_every_slot(root: Path, at: int) -> None:
    from kvtier.store.tiers.disk_files import slot_stride

    path = root / NS / slab_name(0, 1024)
    buf = bytearray(path.read_bytes())
    for s in range(500):
        buf[s * slot_stride(1024) + at] ^= 0xFF
    path.write_bytes(bytes(buf))


def test_corrupt_drops_on_read_log_one_line_a_minute(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from kvtier.store.payload import make_header
    from kvtier.store.tiers.disk_files import DATA_OFFSET

    tier = _many_written(tmp_path)
    try:
        _flip_every_slot(tmp_path, DATA_OFFSET + 3)  # every payload's checksum now mismatches
        out = torch.zeros(1024, dtype=torch.uint8)
        with caplog.at_level("WARNING", logger="kvtier.tiers"):
            for s in range(500):
                assert not tier.read(0, s, make_header(NS, s.to_bytes(2, "big") * 8, 0, 0, 16, 1024), out)
        assert tier.corrupt_dropped == 500
        lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(lines) == 1, (len(lines), lines[:3])
    finally:
        tier.close()


def test_corrupt_drops_at_scan_log_one_line_a_minute(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _many_written(tmp_path).close()
    _flip_every_slot(tmp_path, 40)  # a header byte: every header's CRC now mismatches
    tier = DiskTier(tmp_path, MANY, NS)
    try:
        with caplog.at_level("WARNING", logger="kvtier.tiers"):
            assert list(tier.list()) == []
        assert tier.corrupt_dropped == 500
        lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(lines) == 1, (len(lines), lines[:3])
    finally:
        tier.close()
