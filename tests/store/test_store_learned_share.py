"""The learned share in the Store (docs/admission.md, "The learned share in the Store"): with
placement "hits" each group's pool follows the bytes it stores warm (`kvtier.index.share`), the
store moves and releases slots as pools shrink, so a state hybrid restores more than the fixed
half/half share in the same bytes, what the cpu tier commits stays within them, and a disk tier
keeps what it holds across a restart. Real tensors, real files, every loaded byte checked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvtier.core.geometry import Geometry
from kvtier.core.plan import make_plan
from kvtier.errors import ConfigError
from kvtier.index.index import Resized
from kvtier.index.pool import slot_counts
from kvtier.store.store import Store, make_placement, placement_share, resolve_share
from kvtier.store.tiers.cpu import PAGE
from kvtier.store.tiers.disk_files import slot_stride

from test_store_placement import C, GEOM, NS, PLAN, ROW, conversation, expected

GROUPS = [gp.index for gp in PLAN.cacheable_groups]


def _thp_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


# what a tier may commit beyond its bytes: the page a kept slot ends in, per group (with
# transparent huge pages always on, a touched 2 MiB range may be committed whole)
SLACK = len(GROUPS) * (PAGE + (2 << 20 if _thp_always() else 0))


def run(store: Store, prompts: list[list[int]], after=None) -> dict[str, int]:
    """Each prompt: lookup, load into fresh buffers, check every loaded byte, save; `after(store)`
    after every request."""
    restored = checked = bad = 0
    for toks in prompts:
        hashes = store.hashes(toks)
        hit = store.lookup(hashes, len(toks))
        bufs = {(g, i): torch.zeros(PLAN.groups[g].chunk_bytes, dtype=torch.uint8)
                for g in GROUPS for i in range(len(hashes))}
        got = store.load(hit, bufs)
        restored += got
        for g in GROUPS:
            for i in PLAN.chunks_for_hit(g, got):
                checked += 1
                bad += int(not torch.equal(bufs[(g, i)], expected(hashes[i], g)))
        store.save(hashes, lambda g, i: expected(hashes[i], g), len(toks))
        if after is not None:
            after(store)
    return {"restored": restored, "checked": checked, "mismatches": bad}


def share_counters(store: Store) -> dict[str, float]:
    return {k: v for k, v in store.metrics().items() if k.startswith("share_")}


def held_bytes(store: Store, tier: str) -> int:
    return sum(store.index.slots(g, tier) * PLAN.groups[g].chunk_bytes for g in GROUPS)


def test_the_learned_share_restores_more_than_half_half_in_the_same_bytes() -> None:
    """The whole trace head (2,700 requests of Mooncake's conversation trace) into a cpu tier of
    10% of its unique chunks. Measured: the fixed half/half share restores 285,632 tokens, the
    learned one (the default, starting from half/half) 322,560 (+13%; its state pool ends at
    1,335 slots, 24% of the bytes, against half/half's 2,798). Every loaded byte is the one
    saved, and after every request the cpu tier commits at most its bytes (+ the page a kept
    slot ends in, per group; measured: 615 bytes over at worst). Started proportional, as
    `kvtier replay`'s is, it restores 321,152 here but 14,960 over the first 600 requests
    (half/half: 20,208; from half/half: 28,464): it moves 1/32 of the tier every 64 requests."""
    prompts = conversation(2700)
    unique = len({tuple(p[: (k + 1) * C]) for p in prompts for k in range(len(p) // C)})
    assert unique == 47971
    cpu = unique * ROW // 10
    worst = [0]

    def within_bytes(store: Store) -> None:
        tier = store.slot_tiers["cpu"]
        worst[0] = max(worst[0], tier.resident_bytes() - cpu)
        assert held_bytes(store, "cpu") <= cpu  # the pools, in the index
        assert all(store.index.slots(g, "cpu") <= tier.layout.num_slots[g] for g in GROUPS)
        assert tier.resident_bytes() <= cpu + SLACK  # the memory, page by page (mincore)

    out = {}
    with Store(PLAN, NS, cpu_bytes=cpu, share=placement_share(PLAN), pin_memory=False) as s:
        out["half/half"] = run(s, prompts)
    with Store(PLAN, NS, cpu_bytes=cpu, pin_memory=False) as s:  # the default: learned
        assert s.index.learners
        out["learned"] = run(s, prompts, within_bytes)
        out["learned"].update(share_counters(s))
        out["state slots"] = s.index.slots(1, "cpu")
    print(out, "resident beyond cpu_bytes at worst:", worst[0])
    for r in (out["half/half"], out["learned"]):
        assert r["checked"] > 10_000 and r["mismatches"] == 0, out
    learned = out["learned"]
    assert learned["share_resizes"] > 0 and learned["share_moved"] > 0 and learned["share_released_bytes"] > 0
    assert learned["share_move_failed"] == 0
    assert learned["restored"] > out["half/half"]["restored"], out


def test_moved_chunks_load_byte_exact(monkeypatch) -> None:
    """A state pool that shrinks while full: the entries the index relocates are moved (counted),
    and each one still held reads back from its new slot as saved, through the tier and through
    a store load of a prompt that needs it."""
    prompts = conversation(700)
    s = Store(PLAN, NS, cpu_bytes=2000 * ROW, pin_memory=False)
    for learner in s.index.learners:
        learner.period = 8  # resize often: a short run moves many entries
    moves: list = []
    observe = s.index.observe

    def recording() -> Resized:
        r = observe()
        moves.extend(r.moved)
        return r

    monkeypatch.setattr(s.index, "observe", recording)
    where = {}  # chunk hash -> (prompt, chunk index)
    for toks in prompts:
        for i, h in enumerate(s.hashes(toks)):
            where.setdefault(h, (toks, i))
    r = run(s, prompts)
    assert r["mismatches"] == 0
    m = share_counters(s)
    assert m["share_moved"] == len(moves) > 50 and m["share_move_failed"] == 0, m
    tier = s.slot_tiers["cpu"]
    checked = 0
    loaded = set()
    for mv in moves:
        if s.index.where(mv.chunk_hash, mv.group) != [("cpu", mv.to_slot)]:
            continue  # moved again or evicted since
        toks, i = where[mv.chunk_hash]
        out = torch.zeros(PLAN.groups[mv.group].chunk_bytes, dtype=torch.uint8)
        assert tier.read(mv.group, mv.to_slot, s.header(mv.chunk_hash, mv.group, i), out)
        assert torch.equal(out, expected(mv.chunk_hash, mv.group))
        checked += 1
        if mv.group == 1 and len(loaded) < 20:  # a state checkpoint: a hit ending right after it
            prompt = toks[: (i + 1) * C + 1]
            hit = s.lookup_tokens(prompt)
            if hit.tokens == (i + 1) * C:
                bufs = {(g, j): torch.zeros(PLAN.groups[g].chunk_bytes, dtype=torch.uint8)
                        for g in GROUPS for j in range(i + 1)}
                assert s.load(hit, bufs) == (i + 1) * C
                hashes = s.hashes(prompt)
                for g in GROUPS:
                    for j in PLAN.chunks_for_hit(g, hit.tokens):
                        assert torch.equal(bufs[(g, j)], expected(hashes[j], g))
                loaded.add(mv.chunk_hash)
    assert checked > 20 and loaded, (checked, len(loaded))
    s.close()


def entries(store: Store, tier: str) -> set[tuple[bytes, int]]:
    pools = store.index._pools
    return {(h, g) for g in GROUPS for h, rec in pools[(tier, g)].recs.items()}


def test_a_restart_of_the_disk_tier_keeps_what_it_held(tmp_path: Path) -> None:
    """A disk tier under the learned share (the only tier: the one warm entries go to): its
    pools moved away from where they start, so slots past a starting pool's end hold chunks. A
    new store on the same directory (pools restart at the fixed split) rebuilds every one of
    them (moved down where a pool is smaller now), each reads back as saved, the pools are
    within the disk's bytes and no block past a pool's end stays allocated. The old rule (a slot
    past the pool's end is refused and freed) lost them."""
    prompts = conversation(900)
    kw = dict(disk_dir=tmp_path, disk_bytes=1500 * ROW, pin_memory=False, secret=b"k" * 32)
    s = Store(PLAN, NS, **kw)
    for learner in s.index.learners:
        learner.period = 8
    where = {}
    for toks in prompts:
        for i, h in enumerate(s.hashes(toks)):
            where.setdefault(h, i)
    assert run(s, prompts)["mismatches"] == 0
    # while serving, a disk pool's relocated entries are dropped, not moved (no I/O in a save)
    served = s.metrics()
    assert served["share_dropped"] > 0 and served["share_moved"] == 0, served
    start = slot_counts(PLAN, {"disk": 1500 * ROW}, placement_share(PLAN))
    slots_before = {g: s.index.slots(g, "disk") for g in GROUPS}
    assert slots_before[0] > start[("disk", 0)] and slots_before[1] < start[("disk", 1)]  # full grew
    high = [(h, g) for h, g in entries(s, "disk") if s.index.where(h, g)[0][1] >= start[("disk", g)]]
    assert len(high) > 1000  # held past a starting pool's end
    held = entries(s, "disk")
    s.close()

    s2 = Store(PLAN, NS, **kw)
    m = s2.metrics()
    assert entries(s2, "disk") == held, (len(held), len(entries(s2, "disk")))
    assert s2.rebuilt == len(held)
    assert m["rebuild_refused"] == m["share_evicted"] == m["share_move_failed"] == m["corrupt_dropped"] == 0
    assert m["share_resizes"] > 0  # the pools fit to what the last run left, not proportional
    assert held_bytes(s2, "disk") <= 1500 * ROW
    disk = s2.slot_tiers["disk"]
    for h, g in held:
        slot = s2.index.where(h, g)[0][1]
        assert slot < s2.index.slots(g, "disk")
        out = torch.zeros(PLAN.groups[g].chunk_bytes, dtype=torch.uint8)
        assert disk.read(g, slot, s2.header(h, g, where[h]), out), (g, slot)
        assert torch.equal(out, expected(h, g))
    strides = {g: slot_stride(PLAN.groups[g].chunk_bytes) for g in GROUPS}
    assert disk.allocated_bytes() <= sum(s2.index.slots(g, "disk") * strides[g] for g in GROUPS) + 8 * PAGE
    # the store serves on: the same trace again restores and checks every byte
    r = run(s2, prompts[:200])
    assert r["restored"] > 0 and r["mismatches"] == 0
    s2.close()


def test_a_restart_with_fewer_bytes_evicts_what_does_not_fit_and_counts_it(tmp_path: Path) -> None:
    """A restart with half the disk bytes: the chunks below the new layout's end are rebuilt and
    the pools fit back into the bytes by their own victims, each one counted (`share_evicted`);
    rebuilt + evicted + the slots past the new layout's end (which the disk tier cuts off when it
    sizes its files at open, as with any share) = what the disk held."""
    prompts = conversation(500)
    kw = dict(disk_dir=tmp_path, pin_memory=False, secret=b"k" * 32)
    s = Store(PLAN, NS, disk_bytes=1200 * ROW, **kw)
    assert run(s, prompts)["mismatches"] == 0
    slots = {(h, g): s.index.where(h, g)[0][1] for h, g in entries(s, "disk")}
    s.close()
    s2 = Store(PLAN, NS, disk_bytes=600 * ROW, **kw)
    cut = {k for k, slot in slots.items() if slot >= s2.index.max_slots(k[1], "disk")}
    m = s2.metrics()
    kept = entries(s2, "disk")
    assert kept <= set(slots) and m["rebuild_refused"] == m["share_move_failed"] == 0
    assert m["share_evicted"] > 0 and len(kept) + m["share_evicted"] + len(cut) == len(slots), \
        (len(kept), m["share_evicted"], len(cut), len(slots))
    assert held_bytes(s2, "disk") <= 600 * ROW
    assert run(s2, prompts[:100])["mismatches"] == 0
    s2.close()


def test_one_full_attention_group_stays_proportional() -> None:
    """No group is placed: share auto is proportional, nothing is resized or moved."""
    llama = make_plan(Geometry((GEOM.groups[0],), 16), chunk_tokens=C)
    s = Store(llama, NS, cpu_bytes=200 * llama.groups[0].chunk_bytes, pin_memory=False)
    assert s.placement is None and not s.index.learners
    assert s.index.slots(0, "cpu") == s.index.max_slots(0, "cpu") == 200
    for toks in conversation(300):
        h = s.hashes(toks)
        s.save(h, lambda g, i: expected(h[i], g)[: llama.groups[g].chunk_bytes], len(toks))
    assert s.index.slots(0, "cpu") == 200
    assert all(v == 0 for v in share_counters(s).values())


def test_the_default_share_and_a_page_locked_cpu_tier(tmp_path: Path) -> None:
    """share="auto" is learned under "hits" with a pageable cpu tier, the fixed half/half share
    when the cpu tier is page-locked (its slabs are committed whole); asking for the learned share
    with a page-locked tier is a clear error."""
    hits = make_placement(PLAN, "hits")
    assert resolve_share(PLAN, "auto", hits) == "learned"
    assert resolve_share(PLAN, "auto", hits, pinned=True) == placement_share(PLAN)
    assert resolve_share(PLAN, "auto", None, pinned=True) == "proportional"
    s = Store(PLAN, NS, cpu_bytes=100 * ROW, pin_memory=False)
    assert s.index.learners and s.index.slots(1, "cpu") == 58  # starts at half/half
    lay = s.slot_tiers["cpu"].layout
    assert lay.num_slots == (s.index.max_slots(0, "cpu"), s.index.max_slots(1, "cpu"))
    # the layout: the tier's bytes less the other group's floor (0.1 x its proportional bytes)
    assert lay.num_slots[1] == (100 * ROW - 10 * PLAN.groups[0].chunk_bytes) // PLAN.groups[1].chunk_bytes
    with pytest.raises(ConfigError, match="page-locked slab is committed whole"):
        Store(PLAN, NS, cpu_bytes=100 * ROW, share="learned", pin_memory=True)
    # a new disk tier starts at the same split (nothing rebuilt: nothing to fit)
    with Store(PLAN, NS, disk_dir=tmp_path, disk_bytes=100 * ROW, secret=b"k" * 32) as d:
        assert d.index.learners and (d.index.slots(0, "disk"), d.index.slots(1, "disk")) == (350, 58)


def test_a_cpu_tier_pinned_by_default_keeps_the_fixed_share(monkeypatch, caplog) -> None:
    """Where CUDA is present the cpu tier is page-locked by default: the store keeps the fixed
    share and says why in one line. (Simulated: the store sees CUDA, the tier allocates pageable
    memory, as no pinned allocator exists here.)"""
    import kvtier.store.tiers.cpu as cpu_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_mod, "_pin_default", lambda: False)
    with caplog.at_level(logging.INFO, logger="kvtier.store.store"):
        s = Store(PLAN, NS, cpu_bytes=100 * ROW)
    assert not s.index.learners
    assert (s.index.slots(0, "cpu"), s.index.slots(1, "cpu")) == (350, 58)  # half/half
    lines = [r.getMessage() for r in caplog.records if "page-locked" in r.getMessage()]
    assert len(lines) == 1 and "committed whole" in lines[0], lines
