"""The cpu tier in a host region two processes map (store/tiers/host_region.py): real files,
real processes, real mappings."""

from __future__ import annotations

import contextlib
import gc
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
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


def other_process(base: Path, body: str, wait: bool = True, name: str = "") -> subprocess.Popen | str:
    """Run `body` in a new Python process (`KVT_BASE` the base directory, `KVT_NAME` a region's
    name; its stdin a pipe when not `wait`)."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {SRC!r})
        import torch
        from kvtier.store.payload import make_header
        from kvtier.store.tiers.base import TierLayout
        from kvtier.store.tiers.cpu import CpuTier
        from kvtier.store.tiers.host_region import HostRegion, RegionError
        LAYOUT = TierLayout(slot_bytes={LAYOUT.slot_bytes}, num_slots={LAYOUT.num_slots})
        def header(h, g=0):
            return make_header({NS!r}, bytes([h]) * 32, g, 0, 16, LAYOUT.slot_bytes[g])
    """) + textwrap.dedent(body)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=None if wait else subprocess.PIPE, text=True,
                            env={**os.environ, "KVT_BASE": str(base), "KVT_NAME": name})
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
        region = HostRegion.attach(os.environ["KVT_BASE"], os.environ["KVT_NAME"], LAYOUT)
        cpu = CpuTier(LAYOUT, pin_memory=False, region=region)
        assert cpu.holds(0, 1, header(1)) and int(cpu.slabs[0][1].sum()) == 7 * 4096
        cpu.begin(1, 2).copy_(torch.full((1536,), 9, dtype=torch.uint8))
        cpu.commit(1, 2, header(2, 1))
        print("ok")
    """, name=worker.region.name)
    assert out.strip() == "ok"
    # the other process's fill: header and bytes, seen here
    assert worker.holds(1, 2, header(2, 1))
    assert torch.equal(worker.slabs[1][2], torch.full((1536,), 9, dtype=torch.uint8))
    assert not worker.holds(1, 2, header(3, 1))  # another chunk's header is not this one
    # the attaching process removed file and directory: nothing is left behind when both are gone
    assert os.listdir(tmp_path) == []


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
        cpu = CpuTier(LAYOUT, pin_memory=False, region=HostRegion.attach(os.environ["KVT_BASE"],
                                                                         os.environ["KVT_NAME"], LAYOUT))
        cpu.begin(0, 0)
    """, name=worker.region.name)
    assert worker.generation(0, 0) != gen and worker.generation(0, 0) % 2 == 1  # being written
    assert worker.header(0, 0) is None  # dropped before any new byte


def test_the_region_file_is_private_and_removed_with_its_creator(tmp_path: Path) -> None:
    region = HostRegion.create(tmp_path, "eng", LAYOUT)
    f = Path(region.path)
    d = f.parent
    assert d.parent == tmp_path and d.name.startswith(f"kvtier-{os.geteuid()}-") and f.name == "eng.host"
    assert region.name == f"{d.name}/eng"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(f.stat().st_mode) == 0o600
    again = HostRegion.create(tmp_path, "eng", LAYOUT)  # the same name: a directory of its own
    assert Path(again.path).parent != d
    with pytest.raises(RegionError, match="must be letters"):
        HostRegion.create(tmp_path, "../eng", LAYOUT)
    del region, again
    gc.collect()
    assert os.listdir(tmp_path) == []  # file and directory


def test_a_region_of_another_layout_is_not_attached(tmp_path: Path) -> None:
    keep = HostRegion.create(tmp_path, "eng", LAYOUT)
    other = TierLayout(slot_bytes=(4096, 1536), num_slots=(4, 2))
    assert HostRegion.attach(tmp_path, keep.name, other) is None
    assert HostRegion.attach(tmp_path, keep.name.replace("/eng", "/none"), LAYOUT) is None
    assert HostRegion.attach(tmp_path, "eng", LAYOUT) is None  # the creator's name alone is not the region's
    assert HostRegion.attach(tmp_path, f"kvtier-{os.geteuid()}-nothere/eng", LAYOUT) is None
    assert HostRegion.attach(tmp_path, keep.name, LAYOUT) is not None


def test_unsafe_directories_and_files_are_refused(tmp_path: Path) -> None:
    """What `attach` is named must be a private directory of this user holding a private regular
    file: a symlink (either), a directory others may read, another user's, a FIFO are refused."""
    d = tmp_path / f"kvtier-{os.geteuid()}-named"
    name = f"{d.name}/eng"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    d.symlink_to(elsewhere)
    with pytest.raises(RegionError, match="symlink"):
        HostRegion.attach(tmp_path, name, LAYOUT)
    d.unlink()
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(RegionError, match="not private"):
        HostRegion.attach(tmp_path, name, LAYOUT)
    os.chmod(d, 0o700)
    os.chown(d, 12345, 12345)
    with pytest.raises(RegionError, match="not private"):
        HostRegion.attach(tmp_path, name, LAYOUT)
    os.chown(d, os.geteuid(), os.getegid())
    (d / "eng.host").symlink_to(elsewhere / "x")
    with pytest.raises(RegionError, match="symlink"):
        HostRegion.attach(tmp_path, name, LAYOUT)
    (d / "eng.host").unlink()
    os.mkfifo(d / "eng.host", 0o600)
    with pytest.raises(RegionError, match="not a private regular file"):
        HostRegion.attach(tmp_path, name, LAYOUT)


def live_creator(base: Path, name: str) -> tuple[subprocess.Popen, Path, str]:
    """Another process that made region `name` and keeps it (until killed): (it, the region's
    file, the region's name for `attach`)."""
    proc = other_process(base, f"""
        import os
        r = HostRegion.create(os.environ["KVT_BASE"], {name!r}, LAYOUT)
        print(r.path, flush=True)
        print(r.name, flush=True)
        time.sleep(60)
    """, wait=False)
    path, region_name = proc.stdout.readline().strip(), proc.stdout.readline().strip()
    assert path and region_name, proc.stderr.read()
    return proc, Path(path), region_name


def killed_creator(base: Path, name: str) -> tuple[Path, str]:
    """The file of region `name` and the region's name, made by another process that was then
    killed (SIGKILL runs no finalizer, so the file stays)."""
    proc, f, region_name = live_creator(base, name)
    proc.kill()
    proc.wait()
    assert f.exists()
    return f, region_name


def test_a_killed_creators_file_is_not_attached_and_is_swept(tmp_path: Path) -> None:
    f, name = killed_creator(tmp_path, "dead")
    assert HostRegion.attach(tmp_path, name, LAYOUT) is None  # its creator is gone
    _new = HostRegion.create(tmp_path, "eng", LAYOUT)  # a creator sweeps what the dead left
    assert not f.exists()


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
    assert os.listdir(tmp_path) == []  # nothing half-made is left


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, size: str, otherwise: str = "") -> Iterator[Path]:
    """A real tmpfs of `size` (a full /dev/shm in miniature), unmounted after; the test is skipped
    where none can be mounted (`otherwise`: what covers it then)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}){otherwise}")
    try:
        yield mnt
    finally:
        gc.collect()  # regions made there are unmapped first
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_tmpfs_fails_at_creation_not_at_the_first_store(tmp_path: Path) -> None:
    """On a real 64 KiB tmpfs (Docker's /dev/shm is 64 MiB): a file of the region's size could
    be made sparse and fault with SIGBUS at the first store; the space is reserved at creation
    instead, so this is a RegionError naming the fix."""
    with small_tmpfs(tmp_path, "64k", "; the RLIMIT test covers the error path") as mnt:
        with pytest.raises(RegionError, match="--shm-size"):
            HostRegion.create(mnt, "eng", TierLayout(slot_bytes=(65536,), num_slots=(4,)))
        assert os.listdir(mnt) == []
        small = TierLayout(slot_bytes=(4096,), num_slots=(2,))
        assert HostRegion.create(mnt, "eng", small).slabs[0].shape == (2, 4096)  # what fits is made


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


# -- issue 28: the region's liveness, odd files, truncation, a squatted name -------------------


def _rewrite_record(f: Path, **fields: object) -> None:
    """Change fields of a region file's record (page 0) in place, as another process could."""
    import json

    from kvtier.store.tiers import host_region as hr

    raw = f.read_bytes()[:hr.PAGE]
    rec = json.loads(raw[8:].rstrip(b"\0"))
    rec.update(fields)
    body = hr.MAGIC + json.dumps(rec).encode()
    with open(f, "r+b") as fh:
        fh.write(body + bytes(hr.PAGE - len(body)))


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_liveness_is_the_creators_lock_not_its_pid(tmp_path: Path) -> None:
    """A creator in another PID namespace (containers sharing /dev/shm) has a pid that means
    nothing here: a crashed one's region, whose pid here is a live unrelated process, is swept
    (its lock is free); a live creator's region, whose pid here names no process, is kept (its
    lock is held)."""
    alive, kept, kept_name = live_creator(tmp_path, "alive")
    try:
        _rewrite_record(kept, pid=_dead_pid())  # no such process here, yet its creator runs
        crashed, _ = killed_creator(tmp_path, "crashed")
        _rewrite_record(crashed, pid=os.getpid())  # alive here, but not its creator
        theirs = tmp_path / f"kvtier-{os.geteuid()}-theirs"  # another user's: never touched
        theirs.mkdir(mode=0o700)
        (theirs / "x.host").write_bytes(crashed.read_bytes()[:4096])
        os.chown(theirs, 12345, 12345)
        _new = HostRegion.create(tmp_path, "eng", LAYOUT)  # a creator sweeps what the dead left
        assert not crashed.exists() and not crashed.parent.exists()
        assert kept.exists()
        assert (theirs / "x.host").exists()
        assert HostRegion.attach(tmp_path, kept_name, LAYOUT) is not None  # still its creator's
    finally:
        alive.kill()
        alive.wait()


def test_a_fifo_among_the_regions_does_not_hang_creation(tmp_path: Path) -> None:
    """A FIFO where the sweep looks (opened to read, it waits for a writer that never comes)
    is looked at with lstat and never opened: creation finishes and the dead region is swept."""
    f, _ = killed_creator(tmp_path, "dead")
    os.mkfifo(f.parent / "jam.host")
    os.mkfifo(tmp_path / f"kvtier-{os.geteuid()}-jam")
    proc = other_process(tmp_path, """
        import os
        r = HostRegion.create(os.environ["KVT_BASE"], "eng", LAYOUT)
        print("made")
    """, wait=False)
    try:
        out, err = proc.communicate("", timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("HostRegion.create hung on a FIFO")
    assert proc.returncode == 0 and out.strip() == "made", err
    assert not f.exists()


@pytest.mark.parametrize("squat", ["another user's directory", "a regular file", "a symlink"])
def test_another_user_cannot_block_the_region_by_taking_its_name(tmp_path: Path, squat: str) -> None:
    """Another user creates the directory name a region would take first: the region is still
    made, in a private directory of this user whose name nobody can predict."""
    taken = tmp_path / f"kvtier-{os.geteuid()}"
    if squat == "another user's directory":
        taken.mkdir(mode=0o700)
        os.chown(taken, 12345, 12345)
    elif squat == "a regular file":
        taken.write_bytes(b"")
        os.chown(taken, 12345, 12345)
    else:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o777)
        os.chown(theirs, 12345, 12345)
        taken.symlink_to(theirs)
    region = HostRegion.create(tmp_path, "eng", LAYOUT)
    d = Path(region.path).parent
    st = os.lstat(d)
    assert d.parent == tmp_path and d != taken
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert HostRegion.attach(tmp_path, region.name, LAYOUT) is not None  # by the name it was given
    assert os.path.lexists(taken)  # the other user's entry is left alone


def test_the_vllm_worker_warns_when_its_cpu_tier_cannot_be_shared(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Where no region can be made, the worker keeps its cpu tier private (promotion at load)
    and says so, naming the directory and the setting, instead of falling back silently."""
    pytest.importorskip("vllm")
    import logging

    from kvtier.core.geometry import Geometry, Group
    from kvtier.core.keys import Namespace
    from kvtier.core.plan import make_plan
    from kvtier.integrations.vllm.common import SpecContext
    from kvtier.integrations.vllm.config import parse_config
    from kvtier.integrations.vllm.tiers import host_region

    base = tmp_path / "regions"
    base.mkdir()
    geometry = Geometry(groups=(Group(name="full", kind="full", num_layers=1, tokens_per_block=16,
                                      bytes_per_token_per_layer=64, dtype="float16", layers=(0,)),),
                        tokens_per_hash=16, name="t")
    config = parse_config({"kvtier.tiers": "cpu,disk", "kvtier.directory": str(tmp_path),
                           "kvtier.cpu_bytes": 1 << 20, "kvtier.disk_bytes": 1 << 20,
                           "kvtier.host_region": str(base)})
    ctx = SpecContext(plan=make_plan(geometry, blocks_per_chunk=1), config=config, group_of={0: 0},
                      namespace=Namespace("m", geometry.fingerprint(), "float16"), blocks_per_chunk=1)
    small = TierLayout(slot_bytes=(4096,), num_slots=(2,))
    region = host_region(small, ctx)
    assert region is not None and Path(region.path).parent.parent == base
    del region
    gc.collect()
    base.rmdir()  # gone after the engine started: no region can be made there
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        assert host_region(small, ctx) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(base) in warned[0] and "kvtier.host_region" in warned[0], warned
