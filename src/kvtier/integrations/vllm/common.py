"""What the scheduler-side manager and the worker-side handler share: the context both build
from the same engine config, the transfer spec that travels between them, and the metrics file.

Both sides build the context independently (vLLM creates the spec once per process) from the
same inputs, so they agree on the plan, the namespace and every tier's slot layout without
exchanging anything but the per-job `KvtierLoadStoreSpec`.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.v1.kv_offload.base import LoadStoreSpec, OffloadKey

from kvtier.index.index import Index
from kvtier.core.keys import Namespace, chunk_hashes_from_block_hashes
from kvtier.core.plan import Plan
from kvtier.integrations.weights import files_digest, with_weights

from .config import VllmTierConfig


@dataclass(frozen=True, slots=True)
class ChunkItem:
    """One chunk of one group to move: where its payload lives (one place for a load, every
    tier that reserved a slot for a store) and what its header must say. A load from disk or
    Redis may carry a second place, ("cpu", slot): the slot it is promoted into (manager.py)."""

    group: int  # kvtier plan group index (position in vLLM's offloaded groups)
    chunk_hash: bytes
    token_start: int
    token_end: int
    places: tuple[tuple[str, int], ...]  # (tier, slot), fastest tier first


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The manager's answer to prepare_load / prepare_store: chunks in vLLM's key order (group
    by group, prefix order within a group), which is the order of vLLM's GPU block spec."""

    def __init__(self, items: list[ChunkItem]) -> None:
        self.items = tuple(items)

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.items)} chunks)"


@dataclass(frozen=True)
class KvtierHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler after registering its KV caches: its exact bytes per
    block of each offloaded group (vLLM gives the scheduler flattened specs)."""

    page_bytes: tuple[int, ...]
    # the worker's namespace parts: the scheduler's flattened specs describe some groups
    # differently, and the scheduler must look chunks up (Redis, disk) under the workers' name
    geometry_fingerprint: str = ""
    kv_dtype: str = ""
    host_region: str = ""  # the name of the worker's cpu tier region, "" without one (the scheduler maps it)
    rank: int = 0  # the worker's rank (tensor parallel: every rank has its own region)


# vLLM's KVCacheConfig of each engine in this process, by engine id: KvtierConnector records it
# before vLLM builds the spec, which reads its groups' KV-cache specs from here (the offloading
# config vLLM hands a spec names the groups but not their kinds, windows or page sizes).
ENGINE_KV_CACHE_CONFIGS: dict[str, object] = {}
@dataclass(frozen=True, slots=True)
class SpecContext:
    plan: Plan
    namespace: Namespace
    config: VllmTierConfig
    group_of: dict[int, int]  # vLLM KV-cache group id -> kvtier plan group index
    blocks_per_chunk: int
    span_tokens: tuple[int, ...] = ()  # tokens one chunk of each plan group covers (engine_plan)
    # why offloading is off for this engine ("" when on): every lookup misses, nothing is stored
    off_reason: str = ""
    # vLLM's bytes per block of each group (its KV-cache specs), when the spec saw them
    page_bytes: tuple[int, ...] | None = None
    # one scheduler hashes for every tensor-parallel rank: vLLM's scheduler has rank 0. A scheduler
    # of another rank (vLLM's external_launcher: every rank runs its own, with its own rank's
    # namespace and chunk hashes) stands for its own rank only. (Rank 0's scheduler there cannot
    # tell that mode apart, and counts the other ranks' records, hashed otherwise, as missing:
    # misses at restart and in Redis, never wrong KV; that mode is not tested.)
    one_scheduler: bool = True

    def rank_namespace_ids(self) -> list[str]:
        """The namespaces whose shards one chunk of this scheduler stands for, its own first:
        every rank's under tensor parallel (each worker stores its own shard of the scheduler's
        chunk under its rank's namespace), only its own otherwise."""
        from dataclasses import replace

        ns = self.namespace
        if not self.one_scheduler:
            return [ns.id]
        return [ns.id] + [replace(ns, rank=r).id for r in range(ns.world_size) if r != ns.rank]

    def new_index(self) -> Index:
        """The index both sides size their slots from. Where the groups' chunks span different
        tokens (engine_plan), "proportional" shares each tier by bytes per token, so every group
        covers the same tokens (equal slots would give a 64-token group a quarter of a 256-token
        group's tokens), and the dead-first rule is off (chunk hashes line up across groups only
        at common boundaries)."""
        spans = {s for s, gp in zip(self.span_tokens, self.plan.groups) if gp.cacheable}
        mixed = len(spans) > 1
        share: str | dict[str, float] = self.config.share
        if mixed and share == "proportional":
            per_token = {gp.name: gp.chunk_bytes / span
                         for gp, span in zip(self.plan.groups, self.span_tokens) if gp.cacheable}
            total = sum(per_token.values()) * (1 + 1e-9)  # fractions must sum to at most 1
            share = {name: v / total for name, v in per_token.items()}
        return Index(self.plan, self.config.capacities, policy=self.config.policy, share=share,
                     anchored=not mixed)

    def tier_layout(self, index: Index, tier: str):  # noqa: ANN201 - a TierLayout
        """The slots of `tier` per group, as the worker lays the tier out (and the scheduler's
        readers of it expect): each cacheable group's chunk bytes, its slots in `index`."""
        from kvtier.store.tiers.base import TierLayout

        groups = self.plan.groups
        return TierLayout(slot_bytes=tuple(gp.chunk_bytes if gp.cacheable else 0 for gp in groups),
                          num_slots=tuple(index.slots(gp.index, tier) if gp.cacheable else 0 for gp in groups))

    def new_region_name(self) -> str | None:
        """A fresh name for the cpu tier's host region (store/tiers/host_region.py) the worker
        creates (the scheduler learns it from the worker's handshake and maps exactly that one),
        or None where there is none: `kvtier.host_region` "off", or no disk or Redis tier (nothing
        to promote). With tensor parallel every rank makes its own (its own shard; the scheduler
        maps them all). Random per engine start: two engines never share or guess each other's
        region."""
        if self.config.host_region == "off" or not set(self.config.tiers) - {"cpu"}:
            return None
        import os
        import secrets

        return f"vllm-{os.getpid()}-{secrets.token_hex(8)}"

    def span(self, group: int) -> int:
        """Tokens one chunk of plan group `group` covers (all groups alike without span_tokens)."""
        return self.span_tokens[group] if self.span_tokens else self.plan.chunk_tokens

    @property
    def disk_root(self) -> Path | None:
        d = self.config.directory
        return Path(d) / "disk" if d is not None and "disk" in self.config.tiers else None

    def chunk_hash(self, block_hash: bytes) -> bytes:
        """kvtier's chunk hash for vLLM's hash of a chunk's last block (namespace mixed in)."""
        return chunk_hashes_from_block_hashes(self.plan, self.namespace, [block_hash],
                                              self.plan.chunk_tokens)[0]

    def split_key(self, key: OffloadKey) -> tuple[bytes, int] | None:
        """(chunk_hash, plan group) of a vLLM offload key; None for a group kvtier does not cache."""
        g = self.group_of.get(int.from_bytes(key[-4:], "big"))
        if g is None or not self.plan.groups[g].cacheable:
            return None
        return self.chunk_hash(bytes(key[:-4])), g


_COUNT_LOCK = threading.Lock()
_FLUSH_LOCK = threading.Lock()
FLUSH_INTERVAL_S = 1.0  # the counter file is rewritten at most this often (and at most this late)


@dataclass(eq=False)  # identity, not value: kept in a WeakSet for the exit flush
class Metrics:
    """Counters of one side (scheduler or worker), written as JSON into
    `<kvtier.directory>/metrics/<role>-<pid>.json` so a test or an operator can read what
    happened inside an engine whose workers live in other processes, and handed to vLLM's own
    stats path (`take_delta`, stats.py) so `vllm serve`'s /metrics shows them.

    The file is rewritten at most every `interval_s`, on a timer thread, never by the engine
    thread that counts: the first count after a write arms one timer, which writes everything
    counted until it fires (so the file is at most `interval_s` behind, and an idle engine's last
    counts still land). Forced writes (`flush(force=True)`) happen at start, when the workers'
    layout arrives, at shutdown, and at process exit for anything unwritten. Rejected: rewriting
    it on every scheduler and worker call (a JSON dump and a rename per engine step)."""

    role: str
    directory: str | None
    counts: dict[str, int] = field(default_factory=dict)
    info: dict[str, int] = field(default_factory=dict)  # sizes, not summed across processes
    interval_s: float = FLUSH_INTERVAL_S
    _dirty: bool = False
    _pruned: bool = False
    # counts since the last take_delta(), by (counter name, group label): vLLM's stats path
    _delta: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)
    _timer: threading.Timer | None = field(default=None, repr=False)
    _last_write: float = float("-inf")  # time.monotonic() of the last write (or timer firing)

    def __post_init__(self) -> None:
        if self.directory is not None:
            _LIVE.add(self)

    def add(self, name: str, n: int = 1, group: int | None = None) -> None:
        """Count `n` under `name` (the file's key); `group` (kvtier's plan group index) labels it
        on vLLM's stats path where the caller knows it."""
        with _COUNT_LOCK:  # the worker's background I/O thread counts too
            self.counts[name] = self.counts.get(name, 0) + n
            if n:
                key = (name, "" if group is None else str(group))
                self._delta[key] = self._delta.get(key, 0) + n
            self._dirty = True
            timer = self._arm()
        if timer is not None:
            _start(self, timer)

    def take_delta(self) -> dict[tuple[str, str], int]:
        """What was counted since the last call, by (counter name, group label or "")."""
        with _COUNT_LOCK:
            delta, self._delta = self._delta, {}
        return delta

    def flush(self, force: bool = False) -> None:
        """force: write the file now. Otherwise only make sure a write is due within
        `interval_s` (counting already does that)."""
        if self.directory is None:
            return
        if not force:
            with _COUNT_LOCK:
                timer = self._arm() if self._dirty else None
            if timer is not None:
                _start(self, timer)
            return
        with _FLUSH_LOCK:  # the engine thread, the timer and the exit flush may all write
            self._write(force=True)

    def _arm(self) -> threading.Timer | None:
        """Under _COUNT_LOCK: a timer to start (outside the lock) unless one is pending."""
        if self.directory is None or self._timer is not None:
            return None
        delay = max(0.0, self._last_write + self.interval_s - time.monotonic())
        self._timer = threading.Timer(delay, self._on_timer)
        self._timer.daemon = True  # never holds a process open; the exit flush writes instead
        return self._timer

    def _on_timer(self) -> None:
        with _COUNT_LOCK:
            self._timer = None  # a count from now on arms the next write, interval_s from now
            self._last_write = time.monotonic()
        with _FLUSH_LOCK:
            self._write(force=False)

    def _write(self, force: bool) -> None:
        if self.directory is None or not (self._dirty or force):
            return
        out = Path(self.directory) / "metrics"
        path = out / f"{self.role}-{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        try:  # never create kvtier.directory itself, never fail the engine over a counter file
            out.mkdir(mode=0o700, exist_ok=True)
            if not self._pruned:  # one file per process id forever was the old behaviour
                self._pruned = True
                _prune_dead(out)
            with _COUNT_LOCK:
                counts = dict(self.counts)
                self._dirty = False  # an add() after this copy marks it dirty again
                if force:
                    self._last_write = time.monotonic()
            tmp.write_text(json.dumps({"role": self.role, "pid": os.getpid(), "time": time.time(),
                                       "counts": counts, "info": self.info}))
            os.replace(tmp, path)  # readers never see half a file
        except OSError:
            self._dirty = True  # written next time
            return


def _start(metrics: Metrics, timer: threading.Timer) -> None:
    try:
        timer.start()
    except RuntimeError:  # no new threads at interpreter shutdown: the exit flush writes it
        with _COUNT_LOCK:
            if metrics._timer is timer:
                metrics._timer = None


# Every Metrics with a directory, for the exit flush and for a forked child (whose copy of a
# pending timer never fires). Weak: a Metrics a test dropped is not kept alive.
_LIVE: weakref.WeakSet[Metrics] = weakref.WeakSet()


def _flush_all_at_exit() -> None:
    """Registered when this module is imported, so it runs after the worker's I/O lane has
    landed its queued writes (atexit runs handlers last registered first)."""
    for m in list(_LIVE):
        with _FLUSH_LOCK:
            m._write(force=False)


def _forget_in_child() -> None:
    """A forked child's copies are the parent's counters: their pending timers never fire there,
    and the child must not write them again at its exit under its own pid."""
    for m in list(_LIVE):
        m._timer = None
    _LIVE.clear()


atexit.register(_flush_all_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)


def _prune_dead(out: Path) -> None:
    """Remove the counter files of processes that have exited (their pid is gone), so the
    directory holds the live processes' files and the last engine's until a new one starts."""
    for path in out.glob("*-*.json"):
        try:
            pid = int(path.stem.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                path.unlink()
            except OSError:
                pass
        except OSError:  # alive but not ours (EPERM): kept
            continue


def read_metrics(directory: str | os.PathLike[str]) -> dict[str, int]:
    """Sum every side's counters found under `<directory>/metrics` (all processes so far)."""
    total: dict[str, int] = {}
    root = Path(directory) / "metrics"
    if not root.is_dir():
        return total
    for path in sorted(root.glob("*.json")):
        data = json.loads(path.read_text())
        for k, v in data.get("counts", {}).items():
            total[k] = total.get(k, 0) + int(v)
    return total


def read_info(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The size facts the sides recorded (vLLM's row bytes, kvtier's chunk bytes per group)."""
    out: dict[str, int] = {}
    root = Path(directory) / "metrics"
    for path in sorted(root.glob("*.json")) if root.is_dir() else ():
        out.update(json.loads(path.read_text()).get("info", {}))
    return out


def model_identity(model: str) -> str:
    """The namespace's model field: the model path/name plus, for a local directory, a digest of
    its config.json and of its weight files (`kvtier.integrations.weights`: every tensor's name, dtype, shape
    and first, middle and last 4 KiB), so two checkpoints at one path never share chunks."""
    cfg = Path(model) / "config.json"
    out = model
    if cfg.is_file():
        out = f"{model}#{hashlib.blake2b(cfg.read_bytes(), digest_size=8).hexdigest()}"
    return with_weights(out, files_digest(model))
