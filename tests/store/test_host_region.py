"""The cpu tier in a host region two processes map (store/tiers/host_region.py): real files,
real processes, real mappings."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtier.store.payload import make_header
from kvtier.store.tiers.base import TierLayout
from kvtier.store.tiers.cpu import CpuTier
from kvtier.store.tiers.host_region import HostRegion, RegionError

LAYOUT = TierLayout(slot_bytes=(4096, 1536), num_slots=(4, 3))
NS = "0123456789abcdef"
SRC = str(Path(__file__).resolve().parents[2] / "src")


def header(h: int, g: int = 0):
    return make_header(NS, bytes([h]) * 32, g, 0, 16, LAYOUT.slot_bytes[g])


def other_process(base: Path, body: str, wait: bool = True) -> subprocess.Popen | str:
    """Run `body` in a new Python process with the region attached as `cpu` (a CpuTier)."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {SRC!r})
        import torch
        from kvtier.store.payload import make_header
        from kvtier.store.tiers.base import TierLayout
        from kvtier.store.tiers.cpu import CpuTier
        from kvtier.store.tiers.host_region import HostRegion
        LAYOUT = TierLayout(slot_bytes={LAYOUT.slot_bytes}, num_slots={LAYOUT.num_slots})
        def header(h, g=0):
            return make_header({NS!r}, bytes([h]) * 32, g, 0, 16, LAYOUT.slot_bytes[g])
    """) + textwrap.dedent(body)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "KVT_BASE": str(base)})
    if not wait:
        return proc
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out


def test_a_slot_filled_by_one_process_is_read_by_the_other(tmp_path: Path) -> None:
    worker = CpuTier(LAYOUT, pin_memory=False, region=HostRegion.create(tmp_path, "eng", LAYOUT))
    worker.begin(0, 1).copy_(torch.full((4096,), 7, dtype=torch.uint8))
    worker.commit(0, 1, header(1))
    out = other_process(tmp_path, """
        import os
        region = HostRegion.attach(os.environ["KVT_BASE"], "eng", LAYOUT)
        cpu = CpuTier(LAYOUT, pin_memory=False, region=region)
        assert cpu.holds(0, 1, header(1)) and int(cpu.slabs[0][1].sum()) == 7 * 4096
        cpu.begin(1, 2).copy_(torch.full((1536,), 9, dtype=torch.uint8))
        cpu.commit(1, 2, header(2, 1))
        print("ok")
    """)
    assert out.strip() == "ok"
    # the other process's fill: header and bytes, seen here
    assert worker.holds(1, 2, header(2, 1))
    assert torch.equal(worker.slabs[1][2], torch.full((1536,), 9, dtype=torch.uint8))
    assert not worker.holds(1, 2, header(3, 1))  # another chunk's header is not this one
    # the attaching process removed the file: nothing is left behind when both are gone
    assert os.listdir(tmp_path / f"kvtier-{os.geteuid()}") == []


def test_a_begin_in_the_other_process_changes_the_generation(tmp_path: Path) -> None:
    """The worker's write-behind copies a slot and writes it only if its generation is the one
    its store committed; the scheduler's process starting a fill there must change it."""
    worker = CpuTier(LAYOUT, pin_memory=False, region=HostRegion.create(tmp_path, "eng", LAYOUT))
    worker.begin(0, 0)
    worker.commit(0, 0, header(1))
    gen = worker.generation(0, 0)
    assert gen % 2 == 0
    other_process(tmp_path, """
        import os
        cpu = CpuTier(LAYOUT, pin_memory=False, region=HostRegion.attach(os.environ["KVT_BASE"], "eng", LAYOUT))
        cpu.begin(0, 0)
    """)
    assert worker.generation(0, 0) != gen and worker.generation(0, 0) % 2 == 1  # being written
    assert worker.header(0, 0) is None  # dropped before any new byte


def test_the_region_file_is_private_and_removed_with_its_creator(tmp_path: Path) -> None:
    region = HostRegion.create(tmp_path, "eng", LAYOUT)
    d = tmp_path / f"kvtier-{os.geteuid()}"
    f = d / "eng.host"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(f.stat().st_mode) == 0o600
    with pytest.raises(RegionError, match="exists already"):
        HostRegion.create(tmp_path, "eng", LAYOUT)
    assert f.exists()  # a failed creation never removes a file it did not make
    del region
    gc.collect()
    assert not f.exists()


def test_a_region_of_another_layout_is_not_attached(tmp_path: Path) -> None:
    _keep = HostRegion.create(tmp_path, "eng", LAYOUT)
    other = TierLayout(slot_bytes=(4096, 1536), num_slots=(4, 2))
    assert HostRegion.attach(tmp_path, "eng", other) is None
    assert HostRegion.attach(tmp_path, "none", LAYOUT) is None
    assert HostRegion.attach(tmp_path, "eng", LAYOUT) is not None


def test_unsafe_directories_and_files_are_refused(tmp_path: Path) -> None:
    d = tmp_path / f"kvtier-{os.geteuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    d.symlink_to(elsewhere)
    with pytest.raises(RegionError, match="symlink"):
        HostRegion.create(tmp_path, "eng", LAYOUT)
    d.unlink()
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(RegionError, match="not private"):
        HostRegion.create(tmp_path, "eng", LAYOUT)
    os.chmod(d, 0o700)
    (d / "eng.host").symlink_to(elsewhere / "x")
    with pytest.raises(RegionError, match="symlink"):
        HostRegion.attach(tmp_path, "eng", LAYOUT)


def killed_creator(base: Path, name: str) -> Path:
    """The file of region `name`, made by another process that was then killed (SIGKILL runs no
    finalizer, so the file stays)."""
    proc = other_process(base, f"""
        import os
        r = HostRegion.create(os.environ["KVT_BASE"], {name!r}, LAYOUT)
        print("made", flush=True)
        time.sleep(60)
    """, wait=False)
    assert proc.stdout.readline().strip() == "made"
    proc.kill()
    proc.wait()
    f = base / f"kvtier-{os.geteuid()}" / f"{name}.host"
    assert f.exists()
    return f


def test_a_killed_creators_file_is_not_attached_and_is_swept(tmp_path: Path) -> None:
    f = killed_creator(tmp_path, "dead")
    assert HostRegion.attach(tmp_path, "dead", LAYOUT) is None  # its creator is gone
    _new = HostRegion.create(tmp_path, "eng", LAYOUT)  # a creator sweeps what the dead left
    assert not f.exists()


def test_a_file_from_another_pid_namespace_is_never_swept(tmp_path: Path) -> None:
    """Containers sharing /dev/shm (--ipc=host) see each other's files but not each other's pids:
    a creator whose pid is not alive here may be alive in its own namespace."""
    import json

    from kvtier.store.tiers import host_region as hr

    f = killed_creator(tmp_path, "elsewhere")
    raw = f.read_bytes()[:hr.PAGE]
    rec = json.loads(raw[8:].rstrip(b"\0"))
    assert rec["pidns"] == hr._pidns()
    rec["pidns"] = (rec["pidns"] or 0) + 1  # as if made in another PID namespace
    body = hr.MAGIC + json.dumps(rec).encode()
    with open(f, "r+b") as fh:
        fh.write(body + bytes(hr.PAGE - len(body)))
    _new = HostRegion.create(tmp_path, "eng", LAYOUT)
    assert f.exists()  # its creator cannot be checked from here: left alone


def test_no_room_for_the_region_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    """A full tmpfs fails at creation (the space is reserved), never with SIGBUS at a store.
    Here the file size limit stands in for a small /dev/shm."""
    out = other_process(tmp_path, """
        import os, resource, signal
        from kvtier.store.tiers.host_region import RegionError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
        try:
            HostRegion.create(os.environ["KVT_BASE"], "eng", LAYOUT)
        except RegionError as exc:
            print(exc)
    """)
    assert "--shm-size" in out and "kvtier.cpu_bytes" in out and len(out.strip().splitlines()) == 1, out
    assert os.listdir(tmp_path / f"kvtier-{os.geteuid()}") == []  # nothing half-made is left


def test_a_full_tmpfs_fails_at_creation_not_at_the_first_store(tmp_path: Path) -> None:
    """On a real 64 KiB tmpfs (Docker's /dev/shm is 64 MiB): a file of the region's size could
    be made sparse and fault with SIGBUS at the first store; the space is reserved at creation
    instead, so this is a RegionError naming the fix."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=1777", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}); the RLIMIT test covers the error path")
    try:
        with pytest.raises(RegionError, match="--shm-size"):
            HostRegion.create(mnt, "eng", TierLayout(slot_bytes=(65536,), num_slots=(4,)))
        assert os.listdir(mnt / f"kvtier-{os.geteuid()}") == []
        small = TierLayout(slot_bytes=(4096,), num_slots=(2,))
        assert HostRegion.create(mnt, "eng", small).slabs[0].shape == (2, 4096)  # what fits is made
    finally:
        gc.collect()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_the_seqlock_fence_is_the_c_barrier_where_the_extension_is_built() -> None:
    """On ARM a lock's acquire and release are not a full barrier: the cpu tier must use the
    extension's __atomic_thread_fence whenever the extension is there (make setup builds it)."""
    from kvtier.store.tiers import cpu

    try:
        from kvtier.store import _xxcopy
    except ImportError:
        pytest.skip("kvtier was installed without its C extension")
    assert cpu.fence is _xxcopy.fence
    cpu.fence()  # callable, returns
