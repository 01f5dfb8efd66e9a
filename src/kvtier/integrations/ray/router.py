"""`KvtierRequestRouter`: Ray Serve's request router interface, choosing the replica whose vLLM
engine restores the most of a prompt from kvtier's tiers (score.py), against its queue."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Iterable, Mapping, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvtier.router import PrefixIndex, Restorable, Subscriber

from .score import DEFAULT_QUEUE_COST_TOKENS, DEFAULT_TIER_COSTS, Choice, prompt_tokens, rank, worth

log = logging.getLogger("kvtier.router")

EVENTS_KEY = "kvtier_kv_events"  # a replica's record_replica_metadata: its publisher, as the router reaches it
REPLAY_KEY = "kvtier_kv_replay"  # and, optionally, its replay endpoint


def replica_metadata(port: int, replay_port: int | None = None, host: str | None = None) -> dict[str, str]:
    """What a replica's `record_replica_metadata()` returns so the router follows its engine's KV
    events: the engine publishes on `tcp://*:port` (vLLM binds only with `*`), the router connects
    to this node's address."""
    if host is None:
        import ray

        host = ray.util.get_node_ip_address()
    out = {EVENTS_KEY: f"tcp://{host}:{port}"}
    if replay_port is not None:
        out[REPLAY_KEY] = f"tcp://{host}:{replay_port}"
    return out


class KvtierRequestRouter(RequestRouter):
    """Each request goes to the replica with the best `saved tokens - queue x queue_cost_tokens`
    (score.py), where saved tokens are what kvtier's router predicts the replica's engine restores
    in every KV-cache group, less each tier's load cost; when no replica restores anything, to the
    shorter queue of two random replicas (Ray's default power of two choices).

    Ray's FIFOMixin is left out on purpose: it hands the replica chosen for one request to the
    oldest pending one, which would break the prefix match. Every replica's `record_replica_metadata`
    names its engine's event publisher (`replica_metadata`); the router follows each on a
    `kvtier.router.Subscriber` thread, named by the replica's unique id."""

    def initialize_state(self, tier_costs: Mapping[str, float] | None = None,
                         queue_cost_tokens: float = DEFAULT_QUEUE_COST_TOKENS, topic: str = "",
                         tokenizer: str | None = None, draft_groups: Iterable[int] = (),
                         retained_tokens: int = 0) -> None:
        """Ray Serve calls this with `RequestRouterConfig.request_router_kwargs`. `tier_costs`: a
        token's load cost per tier, in recomputed tokens (score.DEFAULT_TIER_COSTS); `tokenizer`:
        a model directory or name, for requests that carry text (token ids need none);
        `draft_groups` / `retained_tokens`: as `PrefixIndex`'s, where speculative decoding is on."""
        from kvtier.errors import ConfigError

        if type(queue_cost_tokens) not in (int, float) or not 0 <= queue_cost_tokens < math.inf:
            raise ConfigError(f"queue_cost_tokens={queue_cost_tokens!r}: give prompt tokens, finite and >= 0 "
                              f"(the default is {DEFAULT_QUEUE_COST_TOKENS})")
        costs = dict(DEFAULT_TIER_COSTS if tier_costs is None else tier_costs)
        if bad := {t: c for t, c in costs.items() if type(c) not in (int, float) or not 0 <= c <= 1}:
            raise ConfigError(f"tier_costs {bad}: give each tier's cost of loading a token as a fraction of "
                              f"recomputing it, 0..1 (the defaults: {dict(DEFAULT_TIER_COSTS)})")
        self.index = PrefixIndex(draft_groups=draft_groups, retained_tokens=retained_tokens)
        self.tier_costs, self.queue_cost_tokens, self.topic = costs, float(queue_cost_tokens), topic
        self.decisions = {"by_prefix": 0, "by_load": 0}  # how requests were routed
        self.last: list[Choice] = []  # the scores of the last request routed by prefix
        self._tokenizer_name, self._tokenizer = tokenizer, None
        self._subscribers: dict[str, tuple[tuple[str, str | None], Subscriber]] = {}
        # imported here, at run time: Ray Serve pickles the router's package by value into each
        # process, so a module-level reference would be a copy of the registry
        from kvtier.integrations.ray import live

        live.LIVE.add(self)

    # -- replicas come and go: follow each one's event publisher ------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._follow(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop(replica_id.unique_id)

    def _follow(self, replicas: Sequence[RunningReplica]) -> None:
        if not hasattr(self, "index"):  # before initialize_state
            return
        wanted = {}
        for r in replicas:
            meta = r.replica_metadata
            if isinstance(meta.get(EVENTS_KEY), str):
                replay = meta.get(REPLAY_KEY)
                wanted[r.replica_id.unique_id] = (meta[EVENTS_KEY], replay if isinstance(replay, str) else None)
        for engine in [e for e, (where, _) in self._subscribers.items() if wanted.get(e) != where]:
            self._drop(engine)
        for engine, (endpoint, replay) in wanted.items():
            if engine in self._subscribers:
                continue
            try:
                sub = Subscriber(self.index, {engine: endpoint}, self.topic,
                                 replay=None if replay is None else {engine: replay})
            except Exception:  # noqa: BLE001 - a replica with a bad endpoint is routed by load
                self.index.count(engine, "subscribe_errors")
                log.exception("kvtier router: replica %s's events at %r were not followed", engine, endpoint)
                continue
            self._subscribers[engine] = ((endpoint, replay), sub)

    def _drop(self, engine: str) -> None:
        """Stop following a replica: its view is dropped at once; its subscriber's thread is
        joined on another thread (a join may take seconds, and this runs on Ray's event loop)."""
        entry = self._subscribers.pop(engine, None)
        if entry is not None:
            self.index.reset(engine, "replica_gone")  # what its tiers held is no longer ours to route to
            threading.Thread(target=entry[1].close, name="kvtier-router-close", daemon=True).start()

    # -- one request ---------------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of one replica each, best score first; or Ray's power of two choices: one rank of
        two random replicas, of which Ray takes the shorter queue."""
        if not candidate_replicas:
            return []
        if pending_request is not None:  # every candidate is ranked: when all are full, Ray waits
            pending_request.routing_context.should_backoff = True  # before asking again (no spin)
        tokens = self._tokens(pending_request)
        by_engine = {r.replica_id.unique_id: r for r in candidate_replicas}
        hits: dict[str, Restorable] = {}
        if tokens:
            hits = {e: self.index.longest_prefix(tokens, e)[0] for e in by_engine if e in self._subscribers}
        if worth(hits, self.tier_costs):
            queues = await self._queue_lens(candidate_replicas)
            choices = rank(hits, {e: n for e, n in queues.items() if n is not None}, self.tier_costs,
                           self.queue_cost_tokens)
            if choices:
                self.decisions["by_prefix"] += 1
                self.last = choices
                ranked = [[by_engine[c.engine]] for c in choices]
                return ranked + [[by_engine[e]] for e, n in queues.items() if n is None]
        self.decisions["by_load"] += 1
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    async def _queue_lens(self, replicas: Sequence[RunningReplica]) -> dict[str, int | None]:
        """Each replica's queue length: Ray's cache where fresh, else asked (as Ray's own prefix
        router does); None for one that did not answer in time."""
        out: dict[str, int | None] = {}
        ask = []
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if n is None:
                ask.append(r)
            else:
                out[r.replica_id.unique_id] = n
        if ask:
            for r, n in await self._probe_queue_lens(ask, 0):
                out[r.replica_id.unique_id] = n
        return out

    def _tokens(self, pending_request: PendingRequest | None) -> list[int] | None:
        if pending_request is None:
            return None
        try:
            if self._tokenizer is None and self._tokenizer_name is not None:
                name, self._tokenizer_name = self._tokenizer_name, None  # tried once: a failure is not retried per request
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(name)
            return prompt_tokens(pending_request.args or (), pending_request.kwargs or {}, self._tokenizer)
        except Exception:  # noqa: BLE001 - a prompt (or tokenizer) that fails is routed by load
            log.exception("kvtier router: the prompt of request %s was not read",
                          pending_request.metadata.request_id)
            return None

    def summary(self) -> dict[str, object]:
        """What the router learned (`PrefixIndex.summary`) and how it routed."""
        return {"engines": self.index.summary(), "decisions": dict(self.decisions),
                "followed": {e: where for e, (where, _) in self._subscribers.items()}}
