"""The tier contract suite: one set of tests every tier must pass.

Use it by subclassing `TierContract` in a `test_*.py` module and overriding the `make_tier`
fixture: it returns a factory `make(layout: TierLayout) -> Tier` for a fresh, empty tier of
namespace `NS` (a slot-addressed tier uses the layout; a key-addressed one may ignore it).
The factory may be called twice in one test (a second tier on the same storage, for
persistent tiers); close what you open in the fixture's teardown.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.store.payload import ChunkHeader, make_header
from kvtier.store.tiers.base import Tier, TierLayout

NS = "00112233aabbccdd"
OTHER_NS = "ffeeddcc33221100"
# three groups of unequal slot sizes (a hybrid model): 4 KiB, 1 KiB, 12 KiB + 1 byte
LAYOUT = TierLayout(slot_bytes=(4096, 1024, 12289), num_slots=(4, 3, 2))


def header(i: int, group: int, nbytes: int | None = None, ns: str = NS) -> ChunkHeader:
    n = LAYOUT.slot_bytes[group] if nbytes is None else nbytes
    return make_header(ns, bytes([i]) * 32, group, 256 * i, 256 * (i + 1), n, "uint8")


def payload(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class TierContract:
    @pytest.fixture
    def make_tier(self):  # pragma: no cover - overridden
        raise NotImplementedError("override make_tier in the tier's test module")

    @pytest.fixture
    def tier(self, make_tier) -> Tier:
        return make_tier(LAYOUT)

    def test_write_then_read_gives_the_same_bytes(self, tier: Tier) -> None:
        for g in range(3):
            h = header(1, g)
            data = payload(g, h.payload_bytes)
            assert tier.write(g, 1, h, data) is True
            out = torch.zeros(h.payload_bytes, dtype=torch.uint8)
            assert tier.read(g, 1, h, out) is True
            assert torch.equal(out, data)

    def test_read_into_a_bytearray_and_a_wider_buffer(self, tier: Tier) -> None:
        h = header(2, 0, nbytes=1000)  # shorter than the slot
        data = payload(7, 1000)
        assert tier.write(0, 0, h, data)
        buf = bytearray(1000)
        assert tier.read(0, 0, h, buf)
        assert bytes(buf) == data.numpy().tobytes()
        wide = torch.full((2000,), 9, dtype=torch.uint8)
        assert tier.read(0, 0, h, wide)
        assert torch.equal(wide[:1000], data) and int(wide[1000:].min()) == 9

    def test_a_chunk_serves_only_the_span_it_holds_and_is_kept(self, tier: Tier) -> None:
        """vLLM stores a group's first chunk from a block mid-chunk: the header holds tokens
        [320, 512) of the chunk [256, 512). A load of [384, 512) is served; a load that needs
        [256, 512) is a plain miss that keeps the chunk (valid for its own span; in a shared
        Redis other engines read it), never a corrupt drop."""
        from dataclasses import replace

        full = header(1, 0)
        held = replace(full, token_start=320)
        data = payload(11, full.payload_bytes)
        assert tier.write(0, 1, held, data)
        out = torch.zeros(full.payload_bytes, dtype=torch.uint8)
        assert tier.read(0, 1, full, out) is False  # (a failed read may have filled `out`: unused)
        assert tier.corrupt_dropped == 0
        assert tier.read(0, 1, replace(full, token_start=384), out) is True
        assert torch.equal(out, data)

    def test_never_written_is_a_plain_miss(self, tier: Tier) -> None:
        h = header(3, 1)
        out = torch.zeros(h.payload_bytes, dtype=torch.uint8)
        assert tier.read(1, 2, h, out) is False
        assert tier.corrupt_dropped == 0
        assert tier.misses == 1

    def test_free_makes_it_a_miss(self, tier: Tier) -> None:
        h = header(4, 0)
        assert tier.write(0, 3, h, payload(1, h.payload_bytes))
        tier.free(0, 3)
        assert tier.read(0, 3, h, torch.zeros(h.payload_bytes, dtype=torch.uint8)) is False
        assert not [e for e in tier.list() if e[2].key == h.key]

    def test_another_chunk_or_namespace_is_never_restored(self, tier: Tier) -> None:
        h = header(5, 0)
        data = payload(5, h.payload_bytes)
        assert tier.write(0, 0, h, data)
        for wrong in (header(6, 0), header(5, 0, ns=OTHER_NS), header(5, 0, nbytes=100)):
            out = torch.zeros(wrong.payload_bytes, dtype=torch.uint8)
            assert tier.read(0, 0, wrong, out) is False

    def test_overwrite_replaces_the_chunk(self, tier: Tier) -> None:
        old, new = header(8, 2), header(9, 2)
        assert tier.write(2, 0, old, payload(8, old.payload_bytes))
        assert tier.write(2, 0, new, payload(9, new.payload_bytes))
        out = torch.zeros(new.payload_bytes, dtype=torch.uint8)
        assert tier.read(2, 0, new, out) and torch.equal(out, payload(9, new.payload_bytes))

    def test_list_reports_what_is_held(self, tier: Tier) -> None:
        written = {}
        for g, s, i in ((0, 0, 10), (1, 2, 11), (2, 1, 12)):
            h = header(i, g)
            assert tier.write(g, s, h, payload(i, h.payload_bytes))
            written[h.key] = h
        listed = {h.key: h for _, _, h in tier.list()}
        assert set(listed) == set(written)
        for key, h in written.items():
            assert (listed[key].group, listed[key].payload_bytes) == (h.group, h.payload_bytes)

    def test_batched_calls_match_single_calls(self, tier: Tier) -> None:
        hs = [header(20 + s, 0) for s in range(3)]
        datas = [payload(20 + s, h.payload_bytes) for s, h in enumerate(hs)]
        assert tier.write_many([(0, s, h, d) for s, (h, d) in enumerate(zip(hs, datas))]) == [True] * 3
        outs = [torch.zeros(h.payload_bytes, dtype=torch.uint8) for h in hs]
        missing = header(99, 0)
        res = tier.read_many([(0, s, h, o) for s, (h, o) in enumerate(zip(hs, outs))]
                             + [(0, 3, missing, torch.zeros(missing.payload_bytes, dtype=torch.uint8))])
        assert res == [True, True, True, False]
        assert all(torch.equal(o, d) for o, d in zip(outs, datas))

    def test_counters_add_up(self, tier: Tier) -> None:
        h = header(30, 1)
        tier.write(1, 0, h, payload(30, h.payload_bytes))
        tier.read(1, 0, h, torch.zeros(h.payload_bytes, dtype=torch.uint8))
        tier.read(1, 1, header(31, 1), torch.zeros(h.payload_bytes, dtype=torch.uint8))
        st = tier.stats()
        assert (st.writes, st.reads, st.misses) == (1, 2, 1)
        assert st.bytes_written == st.bytes_read == h.payload_bytes
