"""The tier contract run against the cpu and disk tiers, plus what only slot tiers promise."""

from __future__ import annotations

import os

import pytest
import torch
from tier_contract import LAYOUT, NS, TierContract, header, payload

from kvtier.errors import ConfigError
from kvtier.store.tiers.base import TierLayout
from kvtier.store.tiers.cpu import CpuTier
from kvtier.store.tiers.disk import DiskTier, split_lanes
from kvtier.store.tiers.disk_files import DATA_OFFSET, resident, slab_name


class SlotTierExtras:
    """Slot tiers drop a foreign payload when it is read (it can never be right again)."""

    def test_foreign_read_is_counted_and_dropped(self, tier) -> None:
        h = header(40, 0)
        tier.write(0, 2, h, payload(40, h.payload_bytes))
        assert tier.read(0, 2, header(41, 0), torch.zeros(h.payload_bytes, dtype=torch.uint8)) is False
        assert tier.corrupt_dropped == 1
        assert tier.read(0, 2, h, torch.zeros(h.payload_bytes, dtype=torch.uint8)) is False

    def test_out_of_range_slot_and_oversized_payload_raise(self, tier) -> None:
        with pytest.raises(ConfigError, match="slot 4 out of range"):
            tier.free(0, 4)
        big = header(42, 1, nbytes=LAYOUT.slot_bytes[1] + 1)
        with pytest.raises(ConfigError, match="does not fit group 1"):
            tier.write(1, 0, big, payload(1, big.payload_bytes))


class TestCpuTier(TierContract, SlotTierExtras):
    @pytest.fixture
    def make_tier(self):
        return lambda layout: CpuTier(layout)

    def test_view_is_zero_copy(self, tier: CpuTier) -> None:
        h = header(50, 0)
        tier.write(0, 1, h, payload(50, h.payload_bytes))
        v = tier.view(0, 1, h.payload_bytes)
        assert v.data_ptr() == tier.slabs[0][1].data_ptr()
        assert torch.equal(v, payload(50, h.payload_bytes))


class TestDiskTier(TierContract, SlotTierExtras):
    options: dict[str, object] = {}  # DiskTier keyword arguments; the subclasses below vary them

    @pytest.fixture
    def make_tier(self, tmp_path):
        made: list[DiskTier] = []

        def make(layout: TierLayout) -> DiskTier:
            t = DiskTier(tmp_path, layout, NS, **self.options)  # type: ignore[arg-type]
            made.append(t)
            return t

        yield make
        for t in made:
            t.close()

    def test_restart_lists_and_reads_what_was_written(self, make_tier) -> None:
        t1 = make_tier(LAYOUT)
        h = header(60, 2)
        data = payload(60, h.payload_bytes)
        t1.write(2, 1, h, data)
        t1.close()
        t2 = make_tier(LAYOUT)
        assert [(g, s, x.key) for g, s, x in t2.list()] == [(2, 1, h.key)]
        out = torch.zeros(h.payload_bytes, dtype=torch.uint8)
        assert t2.read(2, 1, h, out) and torch.equal(out, data)

    def test_second_writer_is_refused_clearly(self, tier, tmp_path) -> None:
        from kvtier.errors import TierError

        with pytest.raises(TierError, match="in use by another writer"):
            DiskTier(tmp_path, LAYOUT, NS)
        other = DiskTier(tmp_path, LAYOUT, "0000000000000001")  # another namespace: fine
        other.close()

    def test_fsync_always_round_trips(self, tmp_path) -> None:
        t = DiskTier(tmp_path, LAYOUT, NS, fsync="always")
        h = header(61, 1)
        assert t.write(1, 0, h, payload(61, h.payload_bytes))
        out = torch.zeros(h.payload_bytes, dtype=torch.uint8)
        assert t.read(1, 0, h, out) and torch.equal(out, payload(61, h.payload_bytes))
        t.close()


    def test_resident_slots_are_read_through_the_mapping_and_cold_ones_with_preadv(self, tier: DiskTier) -> None:
        import os

        h = header(62, 2)
        data = payload(62, h.payload_bytes)
        assert tier.write(2, 1, h, data)
        fd = tier._fds[2]
        os.fsync(fd)  # DONTNEED drops clean, unmapped pages only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = tier._maps[2]
        assert m is not None and not resident(m[2], tier.strides[2], DATA_OFFSET + h.payload_bytes)
        out = torch.zeros(h.payload_bytes, dtype=torch.uint8)
        assert tier.read(2, 1, h, out) and torch.equal(out, data)
        assert tier.mapped_reads == 0  # cold: preadv, which also brings the pages in
        out.zero_()
        assert tier.read(2, 1, h, out) and torch.equal(out, data)
        assert tier.mapped_reads == 1  # now resident: through the mapping

    expect_mapped = 1  # reads of a just-written slot that go through the mapping

    def test_a_flipped_payload_byte_is_a_counted_miss_and_dropped(self, tier: DiskTier) -> None:
        import os

        h = header(63, 2)
        assert tier.write(2, 0, h, payload(63, h.payload_bytes))
        fd = tier._fds[2]
        at = DATA_OFFSET + h.payload_bytes - 1  # the payload's last byte
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
        out = torch.zeros(h.payload_bytes, dtype=torch.uint8)
        assert tier.read(2, 0, h, out) is False
        assert tier.mapped_reads == self.expect_mapped and tier.corrupt_dropped == 1
        assert tier.read(2, 0, h, out) is False  # dropped: now an empty slot


class TestDiskTierPreadv(TestDiskTier):
    """The same contract with the mapping off: every read is one preadv + one checksum pass."""

    options = {"mapped_reads": False}
    # the parent's mapping test does not apply with the mapping off; this class's own test says
    # what holds instead
    test_resident_slots_are_read_through_the_mapping_and_cold_ones_with_preadv = None

    def test_with_the_mapping_off_even_a_resident_slot_is_read_with_preadv(self, tier: DiskTier) -> None:
        h = header(62, 2)
        assert tier.write(2, 1, h, payload(62, h.payload_bytes))
        out = torch.zeros(h.payload_bytes, dtype=torch.uint8)
        assert tier.read(2, 1, h, out) and torch.equal(out, payload(62, h.payload_bytes))
        assert tier.mapped_reads == 0 and tier._maps == [None] * len(tier._maps)

    expect_mapped = 0


class TestDiskTierPipelined(TestDiskTierPreadv):
    """The same contract with the helper thread always on and 4 KiB pieces: `write_many` of two
    or more payloads runs two lanes, and cold reads of >= 2 pieces (group 2's 12289-byte slots:
    3 pieces of 4096 + 1 byte) stream their pieces through the helper."""

    options = {"pipeline": "always", "piece_bytes": 4096, "mapped_reads": False}

    def test_large_cold_reads_go_through_the_helper_and_single_writes_do_not(self, tier: DiskTier) -> None:
        big, small = header(80, 2), header(81, 0)
        assert tier.write(2, 0, big, payload(80, big.payload_bytes))  # one payload: no lane to share
        assert tier.write(0, 0, small, payload(81, small.payload_bytes))
        assert tier.helper_ios == 0
        out = torch.zeros(big.payload_bytes, dtype=torch.uint8)
        assert tier.read(2, 0, big, out) and torch.equal(out, payload(80, big.payload_bytes))
        assert tier.read(0, 0, small, out[:4096])  # one piece: no hop
        assert tier.helper_ios == 1


    def test_write_many_writes_two_lanes_and_counts_like_single_writes(self, tier: DiskTier) -> None:
        items = [(g, s, header(90 + 4 * g + s, g)) for g in (0, 2) for s in range(2)]
        items.append((1, 0, header(99, 1, nbytes=100)))  # below one piece: counted, no lane needed
        datas = [payload(h.key[0][0], h.payload_bytes) for _, _, h in items]
        assert tier.write_many([(g, s, h, d) for (g, s, h), d in zip(items, datas)]) == [True] * 5
        # split_lanes: group 2 has 75% of the bytes, so payloads are dealt one by one to the
        # lighter lane: this thread writes items 0, 2, 4, the helper items 1 and 3
        assert tier.helper_ios == 2
        st = tier.stats()
        assert (st.writes, st.failed_writes, st.bytes_written) == (5, 0, 2 * 4096 + 2 * 12289 + 100)
        for (g, s, h), d in zip(items, datas):
            out = torch.zeros(h.payload_bytes, dtype=torch.uint8)
            assert tier.read(g, s, h, out) and torch.equal(out, d)

    def test_a_failed_write_on_either_lane_is_counted_and_the_rest_land(self, tier: DiskTier) -> None:
        items = [(g, s, header(110 + 4 * g + s, g)) for g in (0, 2) for s in range(2)]
        datas = [payload(h.key[0][0], h.payload_bytes) for _, _, h in items]
        for g in (0, 2):  # both lanes (items 0, 2 here; 1, 3 on the helper) write to read-only fds
            os.close(tier._fds[g])
            tier._fds[g] = os.open(tier.dir / slab_name(g, LAYOUT.slot_bytes[g]), os.O_RDONLY)
        assert tier.write_many([(g, s, h, d) for (g, s, h), d in zip(items, datas)]) == [False] * 4
        assert (tier.stats().failed_writes, tier.stats().writes) == (4, 0)
        assert "Bad file descriptor" in tier.last_error
        assert list(tier.list()) == []


def test_split_lanes_by_file_where_balanced_else_by_payload() -> None:
    bench = [(0, 8), (1, 8), (2, 2), (3, 4)] * 4  # per group 32, 32, 8, 16 of 88
    # g0 -> lane 0, g1 -> lane 1, g3 -> lane 0 (48), g2 -> lane 1 (40): 48 <= 0.6 x 88
    assert split_lanes(bench) == ([0, 3, 4, 7, 8, 11, 12, 15], [1, 2, 5, 6, 9, 10, 13, 14])
    # one file: payloads dealt to the lighter lane (ties to lane 0)
    assert split_lanes([(0, 5)] * 4) == ([0, 2], [1, 3])
    # one group with 20 of 22 bytes: by payload, 10 | 1, then 10 -> lane 1 (1 < 10), 1 -> lane 0
    assert split_lanes([(0, 10), (1, 1), (0, 10), (1, 1)]) == ([0, 3], [1, 2])
    assert split_lanes([]) == ([], [])


def test_capacity_zero_and_unknown_fsync_raise_at_construction(tmp_path) -> None:
    with pytest.raises(ConfigError, match="capacity is 0 slots"):
        TierLayout(slot_bytes=(4096,), num_slots=(0,))
    with pytest.raises(ConfigError, match="fsync policy 'sometimes' unknown"):
        DiskTier(tmp_path, LAYOUT, NS, fsync="sometimes")
    with pytest.raises(ConfigError, match="pipeline mode 'sideways' unknown"):
        DiskTier(tmp_path, LAYOUT, NS, pipeline="sideways")
    with pytest.raises(ConfigError, match="piece_bytes 100 is too small"):
        DiskTier(tmp_path, LAYOUT, NS, piece_bytes=100)


def test_a_smaller_restart_drops_the_slots_past_its_capacity(tmp_path) -> None:
    big = TierLayout(slot_bytes=(4096,), num_slots=(4,))
    t = DiskTier(tmp_path, big, NS)
    for s in range(4):
        h = header(70 + s, 0)
        assert t.write(0, s, h, payload(s, 4096))
    t.close()
    small = DiskTier(tmp_path, TierLayout(slot_bytes=(4096,), num_slots=(2,)), NS)
    assert sorted(s for _, s, _ in small.list()) == [0, 1]
    small.close()
    again = DiskTier(tmp_path, big, NS)  # growing back does not resurrect them
    assert sorted(s for _, s, _ in again.list()) == [0, 1]
    again.close()


def test_slab_files_of_the_older_layout_are_ignored_with_a_warning(tmp_path, caplog) -> None:
    old = tmp_path / NS / "g000-4096.slab"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"\x01" * 8192)
    with caplog.at_level("WARNING"):
        t = DiskTier(tmp_path, TierLayout(slot_bytes=(4096,), num_slots=(2,)), NS)
    assert list(t.list()) == [] and t.corrupt_dropped == 0
    t.close()
    assert old.read_bytes() == b"\x01" * 8192  # left alone, not read, not truncated
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "older kvtier layout (g000-4096.slab)" in msg and "delete them" in msg
