"""Promotion at lookup under the learned share (host_region.py, "Reserved slots"): the scheduler
fills a cpu slot of a group only once the worker has applied every batch of share ops that touched
that group (a release still to come could punch the slot while it is filled, leaving a committed
header over zeros), and only below the group's reserved slots. Real manager, real worker, real
host region, real disk tier and lane thread; no engine."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from test_vllm_promoter_budget import _keys, _pair  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402


def _promote(ctx, manager, i: int, req_id: str):  # noqa: ANN001, ANN202
    """Start a promotion at lookup of chunk `i` for a new request and wait for its read: (chunk,
    group). (A request promotes only until its first promotion lands.)"""
    rc = ReqContext(req_id=req_id)
    key = _keys(rc)[i]
    split = ctx.split_key(key)
    started, _ = manager.promotions.start_at_lookup(key, split, rc)
    assert started
    assert manager.promotions.promoter.drain(30)
    return split


def test_a_fill_waits_until_the_worker_applied_the_groups_share_ops(tmp_path: Path) -> None:
    ctx, manager, worker, _ = _pair(tmp_path, budget_chunks=8)
    cpu, region = worker.tiers["cpu"], worker.tiers["cpu"].region
    promotions = manager.promotions

    # an op on the group still waits for the next step's metadata: not filled, counted, released
    promotions.settled = lambda g: None
    h, g = _promote(ctx, manager, 0, "r1")
    slot = promotions.fetches[(h, g)].slot
    gen = cpu.generation(g, slot)
    assert promotions.land() == [(h, g)]
    assert cpu.generation(g, slot) == gen  # never begun: not a byte written
    assert manager.metrics.counts.get("promote_skipped_share") == 1
    assert [t for t, _ in manager.index.where(h, g)] == ["disk"]  # served from disk as before

    # the ops went out in batch 3, the worker has applied batch 2: still not filled
    promotions.settled = lambda g: 3
    region.set_applied(2)
    h, g = _promote(ctx, manager, 1, "r2")
    slot = promotions.fetches[(h, g)].slot
    gen = cpu.generation(g, slot)
    promotions.land()
    assert cpu.generation(g, slot) == gen and manager.metrics.counts["promote_skipped_share"] == 2

    # once the worker applied batch 3, the same kind of promotion fills its slot
    region.set_applied(3)
    h, g = _promote(ctx, manager, 2, "r3")
    slot = promotions.fetches[(h, g)].slot
    gen = cpu.generation(g, slot)
    promotions.land()
    stored = cpu.header(g, slot)
    assert cpu.generation(g, slot) != gen and stored is not None and stored.chunk_hash == h
    assert "cpu" in [t for t, _ in manager.index.where(h, g)]
    assert manager.metrics.counts["promote_skipped_share"] == 2


def test_a_fill_never_writes_past_the_groups_reserved_slots(tmp_path: Path) -> None:
    """A grow the worker could not reserve (a full tmpfs) leaves the count below the pool: a
    promotion into such a slot is not filled, and counted."""
    ctx, manager, worker, _ = _pair(tmp_path, budget_chunks=8)
    cpu, region = worker.tiers["cpu"], worker.tiers["cpu"].region
    h, g = _promote(ctx, manager, 0, "r1")
    slot = manager.promotions.fetches[(h, g)].slot
    region.resize(g, slot)  # as a release would: the count falls to the promotion's slot
    assert region.settle()
    gen = cpu.generation(g, slot)
    manager.promotions.land()
    assert cpu.generation(g, slot) == gen
    assert manager.metrics.counts.get("promote_skipped_share") == 1
    assert cpu.failed_writes == 0  # refused before any write, not a stand-in row


def test_with_tensor_parallel_every_ranks_worker_must_have_applied_the_ops(tmp_path: Path) -> None:
    """A promotion fills every rank's shard: one rank behind (its worker has not applied the batch,
    or has not reserved the slot) holds the fill back for all."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.promotion import LookupPromoter
    from kvtier.store.tiers.base import TierLayout
    from kvtier.store.tiers.cpu import CpuTier
    from kvtier.store.tiers.host_region import HostRegion

    layout = TierLayout(slot_bytes=(4096,), num_slots=(16,))
    regions = [HostRegion.create(tmp_path, f"rank{r}", layout, reserve=(8,)) for r in range(2)]
    promoter = LookupPromoter.__new__(LookupPromoter)
    promoter.ranks = [SimpleNamespace(cpu=CpuTier(layout, pin_memory=False, region=r)) for r in regions]
    regions[0].set_applied(4)
    assert not promoter.writable(0, 3, 4)  # rank 1 has applied nothing yet
    regions[1].set_applied(4)
    assert promoter.writable(0, 3, 4)
    assert not promoter.writable(0, 3, None)  # an op on the group not sent yet
    assert not promoter.writable(0, 8, 4)  # past both ranks' reserved slots
    regions[0].resize(0, 12)
    assert regions[0].settle() and not promoter.writable(0, 8, 4)  # rank 1 has not reserved it
    regions[1].resize(0, 12)
    assert regions[1].settle() and promoter.writable(0, 8, 4)
