"""Reserved slots in a host region (store/tiers/host_region.py, "Reserved slots"): under the
learned share a group's slab is laid out for the most slots it may get, only its pool's slots are
reserved, and the region's memory follows the pools as they grow and shrink. Real files, real
mappings, a real tmpfs where one can be mounted."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from kvtier.store.payload import make_header
from kvtier.store.tiers.base import TierLayout
from kvtier.store.tiers.cpu import CpuTier
from kvtier.store.tiers.host_region import PAGE, HostRegion

from test_host_region import other_process, small_tmpfs

NS = "0123456789abcdef"
LAYOUT = TierLayout(slot_bytes=(4096, 1536), num_slots=(4, 3))  # other_process's layout
BIG = TierLayout(slot_bytes=(16384, 8192), num_slots=(64, 32))


def header(h: int, g: int, layout: TierLayout = BIG):
    return make_header(NS, bytes([h]) * 32, g, 0, 16, layout.slot_bytes[g])


def allocated(region: HostRegion) -> int:
    """Bytes of memory (or disk) the region's file holds: its allocated blocks."""
    return os.stat(region.path).st_blocks * 512


def fixed_bytes(layout: TierLayout) -> int:
    """Record, control page and every slot table: always reserved whole."""
    return 2 * PAGE + sum(-(-n * 136 // PAGE) * PAGE for n in layout.num_slots)


def test_only_the_pools_slots_are_reserved_and_the_memory_follows_them(tmp_path: Path) -> None:
    region = HostRegion.create(tmp_path, "eng", BIG, reserve=(8, 4))
    cpu = CpuTier(BIG, pin_memory=False, region=region)
    start = fixed_bytes(BIG) + 8 * 16384 + 4 * 8192
    assert allocated(region) == start, (allocated(region), start)  # not the 1.25 MiB laid out
    assert (region.reserved(0), region.reserved(1), region.applied()) == (8, 4, 0)
    # a pool grows: its pages are reserved off the caller's thread, then the count rises
    cpu.reserve(0, 40)
    assert region.settle() and region.reserved(0) == 40
    assert allocated(region) == start + 32 * 16384
    assert cpu.write(0, 39, header(1, 0), torch.full((16384,), 5, dtype=torch.uint8))
    assert cpu.holds(0, 39, header(1, 0))
    # it shrinks: the headers past the pool go and the count falls at once; the pages after
    assert cpu.release(0, 8) == 0 and region.reserved(0) == 8 and cpu.header(0, 39) is None
    assert region.settle() and region.released_bytes == 32 * 16384
    assert allocated(region) == start
    out = torch.empty(16384, dtype=torch.uint8)
    assert not region.copy_out(0, 39, out) and allocated(region) == start  # not read: no page made
    assert region.copy_out(0, 7, out)
    # the other process sees the counts and the batch the worker applied
    region.set_applied(7)
    out = other_process(tmp_path, """
        import os
        LAYOUT = TierLayout(slot_bytes=(16384, 8192), num_slots=(64, 32))
        r = HostRegion.attach(os.environ["KVT_BASE"], os.environ["KVT_NAME"], LAYOUT)
        print(r.reserved(0), r.reserved(1), r.applied())
    """, name=region.name)
    assert out.split() == ["8", "4", "7"]


def test_a_punch_still_queued_keeps_a_grow_before_it_from_raising_the_count(tmp_path: Path) -> None:
    """Grow, shrink, grow again while the keeper is still on the first grow: that reservation must
    not raise the count, since the punch queued after it takes those pages back (a store landing
    there in between would leave a header over zeros); the second grow, queued after the punch,
    raises it. In the end every slot below the count is backed by the file."""
    region = HostRegion.create(tmp_path, "eng", BIG, reserve=(8, 4))
    gate, real = threading.Event(), region._reserve
    calls = []

    def held(group: int) -> None:
        calls.append(group)
        if len(calls) == 1:
            assert gate.wait(10)
        real(group)

    region._reserve = held
    region.resize(0, 50)  # the keeper starts it and waits at the gate
    end = time.monotonic() + 10
    while not calls:
        assert time.monotonic() < end
        time.sleep(0.001)
    region.resize(0, 8)  # a punch queued, the count at 8
    region.resize(0, 30)  # a reservation queued after it
    assert region.reserved(0) == 8
    gate.set()
    assert region.settle()
    assert region.reserved(0) == 30
    assert allocated(region) == fixed_bytes(BIG) + 30 * 16384 + 4 * 8192  # every counted slot backed


def test_a_slot_past_the_reserved_ones_is_never_written(tmp_path: Path) -> None:
    """A write there would allocate a page a full tmpfs does not have (SIGBUS): it is a stand-in,
    counted failed, and nothing is published, in either process."""
    region = HostRegion.create(tmp_path, "eng", BIG, reserve=(8, 4))
    cpu = CpuTier(BIG, pin_memory=False, region=region)
    before = allocated(region)
    assert not cpu.write(0, 8, header(2, 0), torch.full((16384,), 3, dtype=torch.uint8))
    row = cpu.begin(1, 20)
    row.fill_(9)
    cpu.commit(1, 20, header(3, 1))
    assert cpu.failed_writes == 2
    assert cpu.header(0, 8) is None and cpu.header(1, 20) is None  # nothing published
    assert allocated(region) == before  # no page of the slabs was touched
    assert cpu.write(0, 7, header(4, 0), torch.full((16384,), 1, dtype=torch.uint8))  # below: written


def test_a_full_tmpfs_refuses_a_grow_and_the_slots_take_no_writes(tmp_path: Path) -> None:
    """On a real 256 KiB tmpfs: a region laid out for 1.25 MiB is made with its starting pools
    reserved; a grow past what the tmpfs holds fails at `reserve` (counted by the worker), and a
    store into those slots is a failed write, never SIGBUS."""
    with small_tmpfs(tmp_path, "256k") as mnt:
        region = HostRegion.create(mnt, "eng", BIG, reserve=(8, 4))
        cpu = CpuTier(BIG, pin_memory=False, region=region)
        cpu.reserve(0, 64)  # 1 MiB more than the tmpfs has
        assert region.settle() and region.reserve_failed == 1 and region.reserved(0) == 8
        assert not cpu.write(0, 30, header(5, 0), torch.full((16384,), 2, dtype=torch.uint8))
        assert cpu.failed_writes == 1 and cpu.header(0, 30) is None
        out = torch.empty(16384, dtype=torch.uint8)
        assert not region.copy_out(0, 30, out)  # a read of the hole would be SIGBUS here
        cpu.release(0, 8)
        cpu.reserve(0, 10)
        assert region.settle() and region.reserved(0) == 10
        assert cpu.write(0, 9, header(6, 0), torch.full((16384,), 2, dtype=torch.uint8))
        # a pool refused for want of room gets its pages once another pool gives some back
        cpu.reserve(1, 20)  # 128 KiB more: refused (36 KiB left of the 256)
        assert region.settle() and region.reserve_failed == 2 and region.reserved(1) == 4
        cpu.release(0, 1)  # 144 KiB back: the refused reservation is tried again, and fits
        assert region.settle() and region.reserved(1) == 20
        assert cpu.write(1, 19, header(7, 1), torch.full((8192,), 4, dtype=torch.uint8))
        del cpu, region


def test_a_region_made_whole_reserves_every_slot(tmp_path: Path) -> None:
    region = HostRegion.create(tmp_path, "eng", LAYOUT)
    assert [region.reserved(g) for g in range(2)] == [4, 3]
    assert allocated(region) >= 2 * PAGE + 4 * 4096 + 3 * 1536
