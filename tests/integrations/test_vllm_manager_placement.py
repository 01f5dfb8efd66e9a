"""kvtier.placement in the vLLM manager: prepare_store stores a subset (vLLM's contract), what it
leaves out is never reserved, committed or announced in a KV event, cold chunks go to the tiers
after the first only, and the share goes with the placement (sliding groups:
test_vllm_manager_placement_sliding.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402

from kvtier.core.geometry import Geometry, Group  # noqa: E402
from kvtier.core.plan import make_plan  # noqa: E402
from kvtier.integrations.vllm.common import SpecContext  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierManager  # noqa: E402
from vllm_manager_setup import context, manager, request_keys, row_bytes  # noqa: E402
from vllm_manager_setup import store as _store  # noqa: E402

TOKENS = 16
GEOM = Geometry(groups=(
    Group(name="attn", kind="full", num_layers=1, tokens_per_block=TOKENS, bytes_per_token_per_layer=64,
          dtype="float16", layers=(0,)),
    Group(name="gdn", kind="state", num_layers=1, tokens_per_block=TOKENS, state_bytes_per_layer=1024,
          dtype="float16", layers=(1,)),
), tokens_per_hash=TOKENS, name="placement")
PLAN = make_plan(GEOM, blocks_per_chunk=1)
ROW = row_bytes(GEOM)


def _manager(tmp_path: Path, placement: str | None = None, **tier_bytes: int) -> KvtierManager:
    return manager(tmp_path, GEOM, tier_bytes, placement)


def _request(req: str, n: int, seed: int) -> tuple[ReqContext, list[list]]:
    """A request of n chunks, each its own hash under `seed`."""
    return request_keys(req, [seed] * n, TOKENS)


def test_state_checkpoints_only_where_hits_land_and_never_announced_otherwise(tmp_path: Path) -> None:
    m = _manager(tmp_path, cpu=64 * ROW)
    rc, keys = _request("a", 6, 1)
    stored = _store(m, rc, keys[0] + keys[1])
    # every attention chunk; the state checkpoints at the request's last two chunks only
    assert stored == keys[0] + keys[1][4:]
    announced = [k for e in m.take_events() if not e.removed for k in e.keys]
    assert sorted(announced) == sorted(stored)  # the four skipped checkpoints: no event
    assert m.metrics.counts["store_skipped_placement"] == 4
    for k in keys[1][:4]:
        assert m.lookup(k, rc).name == "MISS"
    assert m.lookup(keys[1][5], rc).name == "HIT"
    m.on_request_finished(rc)
    assert m._placed == {}


def test_cold_checkpoints_go_to_the_later_tier_only(tmp_path: Path) -> None:
    m = _manager(tmp_path, cpu=64 * ROW, disk=64 * ROW)
    rc, keys = _request("a", 6, 2)
    assert _store(m, rc, keys[0] + keys[1]) == keys[0] + keys[1]
    tiers = {i: [t for t, _ in m.index.where(*m._key(k))] for i, k in enumerate(keys[1])}
    assert tiers == {0: ["disk"], 1: ["disk"], 2: ["disk"], 3: ["disk"], 4: ["cpu", "disk"], 5: ["cpu", "disk"]}
    assert all([t for t, _ in m.index.where(*m._key(k))] == ["cpu", "disk"] for k in keys[0])
    assert m.metrics.counts["store_cold"] == 4


def test_every_stores_what_vllm_offers_and_keeps_equal_slots(tmp_path: Path) -> None:
    m = _manager(tmp_path, "every", cpu=64 * ROW)
    rc, keys = _request("a", 6, 3)
    assert _store(m, rc, keys[0] + keys[1]) == keys[0] + keys[1]
    assert m.index.slots(0, "cpu") == m.index.slots(1, "cpu") == 64
    hits = _manager(tmp_path, cpu=64 * ROW)  # share "auto": half of the tier to the attention group
    assert hits.index.slots(0, "cpu") == 64 * ROW // 2 // PLAN.groups[0].chunk_bytes  # exactly half


def test_a_follow_up_turn_keeps_the_checkpoint_its_next_turn_hits(tmp_path: Path) -> None:
    """Turn 2 repeats turn 1's 4 chunks and adds 3; its stores offer the new chunks only, yet the
    placement sees the whole request (vLLM's positions of every key): the checkpoints at its
    last two chunks are kept, the one after turn 1's prefix is not."""
    m = _manager(tmp_path, cpu=64 * ROW)
    rc1, k1 = _request("t1", 4, 4)
    _store(m, rc1, k1[0] + k1[1])
    m.on_request_finished(rc1)
    rc2 = ReqContext(req_id="t2")
    k2 = [k1[g] + [make_offload_key(bytes([5, i]) * 16, g) for i in range(4, 7)] for g in (0, 1)]
    for g in (0, 1):
        for i, k in enumerate(k2[g]):
            rc2.set_offload_key_position(k, (i + 1) * TOKENS)
    assert _store(m, rc2, k2[0][4:] + k2[1][4:]) == k2[0][4:] + k2[1][5:]


def test_a_growing_request_teaches_the_placement_once(tmp_path: Path) -> None:
    """Decode growth adds chunks to the same request: the placement learns from it once (its
    first call), later calls only insert its new chunks, so it never counts its own growth as
    a later request reusing its prefix."""
    m = _manager(tmp_path, cpu=64 * ROW)
    rc, keys = _request("a", 8, 9)
    grown = ReqContext(req_id="a")
    for n in (4, 6, 8):  # the request as vLLM's positions know it after each step
        for g in (0, 1):
            for i, k in enumerate(keys[g][:n]):
                grown.set_offload_key_position(k, (i + 1) * TOKENS)
        m._request_places(grown)
        if n == 4:
            first = (list(m.placement.reuse), m.placement.observed)
    assert (list(m.placement.reuse), m.placement.observed) == first
    # the grown chunks are in the tree: a next request repeating them is learned from
    rc2, _ = _request("b", 7, 9)  # ends one chunk before the grown request's end
    m._request_places(rc2)
    assert m.placement.observed == first[1] + 1


def _ctx(groups: tuple, tmp_path: Path) -> SpecContext:
    geom = Geometry(groups=groups, tokens_per_hash=TOKENS, name="share")
    return context(tmp_path, geom, {"cpu": 64 * row_bytes(geom)})


def _full(name: str, layer: int) -> Group:
    return Group(name=name, kind="full", num_layers=1, tokens_per_block=TOKENS, bytes_per_token_per_layer=64,
                 dtype="float16", layers=(layer,))


def _sliding(name: str, layer: int) -> Group:
    return Group(name=name, kind="sliding", num_layers=1, tokens_per_block=TOKENS, bytes_per_token_per_layer=128,
                 dtype="float16", layers=(layer,), window=4 * TOKENS)


def test_auto_share_splits_half_and_half_over_full_and_state_groups_only(tmp_path: Path) -> None:
    """vLLM's manager places sliding and state groups (their chunks only where hits land), but
    share "auto" moves bytes only to the full group from state groups (half/half by chunk bytes,
    state never above its proportional bytes): vLLM offers a sliding group about as many chunks
    per request as a full one, so sliding groups keep their proportional bytes."""
    ctx = _ctx((_full("attn", 0), _sliding("swa0", 1), _sliding("swa1", 2)), tmp_path)
    assert ctx.placement == "hits"
    assert ctx.share() == "proportional"
    big = Group(name="gdn", kind="state", num_layers=1, tokens_per_block=TOKENS, state_bytes_per_layer=1 << 20,
                dtype="float16", layers=(3,))
    assert _ctx((_full("attn", 0), big), tmp_path).share() == pytest.approx({"attn": 0.5, "gdn": 0.5})
    ctx = _ctx((_full("attn", 0), _sliding("swa", 1), big), tmp_path)
    b = {gp.name: gp.chunk_bytes for gp in ctx.plan.groups}
    total = sum(b.values())
    rest = 1 - b["swa"] / total  # the sliding group's proportional share is kept
    assert ctx.share() == pytest.approx({"attn": rest / 2, "swa": b["swa"] / total, "gdn": rest / 2})
    assert sum(ctx.share().values()) <= 1
