"""Every place kvtier reaches into vLLM past its public API, and every difference between the
vLLM versions kvtier supports (0.32, 0.33), behind one named function each.

The rule (tests/test_layers.py enforces it): no other module names a private attribute
(`x._name`) of a vLLM object, and a version difference is decided here by `at_least`, not by
a try/except ImportError or a hasattr check at the caller. When vLLM changes one of these, this
file is the one to read. Names here are kept stable: the worker side imports them too.

No getattr with a default at a caller: a renamed attribute must be one failing test here, not a
silent default (a copy never waited for, a failed load never reported).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager

import vllm

try:  # both supported versions have it; a fallback for a vLLM between releases
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
except ImportError:  # pragma: no cover
    from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec as CPULoadStoreSpec  # noqa: F401


def _version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


VLLM_VERSION_STR = str(getattr(vllm, "__version__", "?"))
VLLM_VERSION: tuple[int, int] = _version(VLLM_VERSION_STR)


def at_least(major: int, minor: int) -> bool:
    """Whether the running vLLM is `major.minor` or later."""
    return VLLM_VERSION >= (major, minor)


# -- the engine's KV-cache config, from the connector to the spec --------------------------------
# vLLM builds the spec inside OffloadingConnector.__init__ from an OffloadingConfig that names the
# groups but not their kinds, windows or page sizes. KvtierConnector hands vLLM's KVCacheConfig
# over for exactly that call, keyed by engine id (two engines in one process never see each
# other's); the spec takes it back by its config's engine id. This module owns the hand-over.

_HANDED: dict[str, object] = {}


@contextlib.contextmanager
def kv_cache_config_for_spec(engine_id: str | None, kv_cache_config: object | None) -> Iterator[None]:
    """While the block runs (vLLM building the spec), `handed_kv_cache_config` of a spec of engine
    `engine_id` (`engine_id_of` its VllmConfig) returns `kv_cache_config`; never afterwards (a
    later engine with the same id, say under the stock connector, does not see it)."""
    if engine_id is None or kv_cache_config is None:
        yield
        return
    _HANDED[engine_id] = kv_cache_config
    try:
        yield
    finally:
        _HANDED.pop(engine_id, None)


def handed_kv_cache_config(offloading_config: object) -> object | None:
    """vLLM's KVCacheConfig of the engine whose spec is being built, or None (the stock
    connector, which hands nothing over)."""
    return _HANDED.get(getattr(offloading_config, "engine_id", None))  # type: ignore[arg-type]


def engine_id_of(vllm_config: object) -> str | None:
    return getattr(getattr(vllm_config, "kv_transfer_config", None), "engine_id", None)


# -- public functions one version may lack --------------------------------------------------------

def offloading_group_ids(kv_cache_config: object) -> Sequence[int]:
    """The KV-cache groups vLLM offloads (it leaves some out, e.g. groups no prefix hit can use)."""
    try:  # both supported versions have it
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
    except ImportError:  # pragma: no cover - an older vLLM: every group
        return range(len(kv_cache_config.kv_cache_groups))  # type: ignore[attr-defined]
    return get_offloading_group_ids(kv_cache_config)


def event_group_rules(kv_cache_config: object | None) -> dict[int, tuple[str, int | None]]:
    """vLLM group index -> (kind, sliding window) as vLLM names them in its KV events; {} for a
    vLLM whose events carry no group fields."""
    if kv_cache_config is None:
        return {}
    try:  # both supported versions have them
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:  # pragma: no cover
        return {}
    return {g: (get_kv_cache_spec_kind(grp.kv_cache_spec).value, get_kv_cache_spec_sliding_window(grp.kv_cache_spec))
            for g, grp in enumerate(kv_cache_config.kv_cache_groups)}  # type: ignore[attr-defined]


def event_lacks_group_rule(event: object) -> bool:
    """A BlockStored event whose group kind vLLM left empty (0.32 on every placeholder; 0.33 unless
    self-describing events are on); False for an event type without the field."""
    return getattr(event, "kv_cache_spec_kind", "") is None


def kv_cache_groups(vconf: object, specs: dict[str, object]) -> list:
    """vLLM's KV-cache groups of the layer specs (0.33 plans them globally, 0.32 per worker)."""
    if at_least(0, 33):
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

        return get_global_kv_cache_groups(vconf, [specs])
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    return get_kv_cache_groups(vconf, specs)


def manager_lock(manager: object) -> AbstractContextManager:
    """vLLM 0.33 makes every OffloadingManager call under `manager.lock`; calls kvtier makes into
    its manager from the connector take it too. 0.32 has no lock (one thread calls)."""
    if at_least(0, 33):
        return manager.lock  # type: ignore[attr-defined]
    return contextlib.nullcontext()


# -- vLLM's private state ---------------------------------------------------------------------------

def worker_transfer_meta(connector_worker: object):  # noqa: ANN201 - vLLM's OffloadingWorkerMetadata
    """The metadata vLLM's OffloadingConnectorWorker sends the scheduler each step (its transfer
    stats, the jobs completed): KvtierConnector reports finished jobs itself (failed loads)."""
    return connector_worker._connector_worker_meta  # type: ignore[attr-defined]


def worker_load_jobs(connector_worker: object) -> dict:
    """vLLM's OffloadingConnectorWorker's load jobs in flight: job id -> request id (0.33: None
    for a job no request waits on)."""
    return connector_worker._load_jobs  # type: ignore[attr-defined]


def transfer_event(handler: object, transfer_id: int):  # noqa: ANN201 - a torch event or None
    """The event vLLM's GPU copy handler records at the end of a transfer (0.32 and 0.33 keep one
    per transfer in `_transfer_events`), or None where a handler keeps none."""
    return getattr(handler, "_transfer_events", {}).get(transfer_id)


# -- KV events (events.py): vLLM's offloading events tracker ---------------------------------------

def events_tracker(scheduler: object) -> object | None:
    """The offloading scheduler's OffloadingEventsTracker (both versions: `_events_tracker`)."""
    return getattr(scheduler, "_events_tracker", None)


def tracker_records(tracker: object) -> dict:
    """The tracker's OffloadKey -> BlockStored payload snapshots (both versions)."""
    return tracker._pending_event_metadata  # type: ignore[attr-defined]


def replace_fields(record, **fields):  # noqa: ANN001, ANN201 - one of vLLM's NamedTuples
    """A copy of a vLLM NamedTuple (GroupOffloadConfig, OffloadingEventGroupSpec) with `fields`."""
    return record._replace(**fields)


def scheduler_publisher(connector: object, depth: int = 12) -> object | None:
    """The scheduler's KV event publisher, found among the callers of `connector`'s method (vLLM
    hands a connector no handle on it and creates it after the connector): the Scheduler itself
    (a reset) or the EngineCore holding it (the handshake). None when no caller holds one."""
    import sys

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        for o in (owner, getattr(owner, "scheduler", None)):
            if getattr(o, "connector", None) is connector and hasattr(o, "kv_event_publisher"):
                return o.kv_event_publisher
        frame = frame.f_back
    return None


def offload_key_positions(req_context: object) -> dict | None:
    """vLLM's offload key -> end token of every key it hashed for a request (0.32 and 0.33 keep
    them in ReqContext._offload_key_positions); None where a version keeps none."""
    return getattr(req_context, "_offload_key_positions", None)
