"""The store facade with real cpu and disk tiers: round trips, tiers, faults as counted misses."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group
from kvtier.core.keys import Namespace
from kvtier.core.plan import make_plan
from kvtier.store.store import Store
from kvtier.store.tiers.disk_files import DATA_OFFSET, slab_name

C = 32  # chunk tokens
GEOM = Geometry(
    groups=(
        Group("full", "full", num_layers=2, tokens_per_block=16, bytes_per_token_per_layer=64),
        Group("local", "sliding", num_layers=1, tokens_per_block=16, bytes_per_token_per_layer=32, window=40),
        Group("ssm", "state", num_layers=2, tokens_per_block=16, state_bytes_per_layer=500),
        Group("draft", "full", num_layers=1, tokens_per_block=16, bytes_per_token_per_layer=8,
              cacheable=False, reason="draft head"),
    ),
    tokens_per_hash=16,
)
PLAN = make_plan(GEOM, chunk_tokens=C)
NS = Namespace("test-model", GEOM.fingerprint(), "bfloat16")
ROW = sum(gp.chunk_bytes for gp in PLAN.cacheable_groups)  # one chunk of every cacheable group


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + 31 * i) % 50000 for i in range(n)]


def payloads(num_tokens: int, seed: int = 0) -> dict[tuple[int, int], torch.Tensor]:
    out = {}
    for gp in PLAN.cacheable_groups:
        for i in range(num_tokens // C):
            g = torch.Generator().manual_seed(seed * 1000 + gp.index * 100 + i)
            out[(gp.index, i)] = torch.randint(0, 256, (gp.chunk_bytes,), dtype=torch.uint8, generator=g)
    return out


def buffers(hit) -> dict[tuple[int, int], torch.Tensor]:
    return {k: torch.zeros(PLAN.groups[k[0]].chunk_bytes, dtype=torch.uint8) for k in _all_keys(hit)}


def _all_keys(hit) -> list[tuple[int, int]]:
    n = hit.prompt_tokens // C
    return [(gp.index, i) for gp in PLAN.cacheable_groups for i in range(n)]


def roundtrip(store: Store, toks: list[int], seed: int = 0) -> tuple[int, int]:
    hit = store.lookup_tokens(toks)
    bufs = buffers(hit)
    got = store.load(hit, bufs)
    want = payloads(len(toks), seed)
    for g, loads in enumerate(hit.chunks):
        for ld in loads:
            if ld.chunk_index * C < got:
                assert torch.equal(bufs[(g, ld.chunk_index)], want[(g, ld.chunk_index)])
    return hit.tokens, got


# Tests of the store's mechanics (admission, restart, tiers, corruption) with hand-derived
# counts of every chunk stored: placement "every". The default ("hits") is tested where its
# counts differ, and in test_store_placement.py.
EVERY = {"placement": "every"}


@pytest.mark.parametrize("placement, saved", [("every", 4 * 3), ("hits", 4 + 3 + 2)])
def test_cpu_round_trip_restores_the_hand_derived_hit(placement: str, saved: int) -> None:
    s = Store(PLAN, NS, cpu_bytes=10 * ROW, placement=placement)
    toks = tokens(130)  # 4 full chunks; the hit may use at most 129 tokens -> 128 = 4 chunks
    # hits: the endpoints are chunks 3 and 2 (ends at T = 128 and 96): full 0..3, sliding
    # (W=40) 1..3, state 2 and 3
    assert s.save_tokens(toks, payloads(130)) == saved
    hit = s.lookup_tokens(toks)
    assert hit.tokens == 128
    # full: chunks 0..3; sliding W=40 needs tokens [89, 128) -> chunks 2, 3; state: chunk 3
    assert [[ld.chunk_index for ld in loads] for loads in hit.chunks] == [[0, 1, 2, 3], [2, 3], [3], []]
    assert roundtrip(s, toks) == (128, 128)
    m = s.metrics()
    assert m["hit_tokens"] == 256 and m["restored_tokens"] == 128
    assert m["tiers"]["cpu"]["full"]["load_chunks"] == 4


def test_prompt_of_exactly_four_chunks_keeps_one_chunk_to_compute() -> None:
    s = Store(PLAN, NS, cpu_bytes=10 * ROW)
    toks = tokens(128)
    s.save_tokens(toks, payloads(128))
    assert s.lookup_tokens(toks).tokens == 96
    assert s.lookup_tokens(tokens(128, seed=1)).tokens == 0  # another prompt: a miss
    m = s.metrics()
    assert (m["lookups"], m["hit_lookups"], m["miss_lookups"], m["lookup_tokens"]) == (2, 1, 1, 256)


def test_admission_limits_the_stored_prefix() -> None:
    class AdmitOne:
        def admit(self, chunk_hashes: list[bytes]) -> int:
            return 1

    s = Store(PLAN, NS, cpu_bytes=10 * ROW, admission=AdmitOne(), **EVERY)
    assert s.save_tokens(tokens(130), payloads(130)) == 3  # chunk 0 of 3 cacheable groups
    assert s.metrics()["not_admitted"] == 3


def test_nth_sighting_admission_stores_on_the_second_sighting() -> None:
    s = Store(PLAN, NS, cpu_bytes=10 * ROW, admission="nth:2", **EVERY)
    toks = tokens(130, seed=2)
    assert s.save_tokens(toks, payloads(130, 2)) == 0  # first sighting: nothing admitted
    assert s.metrics()["not_admitted"] == 4
    assert s.save_tokens(toks, payloads(130, 2)) == 12
    assert roundtrip(s, toks, seed=2) == (128, 128)
    with pytest.raises(ConfigError, match="unknown admission policy"):
        Store(PLAN, NS, cpu_bytes=10 * ROW, admission="sometimes")


def test_disk_store_survives_a_restart(tmp_path) -> None:
    toks = tokens(100, seed=3)
    with Store(PLAN, NS, disk_dir=tmp_path, disk_bytes=8 * ROW, **EVERY) as s:
        assert s.save_tokens(toks, payloads(100, 3)) == 9
    with Store(PLAN, NS, disk_dir=tmp_path, disk_bytes=8 * ROW, **EVERY) as s2:
        assert s2.rebuilt == 9
        assert roundtrip(s2, toks, seed=3) == (96, 96)


def test_a_cpu_eviction_loses_nothing_the_disk_holds_and_disk_hits_are_promoted(tmp_path) -> None:
    """Write-through: every chunk reaches the disk at save time, so the 3 chunks per group the
    cpu tier evicts (with no copy made) are still restored, from disk."""
    s = Store(PLAN, NS, cpu_bytes=2 * ROW, disk_dir=tmp_path, disk_bytes=16 * ROW, **EVERY)
    toks = tokens(170, seed=5)  # 5 chunks; cpu holds 2 per group
    # disk: 5 chunks x 3 groups; cpu: 2 per group (chunks 0..2 are evicted within the batch
    # before their write, so they are not written to cpu at all)
    assert s.save_tokens(toks, payloads(170, 5)) == 15 + 6
    m = s.metrics()
    assert m["tiers"]["cpu"]["full"]["evictions"] == 3
    assert [m["tiers"][t][g]["save_chunks"] for t in ("cpu", "disk") for g in ("full", "local", "ssm")] == \
        [2, 2, 2, 5, 5, 5]
    assert roundtrip(s, toks, seed=5) == (160, 160)
    assert s.metrics()["promotions"] == 0  # cpu held only chunks of this hit: pinned, kept
    short = toks[: 2 * C + 1]  # its first 2 chunks live on disk only
    hit = s.lookup_tokens(short)
    assert {ld.tier for loads in hit.chunks for ld in loads} == {"disk"}
    assert roundtrip(s, short, seed=5) == (64, 64)
    # full 0, 1 + sliding 0, 1 (W=40 at T=64 needs tokens 25..63) + state 1 copied up to cpu
    assert s.metrics()["promotions"] == 5
    assert {ld.tier for loads in s.lookup_tokens(short).chunks for ld in loads} == {"cpu"}


def test_write_through_writes_every_tier(tmp_path) -> None:
    """The one write policy: a save reaches cpu and disk at once, with no eviction needed, so a
    restart (the cpu tier gone) keeps every chunk."""
    toks = tokens(70)
    with Store(PLAN, NS, cpu_bytes=4 * ROW, disk_dir=tmp_path, disk_bytes=4 * ROW, **EVERY) as s:
        assert s.save_tokens(toks, payloads(70)) == 2 * 2 * 3  # 2 chunks x 3 groups x 2 tiers
        m = s.metrics()
        assert {(t, g): m["tiers"][t][g]["save_chunks"] for t in ("cpu", "disk") for g in ("full", "local", "ssm")} \
            == dict.fromkeys([(t, g) for t in ("cpu", "disk") for g in ("full", "local", "ssm")], 2)
        assert m["evictions"] == 0
    with Store(PLAN, NS, disk_dir=tmp_path, disk_bytes=4 * ROW, **EVERY) as s2:
        assert s2.rebuilt == 6
        assert roundtrip(s2, toks) == (64, 64)


@pytest.mark.parametrize("placement, restored", [("every", 64), ("hits", 0)])
def test_a_flipped_byte_on_disk_shrinks_the_hit_and_is_dropped(tmp_path, placement: str, restored: int) -> None:
    """Full chunk 2 is bad: the hit shrinks to the largest T every group still has. With
    "hits" the state group holds checkpoints only at T = 128 and 96 (the endpoints), so no
    shorter T is whole and nothing is restored: a skipped checkpoint shortens a hit, it never
    makes one partial."""
    toks = tokens(130, seed=9)
    with Store(PLAN, NS, disk_dir=tmp_path, disk_bytes=8 * ROW, placement=placement) as s:
        s.save_tokens(toks, payloads(130, 9))
        hit = s.lookup_tokens(toks)
        full_chunk2 = next(ld for ld in hit.chunks[0] if ld.chunk_index == 2)
        path = tmp_path / NS.id / slab_name(0, PLAN.groups[0].chunk_bytes)
        from kvtier.store.tiers.disk_files import slot_stride
        with open(path, "r+b") as f:
            off = full_chunk2.slot * slot_stride(PLAN.groups[0].chunk_bytes) + DATA_OFFSET + 77
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x40]))
        assert roundtrip(s, toks, seed=9) == (128, restored)  # full chunk 2 bad -> T = 2 chunks
        m = s.metrics()
        assert m["corrupt_dropped"] == 1
        assert s.lookup_tokens(toks).tokens == restored  # removed: never offered again


def test_missing_buffer_limits_the_restore() -> None:
    s = Store(PLAN, NS, cpu_bytes=10 * ROW)
    toks = tokens(130)
    s.save_tokens(toks, payloads(130))
    hit = s.lookup_tokens(toks)
    bufs = buffers(hit)
    del bufs[(2, 3)]  # no buffer for the state checkpoint at 128
    # state group: a hit of 96 needs chunk 2's checkpoint; sliding W=40 needs chunks 1, 2
    assert s.load(hit, bufs) == 96


def test_eight_equal_groups_with_room_for_sixteen_payloads_hold_sixteen() -> None:
    geom = Geometry(
        groups=tuple(Group(f"g{k}", "full", num_layers=1, tokens_per_block=16, bytes_per_token_per_layer=16)
                     for k in range(8)),
        tokens_per_hash=16,
    )
    plan = make_plan(geom, chunk_tokens=32)
    chunk = plan.groups[0].chunk_bytes
    ns = Namespace("eight", geom.fingerprint(), "bfloat16")
    s = Store(plan, ns, cpu_bytes=16 * chunk)
    toks = tokens(64 + 1)  # 2 chunks x 8 groups = 16 payloads
    pl = {(g, i): torch.full((chunk,), g * 10 + i, dtype=torch.uint8) for g in range(8) for i in range(2)}
    assert s.save_tokens(toks, pl) == 16
    assert s.lookup_tokens(toks).tokens == 64
    assert s.metrics()["evictions"] == 0


def test_a_save_larger_than_the_disk_tier_keeps_what_saving_one_by_one_keeps(tmp_path, monkeypatch) -> None:
    """Store.save hands the disk tier its payloads as one batch (two lanes); in a batch that
    needs more slots than the tier has, a payload evicted before its write is not written, and
    LRU ends where one-by-one saving does."""
    import kvtier.store.tiers.disk as disk

    monkeypatch.setattr(disk, "PIPELINE", "always")
    monkeypatch.setattr(disk, "PIECE_BYTES", 4096)  # every 4 KiB payload may take a lane
    geom = Geometry(groups=tuple(Group(f"g{k}", "full", num_layers=2, tokens_per_block=16,
                                       bytes_per_token_per_layer=64) for k in range(2)), tokens_per_hash=16)
    plan = make_plan(geom, chunk_tokens=C)
    ns = Namespace("batch", geom.fingerprint(), "bfloat16")
    chunk = plan.groups[0].chunk_bytes  # 2 layers x 32 tokens x 64 = 4096
    s = Store(plan, ns, disk_dir=tmp_path, disk_bytes=2 * 2 * chunk)  # 2 slots a group
    toks = tokens(4 * C + 1)
    hashes = s.hashes(toks)
    pl = {(g, i): torch.full((chunk,), 10 * g + i, dtype=torch.uint8) for g in range(2) for i in range(4)}
    # one by one: chunks 0, 1 fill each group; 2 evicts 0, 3 evicts 1 (0, 1: never written)
    assert s.save(hashes, pl, len(toks)) == 4
    m = s.metrics()
    assert (m["failed_saves"], m["evictions"]) == (0, 4)
    assert s.slot_tiers["disk"].helper_ios > 0
    held = {(g, i) for g in range(2) for i in range(4) if s.index.contains(hashes[i], g, "disk")}
    assert held == {(0, 2), (0, 3), (1, 2), (1, 3)}
    tier = s.slot_tiers["disk"]
    for g, slot, header in tier.list():
        out = torch.empty(chunk, dtype=torch.uint8)
        assert tier.read(g, slot, header, out)
        assert torch.equal(out, pl[(g, header.token_start // C)])
    s.close()


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_queued_writes_leave_the_index_where_saving_one_by_one_does(tmp_path, monkeypatch, policy) -> None:
    """Store.save walks the index payload by payload (held: touch; else reserve, commit) and
    only queues the writes; the same saves made one payload per call (each written before the
    next reservation) must leave every tier holding the same chunks, with the same evictions,
    and the batched store must restore the right bytes."""
    import random
    import types

    import kvtier.store.tiers.disk as disk
    from kvtier.store.io import TierIO

    monkeypatch.setattr(disk, "PIPELINE", "always")
    monkeypatch.setattr(disk, "PIECE_BYTES", 4096)  # the full group's 4 KiB payloads take lanes
    mk = lambda d: Store(PLAN, NS, cpu_bytes=3 * ROW, disk_dir=tmp_path / d, disk_bytes=6 * ROW,  # noqa: E731
                         policy=policy)
    batched, single = mk("a"), mk("b")

    def one_by_one(self, tier, items, *args, **kw):  # type: ignore[no-untyped-def]
        return [w for it in items for w in TierIO._store_many(self, tier, [it], *args, **kw)]

    single._store_many = types.MethodType(one_by_one, single)  # type: ignore[method-assign]
    rng = random.Random(11)
    seen: set[bytes] = set()
    for _ in range(40):
        seed, n = rng.randint(0, 3), rng.randint(1, 5)
        toks = tokens(n * C + 1, seed)
        for s in (batched, single):
            s.save_tokens(toks, payloads(n * C, seed))
        seen.update(batched.hashes(toks))
        for g in range(3):
            for h in seen:
                assert sorted(batched.index.where(h, g)) == sorted(single.index.where(h, g))
    mb, ms = batched.metrics(), single.metrics()
    assert mb["evictions"] == ms["evictions"] > 0
    assert (mb["failed_saves"], mb["corrupt_dropped"]) == (0, 0)
    assert batched.slot_tiers["disk"].helper_ios > 0  # saves were written on two lanes
    for seed in range(4):
        toks = tokens(5 * C + 1, seed)
        hit = batched.lookup_tokens(toks)
        bufs = buffers(hit)
        got = batched.load(hit, bufs)
        want = payloads(5 * C, seed)
        for g, loads in enumerate(hit.chunks):
            for ld in loads:
                if (ld.chunk_index + 1) * C <= got:
                    assert torch.equal(bufs[(g, ld.chunk_index)], want[(g, ld.chunk_index)])
    batched.close()
    single.close()


def test_a_save_that_meets_chunks_it_holds_keeps_the_one_by_one_order() -> None:
    """Held chunks are touched in their turn, not before the new ones are reserved: with room
    for 2 and h1, h2 held, saving h0, h1, h2 evicts h1 (for h0), h2 (for h1), h0 (for h2)."""
    geom = Geometry(groups=(Group("full", "full", num_layers=1, tokens_per_block=16,
                                  bytes_per_token_per_layer=16),), tokens_per_hash=16)
    plan = make_plan(geom, chunk_tokens=C)
    s = Store(plan, Namespace("order", geom.fingerprint(), "bfloat16"), cpu_bytes=2 * plan.groups[0].chunk_bytes)
    h0, h1, h2 = (bytes([k]) * 32 for k in range(3))
    pl = lambda hs: {(0, i): torch.full((plan.groups[0].chunk_bytes,), i, dtype=torch.uint8)  # noqa: E731
                     for i in range(len(hs))}
    assert s.save([h1, h2], pl([h1, h2]), 2 * C) == 2
    assert s.save([h0, h1, h2], pl([h0, h1, h2]), 3 * C) == 2  # h0, evicted before its write: not written
    assert {h for h in (h0, h1, h2) if s.index.contains(h, 0, "cpu")} == {h1, h2}
    assert s.metrics()["evictions"] == 3


def test_construction_errors_are_clear(tmp_path) -> None:
    with pytest.raises(ConfigError, match="capacity 0"):
        Store(PLAN, NS, cpu_bytes=0)
    with pytest.raises(ConfigError, match="less than one chunk"):
        Store(PLAN, NS, cpu_bytes=ROW - 1)
    with pytest.raises(ConfigError, match="unknown .*policy|policy .*unknown"):
        Store(PLAN, NS, cpu_bytes=4 * ROW, policy="mru-ish")
    with pytest.raises(ConfigError, match="no tier"):
        Store(PLAN, NS)
    with pytest.raises(ConfigError, match="disk_dir and disk_bytes"):
        Store(PLAN, NS, disk_dir=tmp_path)


def test_wrong_payload_size_is_a_caller_error() -> None:
    s = Store(PLAN, NS, cpu_bytes=4 * ROW)
    bad = payloads(40)
    bad[(0, 0)] = bad[(0, 0)][:-1]
    with pytest.raises(ConfigError, match="plan says"):
        s.save_tokens(tokens(40), bad)


def test_prometheus_collector_exports_the_counters() -> None:
    prom = pytest.importorskip("prometheus_client")
    s = Store(PLAN, NS, cpu_bytes=4 * ROW)
    s.save_tokens(tokens(70), payloads(70))
    reg = prom.CollectorRegistry()
    s.register_prometheus(reg)
    assert reg.get_sample_value("kvtier_save_chunks_total", {"tier": "cpu", "group": "full"}) == 2
    assert reg.get_sample_value("kvtier_lookups_total") == 0


def test_threads_sharing_one_store_restore_only_their_own_bytes(tmp_path) -> None:
    import threading

    s = Store(PLAN, NS, cpu_bytes=6 * ROW, disk_dir=tmp_path, disk_bytes=12 * ROW)
    errors: list[str] = []

    def worker(seed: int) -> None:
        toks = tokens(130, seed=seed)
        for _ in range(5):
            s.save_tokens(toks, payloads(130, seed))
            hit = s.lookup_tokens(toks)
            bufs = buffers(hit)
            got = s.load(hit, bufs)
            want = payloads(130, seed)
            for g, loads in enumerate(hit.chunks):
                for ld in loads:
                    if (ld.chunk_index + 1) * C <= got and not torch.equal(bufs[(g, ld.chunk_index)], want[(g, ld.chunk_index)]):
                        errors.append(f"seed {seed}: group {g} chunk {ld.chunk_index} restored wrong bytes")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    m = s.metrics()
    assert m["corrupt_dropped"] == 0 and m["failed_saves"] == 0
    assert m["tiers"]["cpu"]["full"]["evictions"] > 0  # 4 prompts x 4 chunks do not fit the cpu tier's 6


def test_a_bad_cpu_copy_falls_back_to_the_disk_copy(tmp_path) -> None:
    s = Store(PLAN, NS, cpu_bytes=4 * ROW, disk_dir=tmp_path, disk_bytes=4 * ROW)
    toks = tokens(70, seed=4)
    s.save_tokens(toks, payloads(70, 4))
    hit = s.lookup_tokens(toks)
    cpu = s.slot_tiers["cpu"]
    ld = hit.chunks[0][1]  # full group, chunk 1, in cpu
    assert ld.tier == "cpu"
    # make the cpu slot claim another chunk: a foreign header there is dropped on read
    cpu.commit(0, ld.slot, s.header(b"\x01" * 32, 0, 1))
    assert roundtrip(s, toks, seed=4) == (64, 64)
    m = s.metrics()
    assert m["corrupt_dropped"] == 1
    assert m["tiers"]["disk"]["full"]["load_chunks"] == 1
