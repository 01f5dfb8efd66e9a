"""The spec's two halves without an engine: kvtier's manager and worker driven through vLLM's
OffloadingManager / OffloadingWorker calls, on real KV tensors shaped as vLLM hands them
(canonical int8 (num_blocks, page_bytes) views), with 2 blocks per chunk, two groups (full and
sliding) and the sliding group's first chunk starting mid-chunk, as vLLM sends it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)

from kvtier.core.geometry import Geometry, Group  # noqa: E402
from kvtier.integrations.vllm.common import SpecContext  # noqa: E402
from kvtier.integrations.vllm.counters import Metrics  # noqa: E402
from kvtier.integrations.vllm.config import parse_config  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierManager  # noqa: E402
from kvtier.integrations.vllm.worker import KvtierWorker  # noqa: E402
from kvtier.core.keys import Namespace  # noqa: E402
from kvtier.core.plan import make_plan  # noqa: E402

TPB = 16  # tokens per block
BPC = 2  # blocks per chunk
PAGE = TPB * 64  # 64 bytes per token per layer
NUM_BLOCKS = 64


def _ctx(tmp_path: Path, tiers: str) -> SpecContext:
    groups = (
        Group(name="full", kind="full", num_layers=1, tokens_per_block=TPB,
              bytes_per_token_per_layer=64, dtype="float16", layers=(0,)),
        Group(name="local", kind="sliding", window=3 * TPB, num_layers=1, tokens_per_block=TPB,
              bytes_per_token_per_layer=64, dtype="float16", layers=(1,)),
    )
    geometry = Geometry(groups=groups, tokens_per_hash=TPB, name="t")
    plan = make_plan(geometry, blocks_per_chunk=BPC)
    extra = {"kvtier.tiers": tiers, "kvtier.directory": str(tmp_path)}
    extra.update({f"kvtier.{t}_bytes": 1 << 20 for t in tiers.split(",")})
    return SpecContext(plan=plan, namespace=Namespace("m", geometry.fingerprint(), "float16"),
                       config=parse_config(extra), group_of={0: 0, 1: 1}, blocks_per_chunk=BPC)


def _kv() -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
              for _ in range(2)]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in layers],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE)], [CanonicalKVCacheRef(1, PAGE)]],
    )
    return kv, layers


def _keys(rc: ReqContext) -> list:
    """Keys of 3 chunks (96 tokens) of both groups, with vLLM's token positions."""
    keys = []
    for g in (0, 1):
        for i in range(3):
            k = make_offload_key(bytes([i + 1]) * 32, g)
            rc.set_offload_key_position(k, (i + 1) * TPB * BPC)
            keys.append(k)
    return keys


def _finished(worker, timeout: float = 30.0) -> list:
    """The worker's finished transfers, polled as vLLM polls them each step."""
    deadline = time.monotonic() + timeout
    while True:
        results = worker.get_finished()
        if results or time.monotonic() > deadline:
            return results
        time.sleep(0.005)


def _roundtrip(tmp_path: Path, tiers: str, corrupt: bool = False,
               vanish: bool = False, read_raises: bool = False) -> tuple[bool, list, list]:
    ctx = _ctx(tmp_path, tiers)
    manager = KvtierManager(ctx, Metrics("scheduler", None))
    kv, layers = _kv()
    worker = KvtierWorker(ctx, kv, Metrics("worker0", None))
    rc = ReqContext(req_id="a")
    keys = _keys(rc)
    # store: full group chunks 0-2 = blocks 1..6; sliding group only chunks 1-2 matter, and its
    # first stored block is block 3 of the request (mid-chunk 1), as vLLM sends sliding stores
    out = manager.prepare_store(keys[:3] + keys[4:], rc)
    assert out is not None and len(out.keys_to_store) == 5
    src = GPULoadStoreSpec([1, 2, 3, 4, 5, 6] + [13, 14, 15], group_sizes=[6, 3],
                           block_indices=[0, 3])
    assert worker.submit_store(7, src, out.store_spec)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(7, True)]
    manager.complete_store(out.keys_to_store, rc)
    assert worker.drain()  # the disk writes landed (they run on kvtier's I/O thread)
    if "cpu" in tiers:
        # the payload layout itself: sliding chunk 1 holds block 13 in its second half only,
        # chunk 2 holds blocks 14, 15 (a symmetric store/load bug would pass a round trip)
        slab = worker.tiers["cpu"].slabs[1]
        for key, blocks in ((keys[4], {1: 13}), (keys[5], {0: 14, 1: 15})):
            h, g = ctx.split_key(key)
            (tier, slot), = [p for p in manager.index.where(h, g) if p[0] == "cpu"]
            payload = slab[slot].view(BPC, PAGE)
            for pos, block in blocks.items():
                assert torch.equal(payload[pos], layers[1][block].view(torch.uint8))
    rc2 = ReqContext(req_id="b")
    keys2 = _keys(rc2)
    assert [manager.lookup(k, rc2) for k in keys2] == [LookupResult.HIT] * 3 + [
        LookupResult.MISS] + [LookupResult.HIT] * 2
    if corrupt:
        from kvtier.store.tiers.disk_files import DATA_OFFSET, slot_stride
        from kvtier.store.tiers.disk_scan import scan_dir

        rec = next(r for r in scan_dir(tmp_path / "disk") if r.group == 0)
        with open(rec.path, "r+b") as f:
            f.seek(rec.slot * slot_stride(rec.slot_bytes) + DATA_OFFSET)
            f.write(b"\xff" * 8)
    if vanish:  # evicted from every tier after lookup() said HIT (another request's store)
        h, g = ctx.split_key(keys2[1])
        for tier, _ in manager.index.where(h, g):
            assert manager.index.remove(h, g, tier)
    if read_raises:  # an unexpected error inside a tier read on kvtier's I/O thread

        def boom(*args, **kwargs):
            raise RuntimeError("tier read exploded")

        worker.tiers["disk"].read = boom
    spec = manager.prepare_load(keys2[:3] + keys2[4:], rc2)
    dst = GPULoadStoreSpec([31, 32, 33, 34, 35, 36] + [43, 44, 45], group_sizes=[6, 3],
                           block_indices=[0, 3])
    assert worker.submit_load(8, spec, dst)
    results = _finished(worker)  # a disk read finishes on kvtier's I/O thread
    manager.complete_load(keys2[:3] + keys2[4:], rc2)
    assert [r.job_id for r in results] == [8]
    got = [layers[0][31:37].clone(), layers[1][43:46].clone()]
    want = [layers[0][1:7].clone(), layers[1][13:16].clone()]
    return results[0].success, got, want


@pytest.mark.parametrize("tiers", ["cpu", "disk", "cpu,disk"])
def test_store_then_load_moves_the_exact_bytes(tmp_path: Path, tiers: str) -> None:
    ok, got, want = _roundtrip(tmp_path, tiers)
    assert ok
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_corrupt_disk_payload_fails_the_load_job(tmp_path: Path) -> None:
    ok, got, want = _roundtrip(tmp_path, "disk", corrupt=True)
    assert not ok  # reported as failed, so vLLM recomputes instead of using the blocks


def test_a_tier_read_that_raises_still_finishes_the_load_as_failed(tmp_path: Path) -> None:
    """The job must reach vLLM (as failed, so it recomputes): a job that never finished left
    its request waiting for KV forever."""
    ok, got, want = _roundtrip(tmp_path, "disk", read_raises=True)
    assert not ok


def test_a_hit_key_evicted_before_prepare_load_fails_the_job(tmp_path: Path) -> None:
    ok, got, want = _roundtrip(tmp_path, "cpu", vanish=True)
    assert not ok  # a failed job: vLLM recomputes; the scheduler did not crash


class _FakeRedis:
    """Answers EXISTS from a set; counts round trips."""

    def __init__(self, held: set) -> None:
        self.held, self.calls = held, 0

    def exists_many(self, headers):
        self.calls += 1
        return [(h.chunk_hash, h.group) in self.held for h in headers]

    def close(self) -> None:
        pass


def test_redis_answers_serve_every_lookup_for_their_ttl_then_are_asked_again(tmp_path: Path,
                                                                              monkeypatch) -> None:
    """A lookup queues the key and answers RETRY; once Redis answered, every lookup of the key
    within the TTL uses that answer (a negative answer used once made every other waiting request
    ask again); an expired answer is asked again, not turned into a timeout miss."""
    from kvtier.integrations.vllm import redis_lookup as mod

    ctx = _ctx(tmp_path, "cpu")
    extra = {"kvtier.tiers": "cpu,redis", "kvtier.directory": str(tmp_path), "kvtier.cpu_bytes": 1 << 20,
             "kvtier.redis_bytes": 1 << 20, "kvtier.redis_url": "redis://127.0.0.1:1/0"}
    ctx = SpecContext(plan=ctx.plan, namespace=ctx.namespace, config=parse_config(extra),
                      group_of=ctx.group_of, blocks_per_chunk=BPC)
    manager = KvtierManager(ctx, Metrics("scheduler", None))
    fake = _FakeRedis(set())
    manager.redis_lookup.redis = fake
    monkeypatch.setattr(mod, "REDIS_ANSWER_TTL_S", 60.0)  # no answer goes stale on a slow machine
    rc = ReqContext(req_id="a")
    key = make_offload_key(b"\x07" * 32, 0)
    rc.set_offload_key_position(key, TPB * BPC)
    assert manager.lookup(key, rc) == LookupResult.RETRY
    manager.redis_lookup.lane.drain(10)
    assert [manager.lookup(key, rc) for _ in range(3)] == [LookupResult.MISS] * 3  # one answer, reused
    assert fake.calls == 1
    monkeypatch.setattr(mod, "REDIS_ANSWER_TTL_S", 0.0)
    time.sleep(0.01)
    fake.held.add(ctx.split_key(key))  # another engine stored it meanwhile
    assert manager.lookup(key, rc) == LookupResult.RETRY  # stale: asked again
    manager.redis_lookup.lane.drain(10)
    monkeypatch.setattr(mod, "REDIS_ANSWER_TTL_S", 60.0)
    assert manager.lookup(key, rc) == LookupResult.HIT and fake.calls == 2
    manager.shutdown()


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_cpu_slot_taken_before_its_disk_write_runs_never_lands_other_bytes(tmp_path: Path, when: str) -> None:
    """A store copies a chunk's pages straight into its cpu slot, and its disk write copies that
    slot later, on kvtier's I/O thread. If the slot is taken for another chunk before then, the
    disk write is skipped and counted (`store_overwritten_disk`): the disk never holds the first
    chunk's header over the second chunk's bytes (it would serve them, checksum and all)."""
    import threading

    from kvtier.integrations.vllm.common import ChunkItem, KvtierLoadStoreSpec

    ctx = _ctx(tmp_path, "cpu,disk")
    manager = KvtierManager(ctx, Metrics("scheduler", None))
    kv, layers = _kv()
    worker = KvtierWorker(ctx, kv, Metrics("worker0", None))
    rc = ReqContext(req_id="a")
    keys = _keys(rc)
    out = manager.prepare_store(keys[:1], rc)  # chunk 0 of the full group: blocks 1, 2
    (item,) = out.store_spec.items
    cpu_slot = dict(item.places)["cpu"]
    # the disk slot held another chunk before (one the index evicted): after the skipped write,
    # it must read as empty, a plain miss, not as a foreign chunk dropped as corrupt
    prev = worker.ctx.blocks_header(ChunkItem(0, b"\x55" * 32, 0, TPB * BPC, ()), [(1, 0), (2, 1)])
    assert worker.tiers["disk"].write(0, dict(item.places)["disk"], prev,
                                      torch.ones(ctx.plan.groups[0].chunk_bytes, dtype=torch.uint8))
    gate = threading.Event()
    worker.slow.lane.submit(gate.wait)  # hold kvtier's I/O thread: the disk write waits behind it
    assert worker.submit_store(1, GPULoadStoreSpec([1, 2], group_sizes=[2, 0], block_indices=[0, 0]),
                               out.store_spec)
    # another chunk (blocks 9, 10) into the same cpu slot before the disk write ran
    other = ChunkItem(0, b"\x77" * 32, 0, TPB * BPC, (("cpu", cpu_slot),))
    if when == "during":
        # the disk write runs while the new bytes are already in the slot but before the new
        # chunk's header is set: the slot must not read as chunk 0's then (CpuTier.begin drops it)
        copy_out = worker.copies.copy_out

        def copy_then_run_the_disk_write(*args):
            copy_out(*args)
            gate.set()
            assert worker.drain()

        worker.copies.copy_out = copy_then_run_the_disk_write
    assert worker.submit_store(2, GPULoadStoreSpec([9, 10], group_sizes=[2, 0], block_indices=[0, 0]),
                               KvtierLoadStoreSpec([other]))
    gate.set()
    assert worker.drain()
    counts = worker.metrics.counts
    assert counts.get("store_overwritten_disk") == 1 and not counts.get("stored_chunks_disk"), counts
    # the disk slot the scheduler reserved for chunk 0 serves nothing
    disk_slot = dict(item.places)["disk"]
    buf = torch.zeros(ctx.plan.groups[0].chunk_bytes, dtype=torch.uint8)
    header = worker.ctx.blocks_header(item, [(1, 0), (2, 1)])
    assert not worker.tiers["disk"].read(0, disk_slot, header, buf)
    assert worker.tiers["disk"].corrupt_dropped == 0  # freed when the write was skipped
    # and chunk 0's own bytes were never what the cpu slot held at the end: chunk 9/10's are
    assert torch.equal(worker.tiers["cpu"].slabs[0][cpu_slot].view(BPC, PAGE),
                       layers[0][9:11].view(torch.uint8))
    worker.shutdown()


def test_a_failed_load_counts_nothing_as_loaded(tmp_path: Path) -> None:
    """`loaded_chunks_<tier>`/`loaded_bytes_<tier>` count what a load restored. A job whose first
    chunk was read from disk but whose second misses in the cpu tier restores nothing (vLLM
    recomputes the request), so it counts nothing as loaded, and its blocks keep their bytes."""
    from kvtier.integrations.vllm.common import ChunkItem, KvtierLoadStoreSpec

    ctx = _ctx(tmp_path, "cpu,disk")
    kv, layers = _kv()
    worker = KvtierWorker(ctx, kv, Metrics("worker0", None))
    span = TPB * BPC
    first = ChunkItem(0, b"\x01" * 32, 0, span, (("cpu", 0), ("disk", 0)))
    second = ChunkItem(0, b"\x02" * 32, span, 2 * span, (("cpu", 1),))
    store = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4, 0], block_indices=[0, 0])
    assert worker.submit_store(1, store, KvtierLoadStoreSpec([first, second]))
    assert worker.drain()
    worker.get_finished()
    worker.tiers["cpu"].free(0, 1)  # the second chunk left the cpu tier
    before = {k: v for k, v in worker.metrics.counts.items()}
    kept = layers[0][20:24].clone()
    load = [ChunkItem(0, first.chunk_hash, 0, span, (("disk", 0),)), second]
    assert worker.submit_load(2, KvtierLoadStoreSpec(load),
                              GPULoadStoreSpec([20, 21, 22, 23], group_sizes=[4, 0], block_indices=[0, 0]))
    assert [(r.job_id, r.success) for r in _finished(worker)] == [(2, False)]
    counts = {k: v - before.get(k, 0) for k, v in worker.metrics.counts.items() if v != before.get(k, 0)}
    assert counts.get("load_miss_cpu") == 1, counts
    assert not any(k.startswith(("loaded_", "loaded_blocks")) for k in counts), counts
    assert torch.equal(layers[0][20:24], kept)
    worker.shutdown()


def _promoting_pair(tmp_path: Path, cpu_chunks: int, host_only: bool = False):  # noqa: ANN202
    """A manager and one worker sharing the worker's host region (as the handshake joins them),
    with a cpu tier of `cpu_chunks` chunks a group before a disk tier: (ctx, manager, worker)."""
    manager, (worker,), _ = _tp_group(tmp_path, world=1, cpu_chunks=cpu_chunks, host_only=host_only)
    return manager.ctx, manager, worker


def _store(manager, workers, keys, rc, job: int) -> None:  # noqa: ANN001
    """Store `keys` through every worker (each rank stores the same blocks of its own shard)."""
    out = manager.prepare_store(keys, rc)
    n = len(out.keys_to_store)
    for w in workers:
        src = GPULoadStoreSpec(list(range(1, 2 * n + 1)), group_sizes=[2 * n, 0], block_indices=[0, 0])
        assert w.submit_store(job, src, out.store_spec)
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(job, True)]
        assert w.drain()
    manager.complete_store(out.keys_to_store, rc)


def _full_keys(rc: ReqContext, first: int, n: int) -> list:
    keys = []
    for i in range(n):
        k = make_offload_key(bytes([first + i]) * 32, 0)
        rc.set_offload_key_position(k, (i + 1) * TPB * BPC)
        keys.append(k)
    return keys


def test_a_failed_lookup_promotion_is_tried_once_more_then_never(tmp_path: Path) -> None:
    """A promotion read that fails may only have raced the worker's disk write: the chunk is
    tried once more after NO_FETCH_S, then never (a corrupt chunk would otherwise cost a cpu slot
    and a whole read every NO_FETCH_S)."""
    ctx, manager, worker = _promoting_pair(tmp_path, cpu_chunks=4)
    rc = ReqContext(req_id="a")
    (key,) = _full_keys(rc, 1, 1)
    _store(manager, [worker], [key], rc, 1)
    h, g = ctx.split_key(key)
    assert manager.index.remove(h, g, "cpu")  # on disk only now
    manager.promotions.promoter.ranks[0].tiers["disk"].read = lambda *a, **k: False  # as an empty or corrupt slot reads
    tries = []
    for _ in range(4):
        rb = ReqContext(req_id=f"b{len(tries)}")
        rb.set_offload_key_position(key, TPB * BPC)
        first = manager.lookup(key, rb)
        manager.promotions.promoter.drain()
        manager.on_schedule_end(None)  # the step ends: the failed read lands
        tries.append((first, manager.lookup(key, rb)))  # served as before
        for split, until in manager.promotions.no_fetch.items():
            if until != float("inf"):
                manager.promotions.no_fetch[split] = 0.0  # as if NO_FETCH_S passed
    assert tries == [(LookupResult.HIT_PENDING, LookupResult.HIT)] * 2 + [(LookupResult.HIT, LookupResult.HIT)] * 2
    assert manager.metrics.counts.get("promote_read_failed", 0) == 2
    manager.shutdown()
    worker.shutdown()


def test_host_only_hits_stay_in_host_memory_until_their_load_is_prepared(tmp_path: Path) -> None:
    """Host-only loads (sync_load_budget_bytes): a lookup answered HIT for a cpu chunk, and the
    same step's next lookup starts a promotion whose cpu reservation must evict one of the
    group's chunks; the chunk answered HIT is not the one (pinned until the step ends), so the
    request's prepare_load still finds it in host memory, and loads nothing else."""
    ctx, manager, worker = _promoting_pair(tmp_path, cpu_chunks=2, host_only=True)
    rc = ReqContext(req_id="a")
    k1, k2 = _full_keys(rc, 1, 2)
    _store(manager, [worker], [k1, k2], rc, 1)  # both chunks in cpu (full) and on disk
    h2, g = ctx.split_key(k2)
    assert manager.index.remove(h2, g, "cpu")  # k2 on disk only
    rc3 = ReqContext(req_id="c")
    (k3,) = _full_keys(rc3, 9, 1)
    _store(manager, [worker], [k3], rc3, 2)  # the pool is full again: k1 (oldest) and k3
    rb = ReqContext(req_id="b")
    for i, k in enumerate((k1, k2)):
        rb.set_offload_key_position(k, (i + 1) * TPB * BPC)
    assert manager.lookup(k1, rb) == LookupResult.HIT
    assert manager.lookup(k2, rb) == LookupResult.HIT_PENDING  # its promotion reserved a cpu slot
    h1, _ = ctx.split_key(k1)
    assert [t for t, _ in manager.index.where(h1, g)][:1] == ["cpu"], manager.index.where(h1, g)
    spec = manager.prepare_load([k1], rb)
    assert [it.places[0][0] for it in spec.items] == ["cpu"]
    manager.on_schedule_end(None)  # the step ends: the lookup's pin goes, the load's stays
    manager.complete_load([k1], rb)
    assert manager.metrics.counts.get("load_keys_vanished", 0) == 0
    manager.promotions.promoter.drain()
    manager.shutdown()
    worker.shutdown()


def test_the_region_name_is_fresh_per_start_and_only_where_a_promotion_can_use_it(tmp_path: Path) -> None:
    """Random per worker start (the handshake carries it; no engine guesses another's); none
    without a disk or Redis tier (nothing to promote) or with kvtier.host_region "off"."""
    ctx = _ctx(tmp_path, "cpu,disk")
    a, b = ctx.new_region_name(), ctx.new_region_name()
    assert a != b and a.startswith("vllm-") and b.startswith("vllm-")
    assert _ctx(tmp_path, "cpu").new_region_name() is None
    extra = {"kvtier.tiers": "cpu,disk", "kvtier.directory": str(tmp_path), "kvtier.cpu_bytes": 1 << 20,
             "kvtier.disk_bytes": 1 << 20, "kvtier.host_region": "off"}
    off = SpecContext(plan=ctx.plan, namespace=ctx.namespace, config=parse_config(extra),
                      group_of=ctx.group_of, blocks_per_chunk=BPC)
    assert off.new_region_name() is None


def test_host_only_hits_are_checked_in_the_slot_table_not_only_the_index(tmp_path: Path) -> None:
    """vLLM 0.33 never reports a failed store, so the index may name a cpu slot that holds
    nothing; a synchronous load from it would stop the engine. The lookup reads the slot's
    header through the worker's host region: an empty slot is a miss."""
    ctx, manager, worker = _promoting_pair(tmp_path, cpu_chunks=4, host_only=True)
    rc = ReqContext(req_id="a")
    k1, k2 = _full_keys(rc, 1, 2)
    _store(manager, [worker], [k1, k2], rc, 1)
    h2, g = ctx.split_key(k2)
    (slot,) = [s for t, s in manager.index.where(h2, g) if t == "cpu"]
    worker.tiers["cpu"].free(g, slot)  # as a store job the worker failed: nothing in the slot
    rb = ReqContext(req_id="b")
    for i, k in enumerate((k1, k2)):
        rb.set_offload_key_position(k, (i + 1) * TPB * BPC)
    assert manager.lookup(k1, rb) == LookupResult.HIT
    assert manager.lookup(k2, rb) == LookupResult.MISS
    assert manager.metrics.counts.get("lookup_not_in_host", 0) == 1
    manager.on_schedule_end(None)
    manager.shutdown()
    worker.shutdown()


def _tp_group(tmp_path: Path, world: int = 2, host_only: bool = False, attach: bool = True,  # noqa: ANN202
              cpu_chunks: int = 4):
    """Tensor parallel: one manager (the scheduler, rank 0's namespace) and `world` workers, each
    with its own shard of every block (different bytes), namespace (its rank), host region and
    disk directory, a cpu tier of `cpu_chunks` chunks a group before a disk tier; the manager
    maps every rank's region, as the handshake joins them."""
    base = _ctx(tmp_path, "cpu,disk")
    chunk = base.plan.groups[0].chunk_bytes
    extra = {"kvtier.tiers": "cpu,disk", "kvtier.directory": str(tmp_path), "kvtier.disk_bytes": 1 << 20,
             "kvtier.cpu_bytes": cpu_chunks * chunk * 2, "kvtier.host_region": str(tmp_path),
             "kvtier.placement": "every"}  # slots counted per group, as with every chunk stored
    if host_only:
        extra["sync_load_budget_bytes"] = 1 << 30
    config = parse_config(extra)

    def ctx(rank: int) -> SpecContext:
        ns = Namespace("m", base.namespace.geometry_fingerprint, "float16", rank=rank, world_size=world)
        return SpecContext(plan=base.plan, namespace=ns, config=config, group_of=base.group_of,
                           blocks_per_chunk=BPC)

    manager = KvtierManager(ctx(0), Metrics("scheduler", None))
    workers, shards = [], []
    for rank in range(world):
        kv, layers = _kv()
        for t in layers:  # each rank's own shard
            t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(rank + 7)))
        workers.append(KvtierWorker(ctx(rank), kv, Metrics(f"worker{rank}", None)))
        shards.append(layers)
    if attach:  # (the scheduler's mapping removes a region's name: it is mapped once)
        assert manager.adopt_region([w.tiers["cpu"].region.name for w in workers])
    return manager, workers, shards


@pytest.mark.parametrize("fail_rank", [None, 1])
def test_tensor_parallel_promotion_fills_every_ranks_slot_with_its_own_shard(tmp_path: Path, fail_rank) -> None:  # noqa: ANN001
    """A chunk on disk only: the lookup promotes it into every rank's host region, each rank's
    shard read and verified under that rank's namespace, and each rank's load restores its own
    bytes. When one rank's read fails, no rank's slot is committed and the chunk is served from
    disk as before (a promotion is all ranks or none)."""
    manager, workers, shards = _tp_group(tmp_path)
    rc = ReqContext(req_id="a")
    k1, k2 = _full_keys(rc, 1, 2)
    _store(manager, workers, [k1, k2], rc, 1)
    h2, g = manager.ctx.split_key(k2)
    assert manager.index.remove(h2, g, "cpu")  # k2 on disk only (every rank's)
    if fail_rank is not None:
        manager.promotions.promoter.ranks[fail_rank].tiers["disk"].read = lambda *a, **k: False
    rb = ReqContext(req_id="b")
    for i, k in enumerate((k1, k2)):
        rb.set_offload_key_position(k, (i + 1) * TPB * BPC)
    assert manager.lookup(k1, rb) == LookupResult.HIT
    assert manager.lookup(k2, rb) == LookupResult.HIT_PENDING
    manager.promotions.promoter.drain()
    manager.on_schedule_end(None)  # the read lands
    rb2 = ReqContext(req_id="b2")
    for i, k in enumerate((k1, k2)):
        rb2.set_offload_key_position(k, (i + 1) * TPB * BPC)
    assert manager.lookup(k1, rb2) == LookupResult.HIT and manager.lookup(k2, rb2) == LookupResult.HIT
    spec = manager.prepare_load([k1, k2], rb2)
    want = ["cpu", "cpu"] if fail_rank is None else ["cpu", "disk"]
    assert [it.places[0][0] for it in spec.items] == want
    (slot,) = [s for t, s in manager.index.where(h2, g) if t == "cpu"] or [None]
    for w in workers:  # every rank's slot, or none
        held = slot is not None and w.tiers["cpu"].header(g, slot) is not None
        assert held == (fail_rank is None), (w.ctx.namespace.rank, slot)
    for w, layers in zip(workers, shards):
        dst = GPULoadStoreSpec([40, 41, 42, 43], group_sizes=[4, 0], block_indices=[0, 0])
        assert w.submit_load(3, spec, dst)
        assert [(r.job_id, r.success) for r in _finished(w)] == [(3, True)]
        # the full group's blocks 1..4 restored from this rank's own shard, never another rank's
        assert torch.equal(layers[0][40:44], layers[0][1:5])
    manager.complete_load([k1, k2], rb2)
    promoted = manager.metrics.counts.get("promoted_chunks_disk", 0)
    assert promoted == (1 if fail_rank is None else 0)
    manager.on_schedule_end(None)
    manager.shutdown()
    for w in workers:
        w.shutdown()


def test_tensor_parallel_host_only_hits_need_every_ranks_slot(tmp_path: Path) -> None:
    """Host-only loads with two ranks: a chunk is a hit only when every rank's slot holds it (a
    rank whose store failed leaves its slot empty: a synchronous load there would stop the
    engine)."""
    manager, workers, _ = _tp_group(tmp_path, host_only=True)
    rc = ReqContext(req_id="a")
    k1, k2 = _full_keys(rc, 1, 2)
    _store(manager, workers, [k1, k2], rc, 1)
    h2, g = manager.ctx.split_key(k2)
    (slot,) = [s for t, s in manager.index.where(h2, g) if t == "cpu"]
    workers[1].tiers["cpu"].free(g, slot)  # rank 1's store of k2 failed
    rb = ReqContext(req_id="b")
    for i, k in enumerate((k1, k2)):
        rb.set_offload_key_position(k, (i + 1) * TPB * BPC)
    assert manager.lookup(k1, rb) == LookupResult.HIT
    assert manager.lookup(k2, rb) == LookupResult.MISS
    manager.on_schedule_end(None)
    manager.shutdown()
    for w in workers:
        w.shutdown()


@pytest.mark.parametrize("regions_from", [(0, 1), (0,)])
def test_the_handshake_maps_every_ranks_region_or_none(tmp_path: Path, regions_from: tuple) -> None:
    """vLLM hands the scheduler every worker's handshake; KvtierConnector maps the regions of
    all ranks (in rank order, whatever order the handshakes come in), or, when a rank has none,
    none at all (promotion at load)."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.common import KvtierHandshake
    from kvtier.integrations.vllm.connector import KvtierConnector

    manager, workers, _ = _tp_group(tmp_path, attach=False)
    names = [w.tiers["cpu"].region.name for w in workers]
    assert not manager.promotions.promoter.ready()
    conn = KvtierConnector.__new__(KvtierConnector)
    conn.connector_scheduler = SimpleNamespace(manager=manager)
    conn._journal = None  # KV events off: no disk journal (connector.__init__ sets it)
    meta = {(r, 0): KvtierHandshake(page_bytes=(), host_region=names[r] if r in regions_from else "", rank=r)
            for r in (1, 0)}
    conn.set_xfer_handshake_metadata(meta)
    if regions_from == (0, 1):
        assert [r.cpu.region.name for r in manager.promotions.promoter.ranks] == names
    else:
        assert not manager.promotions.promoter.ready()
    manager.shutdown()
    for w in workers:
        w.shutdown()


def test_a_store_job_the_worker_failed_is_never_committed(tmp_path: Path) -> None:
    """vLLM never hears that a store job failed (0.33 ignores it; vLLM's own connector marks it
    completed on 0.32) and calls complete_store. The manager reads the chunk's cpu slot through
    the worker's host region: the slot does not hold the chunk, so no tier commits it and a later
    lookup misses instead of loading a slot that holds nothing (or another chunk)."""
    ctx, manager, worker = _promoting_pair(tmp_path, cpu_chunks=4)
    rc = ReqContext(req_id="a")
    good, bad = _full_keys(rc, 1, 1), _full_keys(rc, 5, 1)
    _store(manager, [worker], good, rc, 1)
    out = manager.prepare_store(bad, rc)
    # a job whose blocks do not match its chunks (3 blocks, two chunks' worth, for one chunk):
    # the worker fails it, writing nothing
    assert worker.submit_store(2, GPULoadStoreSpec([9, 10, 11], group_sizes=[3, 0], block_indices=[0, 0]),
                               out.store_spec)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, False)]
    manager.complete_store(out.keys_to_store, rc)  # as vLLM does anyway
    (hb, g), (hg, _) = ctx.split_key(bad[0]), ctx.split_key(good[0])
    assert manager.index.where(hb, g) == [], manager.index.where(hb, g)
    assert [t for t, _ in manager.index.where(hg, g)] == ["cpu", "disk"]
    assert manager.metrics.counts.get("store_failed_unreported", 0) == 1
    rb = ReqContext(req_id="b")
    rb.set_offload_key_position(bad[0], TPB * BPC)
    assert manager.lookup(bad[0], rb) == LookupResult.MISS
    manager.shutdown()
    worker.shutdown()


def test_tensor_parallel_a_store_one_rank_failed_is_committed_nowhere(tmp_path: Path) -> None:
    """Two ranks store the same job; rank 1's worker fails it (vLLM hears nothing of it): the
    chunk is committed in no tier, since rank 1's cpu slot does not hold it, and a lookup misses
    instead of loading rank 0's shard beside nothing on rank 1."""
    manager, workers, _ = _tp_group(tmp_path)
    rc = ReqContext(req_id="a")
    (key,) = _full_keys(rc, 3, 1)
    out = manager.prepare_store([key], rc)
    good = GPULoadStoreSpec([1, 2], group_sizes=[2, 0], block_indices=[0, 0])
    bad = GPULoadStoreSpec([1, 2, 3], group_sizes=[3, 0], block_indices=[0, 0])  # 3 blocks for 1 chunk
    for w, spec, ok in ((workers[0], good, True), (workers[1], bad, False)):
        assert w.submit_store(1, spec, out.store_spec)
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, ok)]
        assert w.drain()
    manager.complete_store(out.keys_to_store, rc)
    h, g = manager.ctx.split_key(key)
    assert manager.index.where(h, g) == []
    assert manager.metrics.counts.get("store_failed_unreported", 0) == 1
    rb = ReqContext(req_id="b")
    rb.set_offload_key_position(key, TPB * BPC)
    assert manager.lookup(key, rb) == LookupResult.MISS
    manager.shutdown()
    for w in workers:
        w.shutdown()


def test_shutdown_ends_the_copies_even_when_tier_io_is_still_running(tmp_path: Path) -> None:
    """vLLM frees its KV tensors after `shutdown`: the side stream and every copy through vLLM's
    handlers must have ended by then, whether or not the I/O thread finished its queue in time.
    Only the tiers that queued I/O still uses stay open."""
    import functools
    import threading

    ctx = _ctx(tmp_path, "cpu,disk")
    kv, _ = _kv()
    worker = KvtierWorker(ctx, kv, Metrics("worker0", None))
    calls: list[str] = []

    class _Recorder:  # the GPU path's stream and copier (None on CPU): what shutdown asks of them
        def __init__(self, name: str) -> None:
            self.name = name

        def synchronize(self) -> None:
            calls.append(f"{self.name}.synchronize")

        def shutdown(self) -> None:
            calls.append(f"{self.name}.shutdown")

    worker.copies.stream, worker.copies.copier = _Recorder("stream"), _Recorder("copier")  # type: ignore[assignment]
    gate = threading.Event()
    assert worker.slow.lane.submit(lambda: gate.wait(30))  # a disk write that hangs
    worker.slow.lane.close = functools.partial(worker.slow.lane.close, timeout=0.2)  # type: ignore[method-assign]
    disk_closed = []
    worker.tiers["disk"].close = lambda: disk_closed.append(True)  # type: ignore[method-assign]
    try:
        worker.shutdown()
        assert calls == ["stream.synchronize", "copier.shutdown"], calls
        assert not disk_closed  # the hung write may still use it
    finally:
        gate.set()
    worker.copies.stream = worker.copies.copier = None
    calls.clear()
    worker.shutdown()  # the lane has stopped now: the tiers close
    assert disk_closed == [True]


def test_tensor_parallel_restart_adopts_a_chunk_only_where_every_rank_holds_it(tmp_path: Path) -> None:
    """At start the scheduler adopts what the disk tier holds. With tensor parallel a chunk is
    every rank's shard at one slot: one that a rank lacks (its write failed, or was dropped at
    exit) is not adopted, so no load is handed out that one rank must fail."""
    manager, workers, _ = _tp_group(tmp_path)
    rc = ReqContext(req_id="a")
    k1, k2 = _full_keys(rc, 1, 2)
    _store(manager, workers, [k1, k2], rc, 1)
    (h1, g), (h2, _) = manager.ctx.split_key(k1), manager.ctx.split_key(k2)
    (slot2,) = [s for t, s in manager.index.where(h2, g) if t == "disk"]
    workers[1].tiers["disk"].free(g, slot2)  # rank 1 lost its shard of k2
    ctx0 = manager.ctx
    manager.shutdown()
    for w in workers:
        w.shutdown()
    again = KvtierManager(ctx0, Metrics("scheduler", None))
    try:
        assert [t for t, _ in again.index.where(h1, g)] == ["disk"]
        assert again.index.where(h2, g) == []
        assert again.metrics.counts.get("rebuilt_chunks") == 1
    finally:
        again.shutdown()


def test_tensor_parallel_a_redis_hit_needs_every_ranks_shard(tmp_path: Path) -> None:
    """Every rank writes its own shard of a chunk to Redis under its own namespace, and Redis
    evicts keys one by one: the scheduler counts a chunk as in Redis only when every rank's key
    exists (rank 0's alone would be a hit that another rank's load must fail). Real redis-server."""
    import sys
    from dataclasses import replace

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from redis_servers import have_redis, redis_server

    from kvtier.store.payload import make_header
    from kvtier.store.tiers.redis import RedisTier

    if not have_redis():
        pytest.skip("redis-server is not installed (make test installs it)")
    base = _ctx(tmp_path, "cpu")
    ns = Namespace("m", base.namespace.geometry_fingerprint, "float16", rank=0, world_size=2)
    with redis_server() as srv:
        extra = {"kvtier.tiers": "cpu,redis", "kvtier.directory": str(tmp_path), "kvtier.cpu_bytes": 1 << 20,
                 "kvtier.redis_bytes": 1 << 20, "kvtier.redis_url": srv.url}
        ctx = SpecContext(plan=base.plan, namespace=ns, config=parse_config(extra), group_of=base.group_of,
                          blocks_per_chunk=BPC)
        manager = KvtierManager(ctx, Metrics("scheduler", None))
        writers = [RedisTier.from_url(srv.url, namespace_id=replace(ns, rank=r).id) for r in (0, 1)]
        try:
            rc = ReqContext(req_id="a")
            k1, k2 = _full_keys(rc, 1, 2)
            (h1, g), (h2, _) = ctx.split_key(k1), ctx.split_key(k2)
            n = ctx.plan.groups[g].chunk_bytes
            data = torch.zeros(n, dtype=torch.uint8)
            shards = [(h1, 0), (h1, 1), (h2, 0)]  # rank 1's shard of k2 was evicted
            for h, r in shards:  # each rank its own tier, as each worker has
                header = make_header(replace(ns, rank=r).id, h, g, 0, 0, n)
                assert writers[r].write_many([(g, -1, header, data)]) == [True]
            for k in (k1, k2):
                assert manager.lookup(k, rc) == LookupResult.RETRY
            manager.redis_lookup.lane.drain(10)
            assert manager.lookup(k1, rc) == LookupResult.HIT
            assert manager.lookup(k2, rc) == LookupResult.MISS
        finally:
            for w in writers:
                w.close()
            manager.shutdown()


def _copier_over(handler, tids: list[int]):  # noqa: ANN001, ANN202 - a SlabCopier
    """A SlabCopier whose one group's three handlers are `handler`, with transfers `tids` in
    flight (no vLLM handler built: no CUDA tensors here)."""
    from kvtier.integrations.vllm.copies import SlabCopier

    copier = SlabCopier.__new__(SlabCopier)
    copier._handlers, copier._owner, copier._ended = [(handler,) * 3], dict.fromkeys(tids, handler), set()
    return copier


def test_a_store_write_waits_for_its_copy_without_calling_the_handler_off_the_engine_thread() -> None:
    """`wait_polling` runs on kvtier's I/O thread. Where vLLM's handler exposes no per-transfer
    event, it must not call the handler there (not thread-safe, and its wait busy-spins): it
    waits until the engine thread's `poll` saw the transfer end. Shutdown ends such a wait."""
    import threading
    from types import SimpleNamespace


    class _Handler:  # a vLLM handler without `_transfer_events`: any call here fails the test
        def __init__(self) -> None:
            self.done: list = []

        def get_finished(self):  # noqa: ANN202 - only the engine thread's poll calls it
            assert threading.current_thread() is threading.main_thread()
            out, self.done = self.done, []
            return out

        def shutdown(self) -> None:
            pass

    h = _Handler()
    copier = _copier_over(h, [7, 8])
    waited = threading.Event()
    t = threading.Thread(target=lambda: (copier.wait_polling([7]), waited.set()))
    t.start()
    assert not waited.wait(0.2)  # transfer 7 has not ended
    h.done = [SimpleNamespace(job_id=7)]  # what poll reads of vLLM's result
    copier.poll()  # the engine thread's step
    assert waited.wait(10)
    t.join(10)
    t = threading.Thread(target=lambda: copier.wait_polling([8]))
    t.start()
    copier.shutdown()  # every transfer drained: nobody waits on 8 any longer
    t.join(10)
    assert not t.is_alive()


def test_a_scheduler_of_another_rank_stands_for_its_own_rank_only(tmp_path: Path) -> None:
    """vLLM's scheduler has rank 0 and hashes for every rank. One of rank 1 (each rank its own
    scheduler: external_launcher) hashes under rank 1's namespace, so it checks its own records
    only: it adopts what its worker stored, whatever rank 0's files hold."""
    manager, workers, _ = _tp_group(tmp_path)
    manager.shutdown()
    workers[0].shutdown()
    base = workers[1].ctx
    ctx1 = SpecContext(plan=base.plan, namespace=base.namespace, config=base.config,
                       group_of=base.group_of, blocks_per_chunk=BPC, one_scheduler=False)
    assert ctx1.rank_namespace_ids() == [base.namespace.id]
    own = KvtierManager(ctx1, Metrics("scheduler", None))
    rc = ReqContext(req_id="a")
    (k1,) = _full_keys(rc, 1, 1)
    _store(own, [workers[1]], [k1], rc, 1)  # rank 1's scheduler and worker only
    own.shutdown()
    workers[1].shutdown()
    again = KvtierManager(ctx1, Metrics("scheduler", None))
    try:
        h1, g = ctx1.split_key(k1)
        assert [t for t, _ in again.index.where(h1, g)] == ["disk"]
    finally:
        again.shutdown()


def test_waiting_for_a_tier_load_keeps_polling_the_copies_a_store_write_waits_for(tmp_path: Path) -> None:
    """vLLM's `wait` on a disk/Redis load drains kvtier's I/O lane on the engine thread; a store
    write queued before the load may wait (without a per-transfer event) for the engine thread's
    poll to see its copy end. The drain keeps polling, so the two never wait on each other."""
    import threading
    from types import SimpleNamespace


    class _Handler:  # vLLM's handler without `_transfer_events`; its copy 7 has ended on the GPU
        def get_finished(self):  # noqa: ANN202
            return [SimpleNamespace(job_id=7)]

        def shutdown(self) -> None:
            pass

    worker = KvtierWorker(_ctx(tmp_path, "cpu,disk"), _kv()[0], Metrics("worker0", None))
    h = _Handler()
    copier = _copier_over(h, [7])
    worker.copies.copier = copier  # type: ignore[assignment]
    assert worker.slow.lane.submit(lambda: copier.wait_polling([7]))  # the store write
    worker._reading.add(99)  # the load vLLM waits for, read after it on the lane
    assert worker.slow.lane.submit(lambda: worker._reading.discard(99))
    t = threading.Thread(target=worker.wait, args=({99},), daemon=True)
    t.start()
    t.join(10)
    try:
        assert not t.is_alive(), "wait() and the store write waited on each other"
    finally:
        copier._owner.clear()  # (frees a stuck lane either way)
        worker.copies.copier = None
        worker.shutdown()


def test_a_region_truncated_before_a_write_behind_is_a_miss_not_sigbus(tmp_path: Path) -> None:
    """Another process of this user truncates the worker's host region between a store's copy
    into its cpu slot and the disk write-behind that copies the slot: the write is a counted
    miss (the slot no longer holds its chunk), never SIGBUS. Run in a child process, so a crash
    shows as its return code."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_vllm_worker import _ctx, _kv, _keys, GPULoadStoreSpec, ReqContext, KvtierManager, KvtierWorker, Metrics
        from kvtier.integrations.vllm.config import parse_config
        from dataclasses import replace
        tmp = Path({str(tmp_path)!r})
        base = _ctx(tmp, "cpu,disk")
        ctx = replace(base, config=parse_config({{"kvtier.tiers": "cpu,disk", "kvtier.directory": str(tmp),
              "kvtier.cpu_bytes": 1 << 20, "kvtier.disk_bytes": 1 << 20, "kvtier.host_region": str(tmp)}}))
        manager = KvtierManager(ctx, Metrics("scheduler", None))
        kv, layers = _kv()
        worker = KvtierWorker(ctx, kv, Metrics("worker0", None))
        region = worker.tiers["cpu"].region
        assert region is not None
        real = worker.slow.write_slow
        def cut_then_write(*a, **kw):
            os.truncate(region.path, 4096)
            return real(*a, **kw)
        worker.slow.write_slow = cut_then_write
        rc = ReqContext(req_id="a")
        keys = _keys(rc)
        out = manager.prepare_store(keys[:3], rc)
        src = GPULoadStoreSpec([1, 2, 3, 4, 5, 6], group_sizes=[6, 0], block_indices=[0, 0])
        assert worker.submit_store(7, src, out.store_spec)
        assert worker.drain()
        m = worker.metrics.counts
        print("stored", m.get("stored_chunks_disk", 0), "missed", m.get("store_overwritten_disk", 0))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    assert proc.stdout.split() == ["stored", "0", "missed", "3"], proc.stdout + proc.stderr[-2000:]
