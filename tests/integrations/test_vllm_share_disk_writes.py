"""A disk write queued before the learned share moved its chunk follows the chunk (worker.py
`write_slow`): the write-behind copies a cpu slot and writes it only if the slot still holds the
chunk; a move frees the old slot, which a later store takes, so without following the move the
write would be skipped and the chunk never reach disk. Real worker, real host region, real disk
tier, its lane held busy by the test; no engine."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from test_vllm_promoter_budget import NUM_BLOCKS, PAGE, _ctx, _keys  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
)

from kvtier.integrations.vllm.common import SlotMove, SlotRelease  # noqa: E402
from kvtier.integrations.vllm.counters import Metrics  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierManager  # noqa: E402
from kvtier.integrations.vllm.worker import KvtierWorker  # noqa: E402


def test_a_queued_disk_write_follows_its_chunk_to_the_slot_it_moved_to(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, budget_chunks=8)
    manager = KvtierManager(ctx, Metrics("scheduler", None))
    layer = torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    kv = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(layer, PAGE)],
                           group_data_refs=[[CanonicalKVCacheRef(0, PAGE)]])
    worker = KvtierWorker(ctx, kv, Metrics("worker0", None))
    cpu, disk = worker.tiers["cpu"], worker.tiers["disk"]
    rc = ReqContext(req_id="store")
    keys = _keys(rc)

    def store(i: int) -> None:
        out = manager.prepare_store([keys[i]], rc)
        assert out is not None and len(out.keys_to_store) == 1
        blocks = GPULoadStoreSpec([2 * i + 1, 2 * i + 2], group_sizes=[2], block_indices=[0])
        assert worker.submit_store(i, blocks, out.store_spec)
        assert [r.success for r in worker.get_finished()] == [True]
        manager.complete_store(out.keys_to_store, rc)

    store(0)  # a chunk below the one the test moves
    assert worker.drain(30)
    gate = threading.Event()
    assert worker.slow.lane.submit(lambda: gate.wait(30))  # the lane is busy: the write stays queued
    try:
        store(1)
        h, g = ctx.split_key(keys[1])
        places = dict(manager.index.where(h, g))
        src, dslot = places["cpu"], places["disk"]
        header = cpu.header(g, src)
        want = cpu.slabs[g][src][:header.payload_bytes].clone()
        # the pool shrinks past the chunk's slot: the index moved it below (into the first
        # chunk's slot, freed for it) and released the tail from its old slot on
        dst = dict(manager.index.where(*ctx.split_key(keys[0])))["cpu"]
        assert dst < src, (dst, src)
        cpu.free(g, dst)
        worker.apply_share_ops(1, (SlotMove("cpu", g, h, src, dst), SlotRelease("cpu", g, src)))
        assert worker.metrics.counts.get("share_moves_applied") == 1
        assert cpu.region.reserved(g) == src  # the count fell at once: the old slot takes nothing
    finally:
        gate.set()
    assert worker.drain(30) and cpu.region.settle()
    assert not any(k.startswith("store_overwritten") for k in worker.metrics.counts), worker.metrics.counts
    got = torch.empty(header.payload_bytes, dtype=torch.uint8)
    assert disk.read(g, dslot, header, got)  # the chunk reached disk, verified
    assert torch.equal(got, want)


def test_a_promotion_at_load_into_a_slot_not_yet_reserved_is_skipped(tmp_path: Path) -> None:
    """A load that promotes a chunk into a cpu slot whose pages the host region has not reserved
    (a grow still on the keeper, or refused by a full tmpfs) does not begin the slot: a stand-in
    row would be one per group, and the load copies its blocks from the row it got, so two such
    chunks in one job would both restore the second's bytes. It is skipped and counted; the load
    fills the blocks from its own verified buffer."""
    from kvtier.integrations.vllm.common import ChunkItem

    ctx = _ctx(tmp_path, budget_chunks=8)
    layer = torch.zeros((NUM_BLOCKS, PAGE), dtype=torch.int8)
    kv = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(layer, PAGE)],
                           group_data_refs=[[CanonicalKVCacheRef(0, PAGE)]])
    worker = KvtierWorker(ctx, kv, Metrics("worker0", None))
    cpu = worker.tiers["cpu"]
    g, slot = 0, cpu.layout.num_slots[0] - 1
    cpu.release(0, slot)  # the pool's last slot given back: no longer reserved
    assert cpu.region.settle() and cpu.region.reserved(0) == slot
    gen = cpu.generation(g, slot)
    item = ChunkItem(group=g, chunk_hash=b"\x07" * 32, token_start=0, token_end=2 * 16,
                     places=(("disk", 0), ("cpu", slot)))
    buf = torch.full((cpu.layout.slot_bytes[g],), 3, dtype=torch.uint8)
    row, got = worker._fill_at_load(cpu, g, [(0, 1), (1, 2)], buf, "disk", item)
    assert (row, got) == (None, None)
    assert cpu.generation(g, slot) == gen and cpu.failed_writes == 0  # never begun
    assert worker.metrics.counts.get("promote_skipped_share") == 1
