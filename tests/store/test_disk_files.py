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
