"""Disk faults that need real processes and file systems: SIGKILL mid-write, ENOSPC, EFBIG,
a read-only file system. Saves that fail are counted; nothing raises into inference; after a
kill, every slot that reads back holds exactly the bytes that were written for its key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kvtier.core.geometry import Geometry, Group
from kvtier.core.keys import Namespace
from kvtier.core.plan import make_plan
from kvtier.store.store import Store

C = 256
GEOM = Geometry(
    groups=(
        Group("full", "full", num_layers=4, tokens_per_block=16, bytes_per_token_per_layer=512),  # 512 KiB chunks
        Group("ssm", "state", num_layers=2, tokens_per_block=16, state_bytes_per_layer=40000),
    ),
    tokens_per_hash=16,
)
PLAN = make_plan(GEOM, chunk_tokens=C)
NS = Namespace("kill-model", GEOM.fingerprint(), "bfloat16")
ROW = sum(gp.chunk_bytes for gp in PLAN.groups)

WRITER = textwrap.dedent("""
    import sys, torch
    from kvtier.core.geometry import Geometry, Group
    from kvtier.core.keys import Namespace
    from kvtier.core.plan import make_plan
    from kvtier.store.store import Store
    sys.path.insert(0, {here!r})
    from test_disk_faults_process import PLAN, NS, ROW, pattern
    import kvtier.store.tiers.disk as disk
    disk.PIPELINE, disk.PIECE_BYTES = {pipeline!r}, 64 << 10  # "always": 512 KiB payloads in 8 pieces
    s = Store(PLAN, NS, placement="every", disk_dir={root!r}, disk_bytes=6 * ROW)
    print("ready", flush=True)
    k = {start}
    while True:
        toks = [(k * 1009 + 7 * i) % 40000 for i in range(3 * 256 + 1)]
        hashes = s.hashes(toks)
        s.save(hashes, lambda g, i: pattern(hashes[i], PLAN.groups[g].chunk_bytes), len(toks))
        k += 1
""")


def pattern(chunk_hash: bytes, nbytes: int) -> torch.Tensor:
    """The payload a writer stores for a key: a function of the key, so a reader can check it."""
    raw = (chunk_hash * (nbytes // len(chunk_hash) + 1))[:nbytes]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@pytest.mark.parametrize("pipeline", ["never", "always"])  # always: helper-thread writes killed too
def test_sigkill_during_writes_never_leaves_a_wrong_slot(tmp_path: Path, pipeline: str) -> None:
    good = dropped = 0
    for round_ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER.format(here=str(Path(__file__).parent), root=str(tmp_path),
                                         start=round_ * 10000, pipeline=pipeline)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        time.sleep(0.4 + 0.3 * round_)  # several overwrites of every slot, then a kill mid-stream
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        # restart: the kernel dropped the dead writer's lock; every listed slot is checked
        with Store(PLAN, NS, placement="every", disk_dir=tmp_path, disk_bytes=6 * ROW) as s:
            disk = s.slot_tiers["disk"]
            dropped += s.metrics()["corrupt_dropped"]
            for g, slot, h in list(disk.list()):
                out = torch.empty(h.payload_bytes, dtype=torch.uint8)
                if disk.read(g, slot, h, out):
                    assert torch.equal(out, pattern(h.chunk_hash[:32], h.payload_bytes)), "wrong bytes restored"
                    good += 1
                else:
                    dropped += 1
    print(f"sigkill rounds: {good} slots verified, {dropped} torn or bad dropped")
    assert good > 0


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


@pytest.fixture
def tiny_fs(tmp_path: Path):
    mnt = tmp_path / "tiny"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "1m"):
        pytest.skip("needs root to mount a 1 MiB tmpfs (the RLIMIT_FSIZE test covers the rest)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("pipeline", ["never", "always"])  # always: ENOSPC raised on the helper thread
def test_disk_full_is_a_counted_failed_save(tiny_fs: Path, pipeline: str, monkeypatch) -> None:
    import kvtier.store.tiers.disk as disk

    monkeypatch.setattr(disk, "PIPELINE", pipeline)
    monkeypatch.setattr(disk, "PIECE_BYTES", 64 << 10)
    s = Store(PLAN, NS, placement="every", disk_dir=tiny_fs, disk_bytes=6 * ROW)  # 6 chunks ~ 3.5 MiB > 1 MiB
    toks = [(5 * i) % 40000 for i in range(3 * C + 1)]
    hashes = s.hashes(toks)
    stored = s.save(hashes, lambda g, i: pattern(hashes[i], PLAN.groups[g].chunk_bytes), len(toks))
    m = s.metrics()
    assert m["failed_saves"] >= 1 and stored >= 1
    assert stored + m["failed_saves"] == 6
    assert "No space left" in s.slot_tiers["disk"].last_error
    hit = s.lookup_tokens(toks)  # inference goes on with what fit
    bufs = {(g, i): torch.empty(PLAN.groups[g].chunk_bytes, dtype=torch.uint8) for g in (0, 1) for i in range(3)}
    got = s.load(hit, bufs)
    for i in range(got // C):
        assert torch.equal(bufs[(0, i)], pattern(hashes[i], PLAN.groups[0].chunk_bytes))
    s.close()


def test_read_only_file_system_reads_but_counts_failed_saves(tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "16m"):
        pytest.skip("needs root to mount a tmpfs and remount it read-only")
    try:
        toks = [(3 * i) % 40000 for i in range(2 * C + 1)]
        with Store(PLAN, NS, placement="every", disk_dir=mnt, disk_bytes=6 * ROW) as s:
            hashes = s.hashes(toks)
            assert s.save(hashes, lambda g, i: pattern(hashes[i], PLAN.groups[g].chunk_bytes), len(toks)) == 4
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with Store(PLAN, NS, placement="every", disk_dir=mnt, disk_bytes=6 * ROW) as s:
            assert s.slot_tiers["disk"].read_only
            assert s.rebuilt == 4
            hit = s.lookup_tokens(toks)
            bufs = {(g, i): torch.empty(PLAN.groups[g].chunk_bytes, dtype=torch.uint8) for g in (0, 1) for i in range(2)}
            assert s.load(hit, bufs) == 2 * C
            other = [(11 * i) % 40000 for i in range(C + 1)]
            oh = s.hashes(other)
            assert s.save(oh, lambda g, i: pattern(oh[i], PLAN.groups[g].chunk_bytes), len(other)) == 0
            assert s.metrics()["failed_saves"] == 2
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


FSIZE_WRITER = textwrap.dedent("""
    import resource, signal, sys, json
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))
    sys.path.insert(0, {here!r})
    from test_disk_faults_process import PLAN, NS, ROW, pattern
    import kvtier.store.tiers.disk as disk
    disk.PIPELINE, disk.PIECE_BYTES = {pipeline!r}, 64 << 10  # "always": 512 KiB payloads in 8 pieces
    from kvtier.store.store import Store
    s = Store(PLAN, NS, placement="every", disk_dir={root!r}, disk_bytes=6 * ROW)
    toks = [(7 * i) % 40000 for i in range(3 * 256 + 1)]
    h = s.hashes(toks)
    n = s.save(h, lambda g, i: pattern(h[i], PLAN.groups[g].chunk_bytes), len(toks))
    print(json.dumps({{"stored": n, "failed": s.metrics()["failed_saves"], "err": s.slot_tiers["disk"].last_error}}))
""")


@pytest.mark.parametrize("pipeline", ["never", "always"])  # always: EFBIG raised on the helper thread
def test_file_size_limit_is_a_counted_failed_save(tmp_path: Path, pipeline: str) -> None:
    import json

    r = subprocess.run(
        [sys.executable, "-c", FSIZE_WRITER.format(here=str(Path(__file__).parent), root=str(tmp_path),
                                                   pipeline=pipeline)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # group 0 slots are 512 KiB + header: slot 0 fits under 600 000 bytes, slots 1 and 2 do not
    assert out == {"stored": 4, "failed": 2, "err": out["err"]} and "too large" in out["err"]


def test_a_second_writer_process_is_refused_naming_the_holder(tmp_path: Path) -> None:
    from kvtier.store.tiers.base import TierLayout
    from kvtier.store.tiers.disk import DiskTier

    layout = TierLayout(slot_bytes=(4096,), num_slots=(2,))
    holder = DiskTier(tmp_path, layout, NS.id)
    code = textwrap.dedent(f"""
        from kvtier.errors import TierError
        from kvtier.store.tiers.base import TierLayout
        from kvtier.store.tiers.disk import DiskTier
        try:
            DiskTier({str(tmp_path)!r}, TierLayout(slot_bytes=(4096,), num_slots=(2,)), {NS.id!r})
        except TierError as exc:
            print(exc)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert f"in use by another writer (pid {os.getpid()})" in r.stdout, r.stdout + r.stderr
    holder.close()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == ""  # the lock is free once the holder closed
