"""KV events for what kvtier holds (integrations/vllm/events.py) and the router that reads them
(kvtier.router): the manager's OffloadingEvents per tier, vLLM's own event types encoded as vLLM's
ZMQ publisher encodes them, and the longest restorable prefix per group rule."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.v1.kv_offload.base import Locality, Medium, ReqContext, make_offload_key  # noqa: E402

from kvtier.core.geometry import Geometry, Group  # noqa: E402
from kvtier.core.keys import Namespace  # noqa: E402
from kvtier.core.plan import make_plan  # noqa: E402
from kvtier.integrations.vllm.common import SpecContext  # noqa: E402
from kvtier.integrations.vllm.counters import Metrics  # noqa: E402
from kvtier.integrations.vllm.config import parse_config  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierManager  # noqa: E402
from kvtier.router import PrefixIndex, decode_batch  # noqa: E402

TOKENS = 16
CHUNK = TOKENS * 64


def _manager(tmp_path: Path, events: bool = True, **tier_bytes: int) -> KvtierManager:
    gs = (Group(name="g0", kind="full", num_layers=1, tokens_per_block=TOKENS, bytes_per_token_per_layer=64,
                dtype="float16", layers=(0,)),)
    geometry = Geometry(groups=gs, tokens_per_hash=TOKENS, name="events")
    tier_bytes = tier_bytes or {"cpu": 2 * CHUNK}
    extra = {"kvtier.tiers": ",".join(tier_bytes), "kvtier.host_region": "off", "kvtier.directory": str(tmp_path)}
    extra.update({f"kvtier.{t}_bytes": n for t, n in tier_bytes.items()})
    ctx = SpecContext(plan=make_plan(geometry, blocks_per_chunk=1), namespace=Namespace("m", geometry.fingerprint(), "float16"),
                      config=parse_config(extra), group_of={0: 0}, blocks_per_chunk=1)
    return KvtierManager(ctx, Metrics("scheduler", None), events=events)


def _store(m: KvtierManager, keys: list, req: str) -> None:
    rc = ReqContext(req_id=req)
    for i, k in enumerate(keys):
        rc.set_offload_key_position(k, (i + 1) * TOKENS)
    out = m.prepare_store(keys, rc)
    m.complete_store(out.keys_to_store, rc)


def _flat(events) -> list[tuple[str, bool, str | None, list]]:  # noqa: ANN001
    return [(e.medium.value, e.removed, e.ownership, list(e.keys)) for e in events]


def _k(i: int):  # noqa: ANN202
    return make_offload_key(bytes([i]) * 32, 0)


def test_every_commit_and_eviction_is_an_event_of_its_tier(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    _store(m, [_k(1), _k(2)], "a")
    assert _flat(m.take_events()) == [("CPU", False, None, [_k(1), _k(2)])]
    assert m.take_events() == []  # drained
    _store(m, [_k(3)], "b")  # a 2-chunk tier: the oldest is evicted
    assert _flat(m.take_events()) == [("CPU", True, None, [_k(1)]), ("CPU", False, None, [_k(3)])]
    m.reset_cache()
    assert sorted(_flat(m.take_events())[0][3]) == sorted([_k(2), _k(3)])


def test_disk_and_redis_are_storage_with_their_own_ownership(tmp_path: Path) -> None:
    m = _manager(tmp_path, cpu=2 * CHUNK, disk=8 * CHUNK)
    _store(m, [_k(1)], "a")
    got = m.take_events()
    assert {(e.medium, e.locality, e.ownership) for e in got} == {
        (Medium.CPU, Locality.LOCAL, None), (Medium.STORAGE, Locality.LOCAL, "kvtier-disk")}
    assert all(e.removal_expected for e in got)


def test_a_load_failure_removes_the_chunk_from_every_tier(tmp_path: Path) -> None:
    m = _manager(tmp_path, cpu=2 * CHUNK, disk=8 * CHUNK)
    _store(m, [_k(1)], "a")
    m.take_events()
    rc = ReqContext(req_id="b")
    rc.set_offload_key_position(_k(1), TOKENS)
    m.lookup(_k(1), rc)
    m.prepare_load([_k(1)], rc)
    m.complete_load([_k(1)], rc)
    m.load_failed("b")
    assert sorted((e.medium.value, e.removed) for e in m.take_events()) == [("CPU", True), ("STORAGE", True)]


def test_without_kv_events_nothing_is_kept(tmp_path: Path) -> None:
    m = _manager(tmp_path, events=False)
    _store(m, [_k(1), _k(2)], "a")
    assert m.take_events() == [] and m.events._announced == {}


# -- the router ---------------------------------------------------------------------------------

C = 128  # chunk tokens
W = 384  # the sliding group's window


def _stored(g: int, h: int, parent: int | None, tokens: list[int], kind: str, window: int | None,
            medium: str = "CPU", ownership: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=tokens, block_size=C if tokens else 0,
                       lora_id=None, medium=medium, lora_name=None, group_idx=g, kv_cache_spec_kind=kind,
                       kv_cache_spec_sliding_window=window, ownership=ownership)


def _wire(events: list) -> list:  # noqa: ANN001
    """Through vLLM's own encoding, as its ZMQ publisher sends a batch."""
    import msgspec

    return decode_batch(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events)))


def _prompt_a() -> list[int]:
    return [(i * 7919) % 30000 for i in range(8 * C + 40)]


def _index_after_a() -> PrefixIndex:
    """A of 1064 tokens stored: the full group every chunk 0..7 (with tokens), the sliding group
    only the chunks its last window needs (5..7), as vLLM offers them."""
    a = _prompt_a()
    events = []
    for j in range(8):
        events.append(_stored(0, 1000 + j, None if j == 0 else 1000 + j - 1, a[j * C:(j + 1) * C], "full_attention", None))
    for j in (5, 6, 7):
        events.append(_stored(1, 1000 + j, None, [], "sliding_window", W))
    index = PrefixIndex()
    index.apply("e0", _wire(events))
    return index


def test_the_hit_needs_every_groups_rule() -> None:
    index = _index_after_a()
    a = _prompt_a()
    (r,) = index.longest_prefix(a + [1, 2])
    assert (r.tokens, r.tiers) == (8 * C, ("cpu",))
    # a prompt that shares A's first 5 chunks only: the full group has them, the sliding group
    # has none of the chunks the last window before 640 (or 512, ...) needs: nothing restores
    b = a[:5 * C] + [7] * 300
    assert index.longest_prefix(b)[0].tokens == 0
    assert index.longest_prefix(b, group_blind=True)[0].tokens == 5 * C  # the blind router is wrong
    # the prompt length caps it (at least one token is computed): 1024 tokens restore 1023
    # vLLM loads the last chunk and recomputes its last token: 1,023 (the 1,408 -> 1,407)
    assert index.longest_prefix(a[:8 * C])[0].tokens == 8 * C - 1


def test_removals_take_chunks_out_per_tier() -> None:
    index = _index_after_a()
    a = _prompt_a()
    index.apply("e0", _wire([BlockRemoved(block_hashes=[1006], medium="CPU", group_idx=1)]))
    assert index.longest_prefix(a + [1])[0].tokens == 0  # sliding chunk 6 gone: no boundary works
    index.apply("e0", _wire([_stored(1, 1006, None, [], "sliding_window", W, "STORAGE", "kvtier-disk")]))
    r = index.longest_prefix(a + [1])[0]
    assert (r.tokens, r.tiers) == (8 * C, ("cpu", "disk"))


def test_a_state_group_restores_only_at_its_checkpoints() -> None:
    a = _prompt_a()
    events = [_stored(0, 1000 + j, None if j == 0 else 1000 + j - 1, a[j * C:(j + 1) * C], "full_attention", None)
              for j in range(8)]
    events.append(_stored(1, 1003, None, [], "mamba", None))  # a checkpoint at 512 only
    index = PrefixIndex()
    index.apply("e0", _wire(events))
    assert index.longest_prefix(a)[0].tokens == 4 * C
    assert index.summary()["e0"]["groups"][1]["rule"].startswith("state")


def test_engines_are_ranked_by_what_they_restore() -> None:
    index = _index_after_a()
    a = _prompt_a()
    index.apply("e1", _wire([_stored(0, 2000, None, a[:C], "full_attention", None)]))
    assert [(r.engine, r.tokens) for r in index.longest_prefix(a + [1])] == [("e0", 8 * C), ("e1", C)]


def test_the_index_forgets_a_chunk_no_tier_holds_any_more() -> None:
    """A router runs for days: a chunk removed from every tier and group leaves nothing behind
    (its hash's chain link goes too), so the index is bounded by what the engines hold."""
    index = _index_after_a()
    a = _prompt_a()
    gone = [BlockRemoved(block_hashes=[1000 + j], medium="CPU", group_idx=0) for j in range(8)]
    gone += [BlockRemoved(block_hashes=[1000 + j], medium="CPU", group_idx=1) for j in (5, 6, 7)]
    index.apply("e0", _wire(gone))
    e = index._engines["e0"]
    assert e.held == {} and e.groups_of == {} and e.links == {} and e.children == {} and e.parent == {}
    assert index.longest_prefix(a + [1])[0].tokens == 0
