"""Trace replay: the real index, policies and admission, no payloads.

`replay(plan, trace, capacities, policy, ...)` drives `kvtier.index.index.Index` exactly as the store
(`kvtier.store.store`) does, minus the bytes:
1. requests in timestamp order; per request, `Index.lookup(chunks, P)` before anything of the
   request is stored: the hit is the largest T every cacheable group restores (plan rules);
   the loaded chunks are touched. A chunk loaded from a lower tier is promoted (put into the
   first tier, evicting there as a save would).
2. admission (optional) says how many leading chunks may be stored: `admit(chunks)`.
3. save: for every admitted chunk in prefix order, anchor groups (full/mla) first, the groups'
   `plan.store_chunks`: a chunk already held is touched in every tier; a new one is put into
   every tier (write-through, the store's and the vLLM manager's one policy; a cold one into the
   tiers after the first, or with one tier into it as a first victim); an evicted entry is
   dropped, never copied down.
Hit rate = hit chunks / all chunks (full chunks of every request).

Belady's MIN ("min") is the reference row: on every pool, evict the entry whose next use (the
next request that contains its hash) is farthest; and it does not store a chunk no later request
contains (bypass: an optimal offline cache never spends a slot on a chunk that is never read
again; a request's chunks with a later use are always a prefix, because hashes are chained).

Cost model (`CostModel`): a request's hit of T tokens saves F(T) FLOPs of prefill, F from the
geometry's compute model (`kvtier.core.cost`: linear terms, attention's quadratic term capped by
windows, linear state recurrences); *compute saved* = sum of F(hit) / sum of F(prompt) over the
trace's requests. Time: compute saved / FLOP/s - bytes loaded per tier / that tier's bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.core.cost import ComputeModel, Term
from kvtier.errors import ConfigError
from kvtier.index.index import ChunkHash, Index
from kvtier.index.placement import learned_start
from kvtier.index.placement import StoreChunks, store_request, tail_chunks  # noqa: F401 (tail_chunks: tests import it from here)
from kvtier.index.tuning import worth_index, worth_options
from kvtier.core.plan import Plan
from kvtier.index.policies import POLICIES, EvictionPolicy
from kvtier.replay.oracle import NEVER, Belady, next_uses
from kvtier.replay.trace import Trace
from kvtier.core.units import UNIT_NAMES, parse_bytes

DEFAULT_BANDWIDTH = {"cpu": 25e9, "disk": 5e9, "redis": 1.25e9}  # bytes/s: PCIe, NVMe, 10 GbE


@dataclass(frozen=True, slots=True)
class CostModel:
    """FLOPs per prompt (`compute`; without one, 2 x `active_params` per token, no attention
    term), the accelerator's FLOP/s and each tier's load bandwidth."""

    active_params: float = 8e9  # parameters used per token (MoE: the active ones), when no compute
    flops: float = 400e12  # sustained prefill FLOP/s of the accelerator
    bandwidth: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTH))
    compute: ComputeModel | None = None

    def __post_init__(self) -> None:
        if self.active_params <= 0 or self.flops <= 0:
            raise ConfigError("cost model: active parameters and FLOP/s must be positive")
        if any(v <= 0 for v in self.bandwidth.values()):
            raise ConfigError(f"cost model: bandwidths {dict(self.bandwidth)} must be positive")

    @property
    def model(self) -> ComputeModel:
        if self.compute is not None:
            return self.compute
        return ComputeModel((Term("", "mlp", 1, 2.0 * self.active_params),), "2 x active params")

    def prefill_flops(self, tokens: int) -> float:
        return self.model.flops(tokens)

    def load_seconds(self, tier: str, num_bytes: int) -> float:
        bw = self.bandwidth.get(tier)
        if bw is None:
            raise ConfigError(f"cost model has no bandwidth for tier {tier!r}; give --bandwidth {tier}=RATE")
        return num_bytes / bw


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    admission: str
    share: str
    hit_chunks: int
    total_chunks: int
    hit_tokens: int
    total_tokens: int
    hit_requests: int
    requests: int
    loads: dict[str, dict[str, int]]  # tier -> group name -> chunks loaded
    loaded_bytes: dict[str, dict[str, int]]
    written_bytes: dict[str, dict[str, int]]  # saves (to every tier) + promotions
    evictions: dict[str, dict[str, int]]
    dead_evictions: dict[str, dict[str, int]]
    prefill_seconds_saved: float  # compute saved minus load time
    compute_seconds_saved: float
    load_seconds: float
    prefill_seconds_total: float  # compute of every prompt token with no cache
    wall_seconds: float
    flops_saved: float = 0.0  # prefill FLOPs the hits skip
    flops_total: float = 0.0  # prefill FLOPs of every prompt with no cache
    share_final: dict[str, dict[str, float]] | None = None  # share="learned": tier -> group -> fraction at the end

    @property
    def compute_saved(self) -> float:
        """Share of all prompt FLOPs the hits skip."""
        return self.flops_saved / self.flops_total if self.flops_total else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_chunks / self.total_chunks if self.total_chunks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    def to_dict(self) -> dict[str, object]:
        d = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        d["hit_rate"] = self.hit_rate
        d["token_hit_rate"] = self.token_hit_rate
        d["compute_saved"] = self.compute_saved
        d["written_bytes_total"] = sum(sum(v.values()) for v in self.written_bytes.values())
        d["loaded_bytes_total"] = sum(sum(v.values()) for v in self.loaded_bytes.values())
        return d


class Placement(Protocol):
    """Where a request's chunks are stored, per group: `place(chunks, n)` (n = the admitted
    leading chunks) -> {group index: (warm chunk indices, None = all; cold chunk indices)};
    a group left out stores every chunk warm, the rest is not stored. Called once per request."""

    name: str

    def place(self, chunks: Sequence[ChunkHash], n: int) -> Mapping[int, tuple[Collection[int] | None,
                                                                                 Collection[int]]]: ...


class _NoAdmission:
    name = "all"

    def admit(self, chunk_hashes: list[ChunkHash]) -> int:
        return len(chunk_hashes)


def replay(
    plan: Plan,
    trace: Trace,
    capacities: Mapping[str, int],
    policy: str | Callable[[int], EvictionPolicy] = "lru",
    *,
    admission: object | None = None,
    admission_name: str = "all",
    share: str | Mapping[str, float] = "proportional",
    cost: CostModel | None = None,
    progress: Callable[[int], None] | None = None,
    future: list[list[float]] | None = None,
    tail_endpoints: int | None = None,
    placement: Placement | None = None,
    setup: Callable[[Index], None] | None = None,
    observe: Callable[[int, Index], None] | None = None,
) -> Result:
    """Replay `trace` through a fresh Index; `policy` is a POLICIES name, "min", or a factory
    (slots -> policy) with `setup(index)` to tell its policies their groups. `placement` says,
    per request, where each group's chunks are stored warm, cold or not at all; `observe(r, index)`
    runs after each request (an online tuner)."""
    t_start = time.perf_counter()
    cost = cost or CostModel()
    for tier in capacities:
        cost.load_seconds(tier, 0)  # every tier needs a bandwidth: fail before the replay
    is_min = policy == "min"
    worth = isinstance(policy, str) and policy.partition(":")[0] == "worth"
    if isinstance(policy, str) and not is_min and not worth and policy not in POLICIES:
        raise ConfigError(f"unknown eviction policy {policy!r}; use one of: {', '.join(POLICIES)}, "
                          "worth, min")
    next_use: dict[ChunkHash, float] = {}
    tuner = None
    if is_min:
        future = future if future is not None else next_uses(trace)
        index = Index(plan, capacities, policy=lambda slots: Belady(slots, next_use), share=share)
    elif worth:
        assert isinstance(policy, str)
        index, tuner = _worth_index(policy, plan, capacities, share, cost, placement, tail_endpoints)
    else:
        index = Index(plan, capacities, policy=policy, share=share,
                      start=learned_start(plan, share, placement, capacities))
    if setup is not None:
        setup(index)
    adm = admission if admission is not None else _NoAdmission()
    tiers = list(capacities)
    first = tiers[0]
    c = plan.chunk_tokens
    cacheable = plan.cacheable_groups
    names = {gp.index: gp.name for gp in cacheable}
    chunk_bytes = {gp.index: gp.chunk_bytes for gp in cacheable}
    zero = lambda: {t: {gp.name: 0 for gp in cacheable} for t in tiers}  # noqa: E731
    loads, loaded, written = zero(), zero(), zero()
    wanted = StoreChunks(plan, tail_endpoints)

    def put(h: ChunkHash, g: int, tier: str, cold: bool = False) -> None:
        # what this evicts is dropped: write-through put it in the lower tiers already
        if index.put(h, g, tier, cold=cold).slot is not None:
            written[tier][names[g]] += chunk_bytes[g]

    def save(h: ChunkHash, g: int, cold: bool = False) -> None:
        if not cold:
            for tier in tiers:  # write-through
                put(h, g, tier)
        elif len(tiers) > 1:  # cold: the tiers after the first, as the store and vLLM place it
            for tier in tiers[1:]:
                put(h, g, tier)
        else:  # one tier: into it as a first victim (the store and vLLM skip it)
            put(h, g, first, True)

    hit_chunks = hit_tokens = hit_requests = 0
    flops_saved = flops_total = load_secs = 0.0
    model = cost.model
    flops_of: dict[int, float] = {}  # tokens -> F(tokens); prompts repeat lengths

    def prefill(tokens: int) -> float:
        f = flops_of.get(tokens)
        if f is None:
            f = flops_of[tokens] = model.flops(tokens)
        return f
    contains, touch_all = index.contains, index.touch_all
    learned = bool(index.learners)
    for r, req in enumerate(trace.requests):
        chunks = req.chunks
        if is_min:
            assert future is not None
            fut = future[r]
            for i, h in enumerate(chunks):
                next_use[h] = fut[i]
        hit = index.lookup(chunks, req.prompt_tokens)
        flops_total += prefill(req.input_tokens)
        if hit.tokens:
            hit_requests += 1
            n_hit = hit.tokens // c
            hit_chunks += n_hit
            tok = min(hit.tokens, req.input_tokens)
            hit_tokens += tok
            flops_saved += prefill(tok)
            for g, group_loads in enumerate(hit.chunks):
                for ld in group_loads:
                    name = names[g]
                    loads[ld.tier][name] += 1
                    loaded[ld.tier][name] += chunk_bytes[g]
                    load_secs += cost.load_seconds(ld.tier, chunk_bytes[g])
                    if ld.tier != first and not contains(ld.chunk_hash, g, first):
                        put(ld.chunk_hash, g, first)  # promotion
        n = len(chunks)
        if is_min:
            assert future is not None
            k = 0
            while k < n and future[r][k] != NEVER:
                k += 1
            n = k
        admitted = adm.admit(list(chunks))  # type: ignore[attr-defined]  (every request: oracles count calls)
        n = min(n, int(admitted))
        spots = placement.place(chunks, n) if placement is not None else None
        store_request(chunks, n, wanted, spots, contains, touch_all, save)
        if learned:
            index.observe()  # a resize's evictions are dropped, its moves cost no bytes here
        if tuner is not None:
            tuner.observe(req.chunks, req.prompt_tokens, req.input_tokens, tuner.started or any(
                index.counters(gp.index, first)["evictions"] for gp in cacheable))
        if observe is not None:
            observe(r, index)
        if progress is not None:
            progress(1)
    evictions = {t: {names[g]: index.counters(g, t)["evictions"] for g in names} for t in tiers}
    dead = {t: {names[g]: index.counters(g, t)["dead_evictions"] for g in names} for t in tiers}
    label = policy if isinstance(policy, str) else getattr(placement, "name", "custom")
    if worth:
        w = index.policy_of(cacheable[0].index, first).weight.w  # type: ignore[attr-defined]
        label = f"worth(w={w:g}{', tuned' if tuner is not None else ''})"
    return Result(
        policy=label,
        admission=admission_name if not is_min else "oracle",
        share=share if isinstance(share, str) else ",".join(f"{k}={v:g}" for k, v in share.items()),
        hit_chunks=hit_chunks,
        total_chunks=trace.total_chunks,
        hit_tokens=hit_tokens,
        total_tokens=trace.total_input_tokens,
        hit_requests=hit_requests,
        requests=len(trace.requests),
        loads=loads,
        loaded_bytes=loaded,
        written_bytes=written,
        evictions=evictions,
        dead_evictions=dead,
        prefill_seconds_saved=flops_saved / cost.flops - load_secs,
        compute_seconds_saved=flops_saved / cost.flops,
        load_seconds=load_secs,
        prefill_seconds_total=flops_total / cost.flops,
        wall_seconds=time.perf_counter() - t_start,
        flops_saved=flops_saved,
        flops_total=flops_total,
        share_final={lr.tier: {names[g]: round(f, 4) for g, f in lr.shares().items()}  # type: ignore[attr-defined]
                     for lr in index.learners} or None,
    )


def _worth_index(name: str, plan: Plan, capacities: Mapping[str, int],
                 share: str | Mapping[str, float], cost: CostModel, placement: Placement | None,
                 tail_endpoints: int | None):
    """`kvtier.index.tuning.worth_index` (the rule the Store and vLLM's manager run), its shadows
    inline and storing cold chunks into a lone tier as this loop does; the tuner is None when the
    name fixes w."""
    opts = worth_options(name)
    kw = {k: int(v) for k, v in opts.items() if k in ("max_chunks", "period")}
    w = opts.get("w")
    return worth_index(plan, capacities, share=share, placement=placement, cost=cost.model,
                       tail_endpoints=tail_endpoints, w=None if w is None else float(w),
                       runner="inline", cold_in_first=True, **kw)


def admission_horizon(plan: Plan, tier: str, capacity: int, share: str | Mapping[str, float]) -> int:
    """The learning horizon replay gives `prefix`, `tinylfu` and `adaptive`: how many chunks the
    first tier holds for the anchor group (the first full/MLA group; else the first cacheable
    one) under `share`, i.e. one cache turnover of the chunks every hit needs. Proportional
    share: capacity // (bytes of one chunk of every group)."""
    from kvtier.index.pool import _slots

    cacheable = plan.cacheable_groups
    slots = _slots(plan, tier, capacity, share)
    anchors = [i for i, gp in enumerate(cacheable) if gp.kind in ("full", "mla")]
    return max(1, slots[anchors[0] if anchors else 0])


def footprint_bytes(plan: Plan, trace: Trace) -> int:
    """Bytes to hold every unique chunk of the trace in every cacheable group."""
    return trace.unique_chunks * plan.chunk_bytes_all_groups


def parse_size(text: str, footprint: int | None = None) -> int:
    """`1234`, `64K`, `8MiB`, `2G`, `1.5GB`; or `10%` of `footprint` (the trace's unique chunks)."""
    s = text.strip()
    if s.endswith("%"):
        if footprint is None:
            raise ConfigError(f"size {text!r} is a percentage, but there is nothing to take it of")
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ConfigError(f"size {text!r} is not a number followed by %") from None
        if pct <= 0:
            raise ConfigError(f"size {text!r} must be > 0%")
        return max(1, int(footprint * pct / 100))
    value = parse_bytes(s)
    if value is None:
        unit = s.lstrip("0123456789. ")
        what = f"has unknown unit {unit!r}" if unit and s[: len(s) - len(unit)].strip() else \
            "is not a byte count like 64GiB, 500M, 1234 or 10%"
        raise ConfigError(f"size {text!r} {what}; units: {UNIT_NAMES} or %")
    if value <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return value


def run_all(plan: Plan, trace: Trace, capacities: Mapping[str, int], policies: Iterable[str],
            admissions: Iterable[tuple[str, Callable[[], object] | None]] = (("all", None),),
            shares: Iterable[str | Mapping[str, float]] = ("proportional",),
            cost: CostModel | None = None,
            progress: Callable[[int], None] | None = None,
            future: list[list[float]] | None = None,
            tail_endpoints: int | None = None,
            placement: Callable[[], Placement] | None = None,
            runners: Mapping[str, Callable[..., Result]] | None = None) -> list[Result]:
    """Every (share, admission, policy), then MIN per share; MIN's future is computed once."""
    out: list[Result] = []
    future = future if future is not None else next_uses(trace)
    admissions = list(admissions)
    for share in shares:
        for adm_name, make in admissions:
            for pol in policies:
                runner = (runners or {}).get(pol.partition(":")[0])
                if runner is not None:  # a baseline with its own loop (Marconi)
                    out.append(runner(pol, plan, trace, capacities, share=share, cost=cost,
                                      admission=make() if make else None, admission_name=adm_name,
                                      progress=progress))
                    continue
                # row-per-key models a layout-blind offloader: every chunk of every group warm
                blind = share == "row-per-key"
                if blind and pol.partition(":")[0] == "worth":
                    pol = "lru"  # a layout-blind offloader evicts by recency
                out.append(replay(plan, trace, capacities, pol, admission=make() if make else None,
                                  admission_name=adm_name, share=share, cost=cost,
                                  progress=progress, tail_endpoints=None if blind else tail_endpoints,
                                  placement=placement() if placement and not blind else None))
        out.append(replay(plan, trace, capacities, "min", share=share, cost=cost,
                          progress=progress, future=future, tail_endpoints=tail_endpoints))
    return out
