"""What a slot tier gives back when a learned share shrinks a group's pool (`release`), and how it
relocates a kept entry (`move`): real tensors, real files, measured with `mincore` (cpu) and
`st_blocks` (disk), not with the tiers' bookkeeping."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.store import integrity as I
from kvtier.store.payload import HEADER_BYTES, make_header
from kvtier.store.tiers import disk as disk_mod
from kvtier.store.tiers.base import TierLayout
from kvtier.store.tiers.cpu import PAGE, CpuTier
from kvtier.store.tiers.disk import DiskTier
from kvtier.store.tiers.disk_files import DATA_OFFSET, slab_name
from kvtier.store.tiers.host_region import HostRegion

NS = "0123456789abcdef"
SECRET = b"tenant-r-" + b"s" * 23
MIB = 1 << 20


def _thp_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


# resident memory is counted in pages; with transparent huge pages always on, a touched 2 MiB
# range may be committed whole
SLACK = (2 * MIB if _thp_always() else 0) + 4 * PAGE


def header(h: int, g: int = 0, n: int = MIB):
    return make_header(NS, h.to_bytes(4, "little") * 8, g, 0, 16, n)


def data(h: int, n: int = MIB) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(h))


def reads_back(tier, g: int, s: int, h: int, n: int = MIB) -> bool:
    out = torch.zeros(n, dtype=torch.uint8)
    return tier.read(g, s, header(h, g, n), out) and torch.equal(out, data(h, n))


# -- cpu -----------------------------------------------------------------------------------------

def test_cpu_release_gives_back_the_memory_of_the_slots_past_the_pool() -> None:
    tier = CpuTier(TierLayout(slot_bytes=(MIB, MIB), num_slots=(64, 64)), pin_memory=False)
    assert tier.resident_bytes() <= SLACK  # laid out for 128 MiB, nothing committed yet
    for s in range(40):
        assert tier.write(0, s, header(s), data(s))
    assert tier.write(1, 63, header(99, 1), data(99))
    assert abs(tier.resident_bytes() - 41 * MIB) <= SLACK
    gens = [tier.generation(0, s) for s in range(64)]
    freed = tier.release(0, 10)
    assert abs(freed - 30 * MIB) <= SLACK
    assert abs(tier.resident_bytes() - 11 * MIB) <= SLACK
    assert all(reads_back(tier, 0, s, s) for s in range(10))
    misses = tier.misses
    assert not any(reads_back(tier, 0, s, s) for s in range(10, 40))
    assert tier.misses == misses + 30 and tier.corrupt_dropped == 0
    assert reads_back(tier, 1, 63, 99)  # another group's pool is untouched
    assert sorted((g, s) for g, s, _ in tier.list()) == [(0, s) for s in range(10)] + [(1, 63)]
    # a copy taken before the release never compares equal after it (the seqlock)
    after = [tier.generation(0, s) for s in range(64)]
    assert after[:10] == gens[:10]
    assert all(a != b and a % 2 == 0 for a, b in zip(after[10:], gens[10:]))
    assert tier.write(0, 20, header(120), data(120)) and reads_back(tier, 0, 20, 120)
    assert tier.release(0, 64) == 0  # nothing past the pool
    with pytest.raises(ConfigError):
        tier.release(0, 65)


def test_cpu_release_keeps_the_page_a_kept_slot_ends_in() -> None:
    n = 6000  # not a page multiple: slot 4 ends inside the page slot 5 starts in
    tier = CpuTier(TierLayout(slot_bytes=(n,), num_slots=(16,)), pin_memory=False)
    for s in range(16):
        assert tier.write(0, s, header(s, n=n), data(s, n))
    tier.release(0, 5)
    assert all(reads_back(tier, 0, s, s, n) for s in range(5))
    assert not any(reads_back(tier, 0, s, s, n) for s in range(5, 16))
    assert tier.resident_bytes() <= -(-5 * n // PAGE) * PAGE
    tier.release(0, 0)
    assert tier.list() is not None and list(tier.list()) == [] and tier.resident_bytes() == 0


def test_cpu_release_of_locked_slabs_clears_headers_only(tmp_path: Path) -> None:
    layout = TierLayout(slot_bytes=(8192,), num_slots=(8,))
    registered = CpuTier(layout, pin_memory=True, host_register=(lambda p, n: True, lambda p: None))
    for s in range(8):
        assert registered.write(0, s, header(s, n=8192), data(s, 8192))
    resident = registered.resident_bytes()
    assert registered.release(0, 3) == 0 and registered.resident_bytes() == resident
    assert all(reads_back(registered, 0, s, s, 8192) for s in range(3))
    assert not any(reads_back(registered, 0, s, s, 8192) for s in range(3, 8))


def test_cpu_release_in_a_host_region_punches_the_pages_and_lowers_the_reserved_count(tmp_path: Path) -> None:
    """The region's file gives the slots' pages back (host_region.py, "Reserved slots"): what it
    holds follows the pool; the kept slots read back, the released ones take no writes until a
    `reserve` again."""
    layout = TierLayout(slot_bytes=(8192,), num_slots=(8,))
    shared = CpuTier(layout, pin_memory=False, region=HostRegion.create(tmp_path, "rel", layout))
    for s in range(8):
        assert shared.write(0, s, header(s, n=8192), data(s, 8192))
    blocks = os.stat(shared.region.path).st_blocks
    assert shared.release(0, 3) == 0 and shared.region.reserved(0) == 3  # the count falls at once
    assert shared.region.settle() and shared.region.released_bytes == 5 * 8192  # the pages after
    assert os.stat(shared.region.path).st_blocks == blocks - 5 * 8192 // 512
    assert all(reads_back(shared, 0, s, s, 8192) for s in range(3))
    assert not any(reads_back(shared, 0, s, s, 8192) for s in range(3, 8))
    assert not shared.write(0, 5, header(5, n=8192), data(5, 8192))  # not reserved: not written
    shared.reserve(0, 8)
    assert shared.region.settle() and shared.write(0, 5, header(5, n=8192), data(5, 8192))


def test_cpu_move_copies_the_payload_and_its_header_then_frees_the_source() -> None:
    tier = CpuTier(TierLayout(slot_bytes=(MIB,), num_slots=(8,)), pin_memory=False)
    wide = make_header(NS, header(5).chunk_hash, 0, 0, 32, MIB)  # holds a wider span than asked
    assert tier.write(0, 6, wide, data(5))
    gen = tier.generation(0, 1)
    assert tier.move(0, 6, 1, header(5))
    assert reads_back(tier, 0, 1, 5) and not reads_back(tier, 0, 6, 5)
    assert tier.header(0, 1) == wide and tier.header(0, 6) is None
    assert tier.generation(0, 1) not in (gen, gen + 1) and tier.generation(0, 1) % 2 == 0
    # src does not hold it: False, dst (which held another chunk) holds nothing, src is freed
    assert tier.write(0, 6, header(6), data(6)) and tier.write(0, 2, header(7), data(7))
    assert not tier.move(0, 6, 2, header(8))
    assert tier.header(0, 2) is None and tier.header(0, 6) is None
    assert not tier.move(0, 6, 2, header(6))  # an empty src
    with pytest.raises(ValueError):
        tier.move(0, 1, 1, header(5))


# -- disk ----------------------------------------------------------------------------------------

def _disk(root: Path, keyed: bool, slots: int = 64) -> DiskTier:
    return DiskTier(root, TierLayout(slot_bytes=(MIB, MIB), num_slots=(slots, 4)), NS,
                    keyed=I.Keyed(SECRET) if keyed else None, pipeline="never")


@pytest.mark.parametrize("keyed", [False, True])
def test_disk_release_punches_out_the_blocks_past_the_pool(tmp_path: Path, keyed: bool) -> None:
    tier = _disk(tmp_path, keyed)
    stride = tier.strides[0]
    path = tmp_path / NS / slab_name(0, MIB)
    size = os.stat(path).st_size
    assert size == 64 * stride and tier.allocated_bytes() <= 8 * PAGE  # sized sparse
    for s in range(40):
        assert tier.write(0, s, header(s), data(s))
    assert abs(tier.allocated_bytes() - 40 * stride) <= 8 * PAGE
    assert all(reads_back(tier, 0, s, s) for s in range(40))  # now in the page cache: mapped reads
    mapped = tier.mapped_reads
    freed = tier.release(0, 10)
    assert abs(freed - 30 * stride) <= 8 * PAGE
    assert abs(tier.allocated_bytes() - 10 * stride) <= 8 * PAGE
    assert os.stat(path).st_size == size  # never shorter under the mapping
    assert all(reads_back(tier, 0, s, s) for s in range(10))
    assert tier.mapped_reads > mapped
    misses = tier.misses
    assert not any(reads_back(tier, 0, s, s) for s in range(10, 40))
    assert tier.misses == misses + 30 and tier.corrupt_dropped == 0
    view = tier._maps[0][1]  # the mapping over the hole: zeros, no SIGBUS
    assert bytes(view[20 * stride:20 * stride + HEADER_BYTES]) == bytes(HEADER_BYTES)
    assert sorted(s for _, s, _ in tier.list()) == list(range(10))
    assert tier.write(0, 20, header(120), data(120)) and reads_back(tier, 0, 20, 120)
    tier.close()
    again = _disk(tmp_path, keyed)  # what a restart finds
    assert sorted(s for _, s, _ in again.list()) == list(range(10)) + [20]
    again.close()


def test_disk_release_without_hole_punching_zeroes_the_headers(tmp_path: Path, monkeypatch) -> None:
    def cannot(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(disk_mod, "punch_hole", cannot)
    tier = _disk(tmp_path, False, slots=8)
    size = os.stat(tmp_path / NS / slab_name(0, MIB)).st_size
    for s in range(6):
        assert tier.write(0, s, header(s), data(s))
    assert tier.release(0, 2) == 0 and tier.release(0, 4) == 0
    assert tier.unpunched_releases == 2
    assert all(reads_back(tier, 0, s, s) for s in range(2))
    assert not any(reads_back(tier, 0, s, s) for s in range(2, 6))
    assert sorted(s for _, s, _ in tier.list()) == [0, 1]
    assert os.stat(tmp_path / NS / slab_name(0, MIB)).st_size == size
    tier.close()


@pytest.mark.parametrize("keyed", [False, True])
def test_disk_move_verifies_then_rewrites_then_frees(tmp_path: Path, keyed: bool) -> None:
    tier = _disk(tmp_path, keyed, slots=8)
    wide = make_header(NS, header(5).chunk_hash, 0, 0, 32, MIB)
    assert tier.write(0, 6, wide, data(5))
    assert tier.move(0, 6, 1, header(5))
    assert reads_back(tier, 0, 1, 5) and not reads_back(tier, 0, 6, 5)
    (_, s, h), = tier.list()
    assert s == 1 and (h.chunk_hash, h.token_start, h.token_end) == (wide.chunk_hash, 0, 32)
    # a corrupt src: False, counted, dst (which held another chunk) and src hold nothing
    assert tier.write(0, 6, header(6), data(6)) and tier.write(0, 2, header(7), data(7))
    with open(tmp_path / NS / slab_name(0, MIB), "r+b") as f:
        at = 6 * tier.strides[0] + DATA_OFFSET + 1000
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    dropped = tier.corrupt_dropped
    assert not tier.move(0, 6, 2, header(6))
    assert tier.corrupt_dropped == dropped + 1
    assert not reads_back(tier, 0, 2, 7) and not reads_back(tier, 0, 6, 6)
    # a src that holds another chunk: False
    assert tier.write(0, 6, header(6), data(6))
    assert not tier.move(0, 6, 2, header(8))
    assert not reads_back(tier, 0, 2, 8) and not reads_back(tier, 0, 6, 6)
    assert sorted(s for _, s, _ in tier.list()) == [1]
    tier.close()


def test_disk_header_reports_what_a_slot_holds(tmp_path: Path) -> None:
    tier = _disk(tmp_path, True, slots=4)
    assert tier.header(0, 1) is None
    wide = make_header(NS, header(5).chunk_hash, 0, 0, 32, MIB)
    assert tier.write(0, 1, wide, data(5))
    h = tier.header(0, 1)
    assert h is not None and (h.chunk_hash, h.token_end, h.payload_bytes) == (wide.chunk_hash, 32, MIB)
    tier.free(0, 1)
    assert tier.header(0, 1) is None
    tier.close()
    assert tier.header(0, 1) is None


def test_fault_in_touches_only_the_starting_pools_given() -> None:
    """A learned share's layout is address space: `fault_in=(slots per group)` commits each
    group's starting pool now (no first-touch faults in an engine step there) and nothing past it."""
    from kvtier.store.tiers.factory import TierOptions, make_tier

    mib = 1 << 20
    tier = make_tier("cpu", TierLayout((mib, mib), (64, 64)), TierOptions(pin_memory=False, fault_in=(8, 3)))
    assert abs(tier.resident_bytes() - 11 * mib) <= 4 * PAGE
    whole = make_tier("cpu", TierLayout((mib,), (16,)), TierOptions(pin_memory=False, fault_in=True))
    assert abs(whole.resident_bytes() - 16 * mib) <= 4 * PAGE
