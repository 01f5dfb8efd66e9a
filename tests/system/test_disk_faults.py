"""Disk tier faults with real files: bad bytes, truncation, foreign and future slots.

Each fault must end as a counted miss: the slot is dropped and its bytes never reach a buffer
that the store reports as restored.
"""

from __future__ import annotations

import os
import struct
import time
import zlib

import pytest
import torch

from kvtier.core.geometry import Geometry, Group
from kvtier.core.keys import Namespace
from kvtier.store.payload import HEADER_BYTES, make_header
from kvtier.core.plan import make_plan
from kvtier.store.store import Store
from kvtier.store.tiers.base import LogOnce, log
from kvtier.store.tiers.disk_files import DATA_OFFSET, slab_name, slot_stride
from kvtier.store.tiers.disk_scan import scan_dir

C = 32
GEOM = Geometry(
    groups=(
        Group("full", "full", num_layers=2, tokens_per_block=16, bytes_per_token_per_layer=64),
        Group("ssm", "state", num_layers=1, tokens_per_block=16, state_bytes_per_layer=3000),
    ),
    tokens_per_hash=16,
)
PLAN = make_plan(GEOM, chunk_tokens=C)
NS = Namespace("fault-model", GEOM.fingerprint(), "bfloat16")
ROW = sum(gp.chunk_bytes for gp in PLAN.groups)
TOKS = [(13 * i + 5) % 30000 for i in range(4 * C + 1)]  # 4 full chunks, hit up to 128


def _payloads() -> dict[tuple[int, int], torch.Tensor]:
    return {(gp.index, i): torch.full((gp.chunk_bytes,), 17 * gp.index + i, dtype=torch.uint8)
            for gp in PLAN.groups for i in range(4)}


def _filled(tmp_path) -> None:
    with Store(PLAN, NS, placement="every", disk_dir=tmp_path, disk_bytes=8 * ROW) as s:
        assert s.save_tokens(TOKS, _payloads()) == 8


def _slot_of(tmp_path, group: int, chunk_index: int) -> tuple[str, int]:
    """(slab path, byte offset of the slot) holding chunk `chunk_index` of `group`."""
    nbytes = PLAN.groups[group].chunk_bytes
    path = tmp_path / NS.id / slab_name(group, nbytes)
    for rec in scan_dir(tmp_path):
        if rec.path == path and rec.header.token_start == chunk_index * C:
            return str(path), rec.slot * slot_stride(nbytes)
    raise AssertionError("chunk not found")


def _restart_and_load(tmp_path) -> tuple[int, dict[str, object], dict]:
    s = Store(PLAN, NS, placement="every", disk_dir=tmp_path, disk_bytes=8 * ROW)
    hit = s.lookup_tokens(TOKS)
    bufs = {(gp.index, i): torch.zeros(gp.chunk_bytes, dtype=torch.uint8) for gp in PLAN.groups for i in range(4)}
    got = s.load(hit, bufs)
    want = _payloads()
    for (g, i), b in bufs.items():
        if i * C < got and (g == 0 or (i + 1) * C == got):
            assert torch.equal(b, want[(g, i)]), f"restored wrong bytes for group {g} chunk {i}"
    m = s.metrics()
    again = s.lookup_tokens(TOKS).tokens
    s.close()
    return got, m, {"hit": hit.tokens, "again": again}


def test_flipped_payload_byte(tmp_path) -> None:
    _filled(tmp_path)
    path, off = _slot_of(tmp_path, 0, 1)
    with open(path, "r+b") as f:
        f.seek(off + DATA_OFFSET + 1000)
        b = f.read(1)
        f.seek(off + DATA_OFFSET + 1000)
        f.write(bytes([b[0] ^ 0x01]))
    got, m, h = _restart_and_load(tmp_path)
    assert (h["hit"], got, h["again"]) == (128, 32, 32)  # full chunk 1 bad -> 1 chunk left
    assert m["corrupt_dropped"] == 1


def test_flipped_header_byte(tmp_path) -> None:
    _filled(tmp_path)
    path, off = _slot_of(tmp_path, 1, 3)  # the state checkpoint at 128
    with open(path, "r+b") as f:
        f.seek(off + 60)  # token span end
        f.write(b"\x7f")
    got, m, h = _restart_and_load(tmp_path)
    # the bad header is not listed at restart: the hit falls back to the checkpoint at 96
    assert (h["hit"], got) == (96, 96)
    assert [r.problem for r in scan_dir(tmp_path) if r.problem] == []  # dropped at restart
    assert m["corrupt_dropped"] == 1


def test_truncated_file(tmp_path) -> None:
    _filled(tmp_path)
    path, off = _slot_of(tmp_path, 0, 3)
    size = os.path.getsize(path)
    assert size >= off + DATA_OFFSET + PLAN.groups[0].chunk_bytes  # sized to capacity at open
    # cut the file 100 bytes into chunk 3's payload; the restart sizes it to capacity again
    # (a sparse, zero tail), so the rest of that payload reads as zeros: a checksum mismatch
    os.truncate(path, off + DATA_OFFSET + 100)
    got, m, h = _restart_and_load(tmp_path)
    assert (h["hit"], got, h["again"]) == (128, 96, 96)
    assert m["corrupt_dropped"] == 1


def test_slot_from_another_namespace_is_never_restored(tmp_path) -> None:
    _filled(tmp_path)
    other = Namespace("fault-model", GEOM.fingerprint(), "float16")  # another dtype: another namespace
    src = tmp_path / NS.id
    dst = tmp_path / other.id
    dst.mkdir()
    for f in src.glob("*.kvslab"):
        (dst / f.name).write_bytes(f.read_bytes())
    with Store(PLAN, other, placement="every", disk_dir=tmp_path, disk_bytes=8 * ROW) as s:
        assert s.rebuilt == 0
        assert s.metrics()["corrupt_dropped"] == 8  # every foreign slot dropped at restart
        assert s.lookup_tokens(TOKS).tokens == 0
    assert [r for r in scan_dir(tmp_path) if r.namespace_id == other.id] == []
    # the owner still has all of its chunks
    got, m, h = _restart_and_load(tmp_path)
    assert (h["hit"], got, m["corrupt_dropped"]) == (128, 128, 0)


def test_header_from_a_newer_format_version(tmp_path) -> None:
    _filled(tmp_path)
    path, off = _slot_of(tmp_path, 0, 0)
    with open(path, "r+b") as f:
        f.seek(off)
        raw = bytearray(f.read(HEADER_BYTES))
        struct.pack_into("<H", raw, 4, 4)  # format version 4, header crc made valid again
        struct.pack_into("<I", raw, 124, zlib.crc32(bytes(raw[:124])))
        f.seek(off)
        f.write(raw)
    problems = [r.problem for r in scan_dir(tmp_path) if r.problem]
    assert problems == ["newer format version 4 (this kvtier reads 1, 2 and 3)"]
    got, m, h = _restart_and_load(tmp_path)
    assert (h["hit"], got) == (0, 0)  # chunk 0 of the full group is gone: nothing restores


def test_torn_overwrite_old_header_over_new_payload(tmp_path) -> None:
    """A writer killed while overwriting a slot leaves the old header over a payload that is
    partly (or wholly) the new chunk's: the old header's checksum rejects both."""
    from kvtier.store.tiers.base import TierLayout
    from kvtier.store.tiers.disk import DiskTier

    n = 8192
    layout = TierLayout(slot_bytes=(n,), num_slots=(1,))
    t = DiskTier(tmp_path, layout, NS.id)
    old = make_header(NS.id, b"\x01" * 32, 0, 0, C, n)
    assert t.write(0, 0, old, torch.full((n,), 1, dtype=torch.uint8))
    path = tmp_path / NS.id / slab_name(0, n)
    for new_bytes in (n // 2, n):  # killed mid-payload; killed between payload and header
        with open(path, "r+b") as f:
            f.seek(DATA_OFFSET)
            f.write(b"\x02" * new_bytes)
        assert t.read(0, 0, old, bytearray(n)) is False
        assert t.write(0, 0, old, torch.full((n,), 1, dtype=torch.uint8))  # restore for the next case
    assert t.corrupt_dropped == 2
    t.close()


# -- large payloads: copy and checksum overlapped on the helper thread (pipeline="always") -----
PIECE = 4096
BIG = 5 * PIECE + 123  # 6 pieces, the last one short


def _pipelined(tmp_path, mode: str = "always", mapped: bool = False):
    from kvtier.store.tiers.base import TierLayout
    from kvtier.store.tiers.disk import DiskTier

    return DiskTier(tmp_path, TierLayout(slot_bytes=(BIG,), num_slots=(2,)), NS.id,
                    pipeline=mode, piece_bytes=PIECE, mapped_reads=mapped)


def _big_payload(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BIG,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_pipelined_slots_carry_the_one_shot_checksum_and_read_back_either_way(tmp_path) -> None:
    from kvtier.store.payload import DEFAULT_CHECKSUM, StreamingChecksum, checksum

    data = _big_payload(1)
    h = make_header(NS.id, b"\x05" * 32, 0, 0, C, BIG)
    t = _pipelined(tmp_path)
    h2, data2 = make_header(NS.id, b"\x06" * 32, 0, C, 2 * C, BIG), _big_payload(2)
    assert t.write_many([(0, 0, h, data), (0, 1, h2, data2)]) == [True, True]
    assert t.helper_ios == 1  # slot 1 was written on the helper's lane
    recs = {r.slot: r for r in scan_dir(tmp_path, verify_payloads=True)}
    assert all(r.problem is None for r in recs.values())
    assert (recs[0].header.checksum, recs[1].header.checksum) == (checksum(data), checksum(data2))
    s = StreamingChecksum(DEFAULT_CHECKSUM)
    for a in range(0, BIG, 1000):  # pieces of any size give the same value
        s.update(data.numpy()[a:a + 1000])
    assert s.value() == checksum(data)
    t.close()
    serial = _pipelined(tmp_path, "never")  # a slot written by the helper reads back on one thread
    out = torch.zeros(BIG, dtype=torch.uint8)
    assert serial.read(0, 0, h, out) and torch.equal(out, data)
    assert serial.write(0, 1, h, data) and serial.helper_ios == 0
    serial.close()
    t = _pipelined(tmp_path)  # and one written on one thread reads back through the helper
    out = torch.zeros(BIG, dtype=torch.uint8)
    assert t.read(0, 1, h, out) and torch.equal(out, data) and t.helper_ios == 1
    t.close()


# mapped: resident reads copy from the mapping, in one fused pass (C extension) or piece by piece
@pytest.mark.parametrize("mapped", [False, "fused", "pieces"])
def test_pipelined_read_rejects_a_flipped_byte_in_any_piece(tmp_path, monkeypatch, mapped) -> None:
    import kvtier.store.payload
    import kvtier.store.tiers.disk as disk

    monkeypatch.setattr(disk, "MAP_PIECE", PIECE)  # the mapped path's pieces, as small as the helper's
    if mapped == "pieces":
        monkeypatch.setattr(kvtier.store.payload, "_xxcopy", None)  # as where the extension is not built
    data = _big_payload(2)
    h = make_header(NS.id, b"\x06" * 32, 0, 0, C, BIG)
    t = _pipelined(tmp_path, mapped=bool(mapped))
    path = tmp_path / NS.id / slab_name(0, BIG)
    for pos in (0, PIECE - 1, 2 * PIECE + 7, BIG - 1):  # first piece (caller), later ones (helper), tail
        assert t.write(0, 0, h, data)
        with open(path, "r+b") as f:
            f.seek(DATA_OFFSET + pos)
            b = f.read(1)
            f.seek(DATA_OFFSET + pos)
            f.write(bytes([b[0] ^ 0x80]))
        assert t.read(0, 0, h, torch.zeros(BIG, dtype=torch.uint8)) is False, pos
        assert t.read(0, 0, h, torch.zeros(BIG, dtype=torch.uint8)) is False  # dropped: now a miss
    assert t.corrupt_dropped == 4
    assert t.mapped_reads == (4 if mapped else 0)
    t.close()


def test_pipelined_read_of_a_truncated_payload_is_a_counted_miss(tmp_path, caplog) -> None:
    data = _big_payload(3)
    h = make_header(NS.id, b"\x07" * 32, 0, 0, C, BIG)
    t = _pipelined(tmp_path)
    t._warnings = LogOnce(log, interval_s=0.0)  # every drop's reason logged (a tier logs one a minute)
    assert t.write(0, 0, h, data)
    path = tmp_path / NS.id / slab_name(0, BIG)
    for cut in (3 * PIECE + 5, PIECE // 2):  # ends in a helper piece; ends inside the first piece
        os.truncate(path, DATA_OFFSET + cut)
        out = torch.zeros(BIG, dtype=torch.uint8)
        assert t.read(0, 0, h, out) is False
        assert t.write(0, 0, h, data)  # restore for the next case
    assert t.corrupt_dropped == 2
    reasons = [r.getMessage().split(": ", 2)[-1] for r in caplog.records if "dropped" in r.getMessage()]
    assert reasons == [f"payload truncated: {3 * PIECE + 5} of {BIG} bytes",
                       f"payload truncated: {PIECE // 2} of {BIG} bytes"]
    t.close()


def test_a_forked_child_gets_its_own_helper_thread(tmp_path) -> None:
    """The executor survives fork() but its thread does not: the child must not wait on it."""
    data = _big_payload(4)
    h = make_header(NS.id, b"\x08" * 32, 0, 0, C, BIG)
    t = _pipelined(tmp_path)
    assert t.write(0, 0, h, data)  # the parent's helper thread exists now
    pid = os.fork()
    if pid == 0:  # child: read through a helper of its own, report by exit code
        ok = False
        try:
            out = torch.zeros(BIG, dtype=torch.uint8)
            ok = t.read(0, 0, h, out) and torch.equal(out, data)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child hung on the parent's helper thread")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    t.close()
