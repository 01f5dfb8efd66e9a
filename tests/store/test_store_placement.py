"""The store's default placement ("hits", docs/admission.md "Admission where hits land"): a state
hybrid over a multi-turn workload restores more tokens than every-chunk storing in the same
bytes, every byte it loads is the one saved, and cold / skipped entries never make a hit partial."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvtier

from kvtier.core.geometry import Geometry, Group
from kvtier.core.keys import Namespace
from kvtier.core.plan import make_plan
from kvtier.errors import ConfigError
from kvtier.store.store import Store, placement_share

C = 16  # chunk tokens; one trace block (512 tokens) becomes one chunk
# Qwen3-Next-like bytes: a state checkpoint ~6x a full-attention chunk
GEOM = Geometry(
    groups=(
        Group("full", "full", num_layers=2, tokens_per_block=16, bytes_per_token_per_layer=64),
        Group("linear", "state", num_layers=3, tokens_per_block=16, state_bytes_per_layer=4096),
    ),
    tokens_per_hash=16,
)
PLAN = make_plan(GEOM, chunk_tokens=C)
NS = Namespace("placement-test", GEOM.fingerprint(), "bfloat16")
ROW = sum(gp.chunk_bytes for gp in PLAN.cacheable_groups)
# the first 2,700 requests of Mooncake's conversation trace, shipped as package data (SOURCES.md)
TRACE = Path(kvtier.__file__).parent / "data" / "mooncake_conversation_head.jsonl"


def conversation(n: int) -> list[list[int]]:
    """The first n requests of Mooncake's conversation trace as token ids: each trace block one
    chunk of C tokens (block id b at index j: b * C + j), the last block partial as in the trace
    (its share of 512 tokens, 1..C-1 tokens). Follow-up turns repeat all but the previous prompt's
    last block; block 0 is a system prompt every request shares."""
    out = []
    with open(TRACE) as f:
        for line in f:
            r = json.loads(line)
            ids = r["hash_ids"]
            tail = r["input_length"] - 512 * (len(ids) - 1)
            last = min(C - 1, max(1, tail * C // 512))
            toks = [b * C + j for b in ids[:-1] for j in range(C)] + [ids[-1] * C + j for j in range(last)]
            out.append(toks)
            if len(out) == n:
                break
    return out


def expected(chunk_hash: bytes, group: int) -> torch.Tensor:
    n = PLAN.groups[group].chunk_bytes
    raw = (chunk_hash + bytes([group])) * (n // 33 + 1)
    return torch.frombuffer(bytearray(raw[:n]), dtype=torch.uint8)


def replay(store: Store, prompts: list[list[int]]) -> dict[str, int]:
    """Each prompt: lookup, load into fresh buffers, check every loaded chunk, save."""
    restored = checked = bad = 0
    for toks in prompts:
        hashes = store.hashes(toks)
        hit = store.lookup(hashes, len(toks))
        bufs = {(gp.index, i): torch.zeros(gp.chunk_bytes, dtype=torch.uint8)
                for gp in PLAN.cacheable_groups for i in range(len(hashes))}
        got = store.load(hit, bufs)
        assert 0 <= got <= hit.tokens
        restored += got
        for gp in PLAN.cacheable_groups:
            for i in PLAN.chunks_for_hit(gp.index, got):
                checked += 1
                bad += int(not torch.equal(bufs[(gp.index, i)], expected(hashes[i], gp.index)))
        store.save(hashes, lambda g, i: expected(hashes[i], g), len(toks))
    return {"restored": restored, "checked": checked, "mismatches": bad}


def test_hits_restore_more_than_every_chunk_in_the_same_bytes() -> None:
    """600 requests of the conversation trace (13,120 unique chunks) into a cpu tier of 10% of
    them, one byte budget for both. Measured: "every" restores 10,976 tokens, "hits" with its
    default share (learned, from the fixed half/half split) 28,464 (2.6x; half/half kept fixed:
    20,208; at 25%: 17,616 against 38,912 either way); its loads are checked byte for byte like
    every-chunk's. (Under 10% both restore little beyond the shared first chunk.)"""
    prompts = conversation(600)
    unique = len({tuple(p[: (k + 1) * C]) for p in prompts for k in range(len(p) // C)})
    assert unique == 13120
    cpu = unique * ROW // 10
    out = {}
    for placement in ("every", "hits"):
        with Store(PLAN, NS, cpu_bytes=cpu, placement=placement, pin_memory=False) as s:
            out[placement] = replay(s, prompts)
            m = s.metrics()
            out[placement]["written"] = sum(t["save_bytes"] for t in m["tiers"]["cpu"].values())
    for r in out.values():
        assert r["checked"] > 1000 and r["mismatches"] == 0, out
    assert out["hits"]["restored"] >= 1.5 * out["every"]["restored"], out
    assert out["hits"]["written"] < out["every"]["written"], out  # fewer checkpoints written too


def test_the_default_share_goes_with_the_placement() -> None:
    """share="auto": under "hits" the learned share, starting from placement_share's split
    (half of each tier to the full group; a page-locked cpu tier keeps that split fixed:
    test_store_learned_share.py); equal slots under "every"."""
    hits = Store(PLAN, NS, cpu_bytes=100 * ROW, pin_memory=False)
    assert hits.index.learners  # starting from the fixed split below
    fixed = Store(PLAN, NS, cpu_bytes=100 * ROW, share=placement_share(PLAN))
    assert not fixed.index.learners
    every = Store(PLAN, NS, cpu_bytes=100 * ROW, placement="every")
    assert every.index.slots(0, "cpu") == every.index.slots(1, "cpu") == 100 and not every.index.learners
    full, state = PLAN.groups[0].chunk_bytes, PLAN.groups[1].chunk_bytes
    half = 100 * ROW // 2  # exactly half: no slot lost to rounding
    assert (hits.index.slots(0, "cpu"), hits.index.slots(1, "cpu")) == (half // full, half // state) == (350, 58)
    assert placement_share(PLAN) == pytest.approx({"full": 0.5, "linear": 0.5})
    # an explicit share wins; one full-attention group has nothing to place
    assert Store(PLAN, NS, cpu_bytes=100 * ROW, share="proportional").index.slots(1, "cpu") == 100
    llama = make_plan(Geometry((GEOM.groups[0],), 16), chunk_tokens=C)
    assert placement_share(llama) == "proportional" and Store(llama, NS, cpu_bytes=10 * ROW).placement is None


def test_placed_groups_never_get_more_than_their_proportional_bytes() -> None:
    """A model whose state is tiny beside its attention (LFM2: 512-byte conv states, 32 KiB
    attention chunks): "hits" stores fewer state chunks than every-chunk storing, so its state
    pools keep their proportional bytes and the attention group keeps the rest (half/half would
    halve the bytes every hit reads)."""
    small = make_plan(Geometry((GEOM.groups[0], Group("conv", "state", num_layers=1, tokens_per_block=16,
                                                       state_bytes_per_layer=64)), 16), chunk_tokens=C)
    full, conv = (gp.chunk_bytes for gp in small.groups)
    assert conv < full
    share = placement_share(small)
    assert share == pytest.approx({"full": full / (full + conv), "conv": conv / (full + conv)})
    assert Store(small, NS, cpu_bytes=100 * (full + conv)).index.slots(0, "cpu") == 100  # every-chunk's 100


def test_cold_entries_go_to_a_later_tier_only(tmp_path) -> None:
    """cpu + disk: a checkpoint away from the request's ends is written to disk only, never to
    cpu; with cpu alone it is not stored. A hit at such a boundary still restores exactly."""
    toks = list(range(6 * C + 3))  # 6 chunks: endpoints 5 and 4 (the last two)
    hashes = None
    for tiers, cold_disk in (({}, 0), ({"disk_dir": tmp_path, "disk_bytes": 40 * ROW}, 4)):
        with Store(PLAN, NS, cpu_bytes=40 * ROW, **tiers) as s:
            hashes = s.hashes(toks)
            s.save(hashes, lambda g, i: expected(hashes[i], g), len(toks))
            st = s.index.stats()["tiers"]
            assert st["cpu"]["groups"]["full"]["committed"] == 6
            assert st["cpu"]["groups"]["linear"]["committed"] == 2  # warm: the endpoints only
            m = s.metrics()
            assert m["placement_cold"] == cold_disk and m["placement_skipped"] == 4 - cold_disk
            if cold_disk:  # write-through: the warm entries are on disk too, the cold ones only there
                assert st["disk"]["groups"]["linear"]["committed"] == 4 + 2
                assert st["disk"]["groups"]["full"]["committed"] == 6
            short = toks[: 3 * C + 1]  # a hit of 3 chunks needs the checkpoint at chunk 2
            bufs = {(gp.index, i): torch.zeros(gp.chunk_bytes, dtype=torch.uint8)
                    for gp in PLAN.cacheable_groups for i in range(3)}
            got = s.load(s.lookup_tokens(short), bufs)
            assert got == (3 * C if cold_disk else 0)  # without disk no checkpoint at 3 * C: no hit
            for gp in PLAN.cacheable_groups:
                for i in PLAN.chunks_for_hit(gp.index, got):
                    assert torch.equal(bufs[(gp.index, i)], expected(hashes[i], gp.index))


def test_a_branch_point_is_stored_warm() -> None:
    """Two prompts sharing 3 chunks: the second makes chunk 2 a branch point, so its
    checkpoint is kept (warm) and a third prompt branching there restores 3 chunks."""
    stem = list(range(3 * C))
    a, b, c = stem + [1000 + i for i in range(3 * C + 1)], stem + [2000 + i for i in range(3 * C + 1)], \
        stem + [3000 + i for i in range(C + 1)]
    s = Store(PLAN, NS, cpu_bytes=40 * ROW)
    for toks in (a, b):
        h = s.hashes(toks)
        s.save(h, lambda g, i, h=h: expected(h[i], g), len(toks))
    assert s.lookup_tokens(c).tokens == 3 * C
    # every: the same hit; the point of "hits" is what it does not store
    assert s.index.stats()["tiers"]["cpu"]["groups"]["linear"]["committed"] == 2 + 3  # a: 4, 5; b: 2, 4, 5


def test_unknown_placement_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="placement='sometimes' is unknown; use one of hits, every"):
        Store(PLAN, NS, cpu_bytes=10 * ROW, placement="sometimes")


class _FirstTwo:
    """An admission that lets a save store its first two chunks only."""

    name = "first-two"

    def admit(self, chunk_hashes: list[bytes]) -> int:
        return min(2, len(chunk_hashes))


def test_a_save_cut_short_by_admission_keeps_its_last_chunk_warm() -> None:
    """A state checkpoint is stored warm where the stored prefix ends: a save of 5 chunks that
    admission cuts to 2 keeps the state at chunk 1 in the cpu tier (the next request can hit 2
    chunks there, and only there)."""
    toks = list(range(5 * C + 3))
    with Store(PLAN, NS, cpu_bytes=64 * ROW, admission=_FirstTwo()) as s:
        hashes = s.hashes(toks)
        s.save(hashes, lambda g, i: expected(hashes[i], g), len(toks))
        assert s.lookup(hashes, len(toks)).tokens == 2 * C
