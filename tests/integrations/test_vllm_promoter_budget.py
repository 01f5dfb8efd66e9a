"""The scheduler's promotion reads (integrations/vllm/promotion.py's LookupPromoter) are bounded by
`kvtier.io_queue_bytes`: a read's buffers are out from the moment it is queued until the scheduler's
thread fills them into their cpu slot or gives them back, and a promotion that would pass the
budget is dropped (counted `promote_dropped`), never queued. A dropped promotion is served as a
promotion the manager could not start: a hit its load reads from disk, or a miss with host-only
loads. Real worker, real host region, real disk tier, real lane thread; no engine."""

from __future__ import annotations

import threading
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
from kvtier.core.keys import Namespace  # noqa: E402
from kvtier.core.plan import make_plan  # noqa: E402
from kvtier.integrations.vllm.common import SpecContext  # noqa: E402
from kvtier.integrations.vllm.counters import Metrics  # noqa: E402
from kvtier.integrations.vllm.config import parse_config  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierManager  # noqa: E402
from kvtier.integrations.vllm.promotion import LookupPromoter  # noqa: E402
from kvtier.integrations.vllm.worker import KvtierWorker  # noqa: E402
from kvtier.store.payload import make_header  # noqa: E402

TPB = 16  # tokens per block
BPC = 2  # blocks per chunk
PAGE = TPB * 64
NUM_BLOCKS = 64
CHUNKS = 6


def _ctx(tmp_path: Path, budget_chunks: int, host_only: bool = False) -> SpecContext:
    groups = (Group(name="full", kind="full", num_layers=1, tokens_per_block=TPB,
                    bytes_per_token_per_layer=64, dtype="float16", layers=(0,)),)
    geometry = Geometry(groups=groups, tokens_per_hash=TPB, name="t")
    plan = make_plan(geometry, blocks_per_chunk=BPC)
    chunk = plan.groups[0].chunk_bytes
    extra = {"kvtier.tiers": "cpu,disk", "kvtier.directory": str(tmp_path),
             "kvtier.cpu_bytes": 2 * CHUNKS * chunk, "kvtier.disk_bytes": 1 << 20,
             "kvtier.host_region": str(tmp_path), "kvtier.io_queue_bytes": budget_chunks * chunk}
    if host_only:
        extra["sync_load_budget_bytes"] = 1 << 30
    return SpecContext(plan=plan, namespace=Namespace("m", geometry.fingerprint(), "float16"),
                       config=parse_config(extra), group_of={0: 0}, blocks_per_chunk=BPC)


def _pair(tmp_path: Path, budget_chunks: int, host_only: bool = False):  # noqa: ANN202
    """A manager and its worker, every chunk of `_keys` stored (cpu and disk) and then dropped
    from the cpu tier's index: on disk only. The manager's promoter counts into its Metrics (as
    manager.py builds it once it hands the promoter its Metrics) and maps the worker's region."""
    ctx = _ctx(tmp_path, budget_chunks, host_only)
    manager = KvtierManager(ctx, Metrics("scheduler", None))
    manager.promotions.promoter.close()
    manager.promotions.promoter = LookupPromoter(ctx, manager.index, manager.metrics)
    gen = torch.Generator().manual_seed(0)
    layer = torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
    kv = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(layer, PAGE)],
                           group_data_refs=[[CanonicalKVCacheRef(0, PAGE)]])
    worker = KvtierWorker(ctx, kv, Metrics("worker0", None))
    assert manager.adopt_region([worker.tiers["cpu"].region.name])
    rc = ReqContext(req_id="store")
    keys = _keys(rc)
    for i, k in enumerate(keys):  # one chunk a job: the worker's own queue (same budget) drops none
        out = manager.prepare_store([k], rc)
        assert out is not None and len(out.keys_to_store) == 1
        src = GPULoadStoreSpec([2 * i + 1, 2 * i + 2], group_sizes=[2], block_indices=[0])
        assert worker.submit_store(i, src, out.store_spec)
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(i, True)]
        assert worker.drain()  # the disk write landed
        manager.complete_store(out.keys_to_store, rc)
    assert not any(k.startswith("store_dropped") for k in worker.metrics.counts)
    for k in keys:
        assert manager.index.remove(*ctx.split_key(k), "cpu")  # on disk only now
    return ctx, manager, worker, layer


def _keys(rc: ReqContext) -> list:
    keys = []
    for i in range(CHUNKS):
        k = make_offload_key(bytes([i + 1]) * 32, 0)
        rc.set_offload_key_position(k, (i + 1) * TPB * BPC)
        keys.append(k)
    return keys


def _finished(worker: KvtierWorker, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while not (results := worker.get_finished()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return results


def test_reads_past_the_budget_are_dropped_counted_and_never_outstanding(tmp_path: Path) -> None:
    """Budget: two chunks. Six promotions asked at once: two are queued, four dropped and counted;
    the two reads hold the right bytes. Buffers given back make room again. Then a producer
    thread asks while the test's thread fills buffers back as they land: the bytes out (queued,
    reading, or read and not yet given back) never pass the budget, and every drop is counted."""
    ctx, manager, worker, _ = _pair(tmp_path, budget_chunks=2)
    promoter, metrics = manager.promotions.promoter, manager.metrics  # asked directly here, not by lookups
    chunk = ctx.plan.groups[0].chunk_bytes
    budget = ctx.config.io_queue_bytes
    assert budget == 2 * chunk
    rc = ReqContext(req_id="r")
    asks = []
    for k in _keys(rc):
        h, g = ctx.split_key(k)
        ((tier, slot),) = manager.index.where(h, g)
        assert tier == "disk"
        start = len(asks) * TPB * BPC
        asks.append((g, slot, make_header(ctx.namespace.id, h, g, start, start + TPB * BPC, chunk, "uint8")))

    landed: list = []
    lock = threading.Lock()

    def land() -> None:  # the reads the promoter's thread finished, as the scheduler's thread takes them
        while promoter.finished:
            landed.append(promoter.finished.popleft()[1])

    queued = [promoter.fetch(g, "disk", slot, header, i) for i, (g, slot, header) in enumerate(asks)]
    assert queued == [True, True, False, False, False, False]
    assert metrics.counts.get("promote_dropped") == 4
    assert promoter.drain(30)
    land()
    assert len(landed) == 2 and all(b is not None for b in landed)
    for bufs, (g, slot, header) in zip(landed, asks):
        assert worker.tiers["disk"].read(g, slot, header, want := torch.empty(chunk, dtype=torch.uint8))
        assert torch.equal(bufs[0], want)
    def ask(i: int) -> bool:
        g, slot, header = asks[i]
        return promoter.fetch(g, "disk", slot, header, i)

    assert not ask(2)  # both still out: no room
    promoter.give(landed.pop())  # one back (as the manager drops a stale read's)
    assert ask(2)  # room for one
    assert not ask(3)
    assert promoter.drain(30)
    land()
    for bufs in landed:
        promoter.give(bufs)
    landed.clear()

    # a producer asks on its thread; this thread gives buffers back as they land (as the
    # scheduler's thread fills them): what is out never passes the budget
    out_bytes = [0]
    peak = [0]
    dropped = [metrics.counts.get("promote_dropped", 0)]
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            g, slot, header = asks[i % len(asks)]
            with lock:
                ok = promoter.fetch(g, "disk", slot, header, i)
                if ok:
                    out_bytes[0] += chunk
                    peak[0] = max(peak[0], out_bytes[0])
                else:
                    dropped[0] += 1
            i += 1
            time.sleep(0.0005)

    producer = threading.Thread(target=produce)
    producer.start()
    given = 0
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline or given < 20:
        with lock:
            land()
            batch, landed[:] = list(landed), []
            for bufs in batch:
                assert bufs is not None
                promoter.give(bufs)
                out_bytes[0] -= chunk
        given += len(batch)
        time.sleep(0.002)
        assert time.monotonic() < deadline + 60, "promotions stopped landing"
    stop.set()
    producer.join(10)
    assert promoter.drain(30)
    assert 0 < peak[0] <= budget, (peak[0], budget)
    assert metrics.counts.get("promote_dropped") == dropped[0] > 4
    manager.shutdown()
    worker.shutdown()


@pytest.mark.parametrize("host_only", [False, True])
def test_a_dropped_promotion_is_a_disk_load_or_a_miss_never_a_wait(tmp_path: Path, host_only: bool) -> None:
    """Budget: one chunk. A lookup pass over three chunks on disk only: the first is promoted
    (pending), the other two are dropped and counted. Served as promotions the manager could not
    start: hits that their load reads from disk (restoring the stored blocks), or misses with
    host-only loads. Nothing waits on them."""
    ctx, manager, worker, layer = _pair(tmp_path, budget_chunks=1, host_only=host_only)
    rb = ReqContext(req_id="b")
    k1, k2, k3 = _keys(rb)[:3]
    other = LookupResult.MISS if host_only else LookupResult.HIT
    assert [manager.lookup(k, rb) for k in (k1, k2, k3)] == [LookupResult.HIT_PENDING, other, other]
    assert manager.metrics.counts.get("promote_dropped") == 2
    assert manager.metrics.counts.get("promote_at_lookup") == 1
    assert manager.promotions.promoter.drain(30)
    manager.on_schedule_end(None)  # the step ends: k1's read lands in its cpu slot
    assert manager.metrics.counts.get("promoted_chunks_disk") == 1
    assert not manager.has_pending_work()
    # the next step's pass (vLLM asks again after a pending answer): the request promotes no
    # more (its first promotion landed); k2, k3 as in the first pass
    assert [manager.lookup(k, rb) for k in (k1, k2, k3)] == [LookupResult.HIT, other, other]
    assert manager.metrics.counts.get("promote_dropped") == 2  # not asked again
    keys = [k1] if host_only else [k1, k2, k3]
    spec = manager.prepare_load(keys, rb)
    assert [it.places[0][0] for it in spec.items] == ["cpu"] + ["disk"] * (len(keys) - 1)
    n = 2 * len(keys)
    dst = GPULoadStoreSpec(list(range(40, 40 + n)), group_sizes=[n], block_indices=[0])
    assert worker.submit_load(2, spec, dst)
    assert [(r.job_id, r.success) for r in _finished(worker)] == [(2, True)]
    assert torch.equal(layer[40:40 + n], layer[1:1 + n])  # the stored blocks, restored
    manager.complete_load(keys, rb)
    manager.on_schedule_end(None)
    manager.shutdown()
    worker.shutdown()
