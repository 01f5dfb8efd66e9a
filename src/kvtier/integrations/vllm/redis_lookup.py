"""The shared Redis tier's presence, asked off the engine thread (the manager's lookup).

A key the manager's index lacks may be in Redis (another engine, an earlier process). A lookup
never makes that round trip itself: it queues the key and answers RETRY; a background thread
asks Redis for every queued key in one pipeline and records the answers, which the next lookup of
the key (vLLM retries the next step) consumes. An answer that takes longer than
REDIS_LOOKUP_TIMEOUT_S is a counted miss, so a hung Redis never holds a request back; an answer
is kept for REDIS_ANSWER_TTL_S, so every request waiting on it uses it, then asked again. A
chunk Redis holds is adopted into the manager's index (`adopt`), tracked like its own entries.

The client comes from the one tier factory (store/tiers/factory.py, through tiers.py), with the
settings of every other Redis client of the engine: the URL (TLS with `rediss://`), the password
(`kvtier.redis_password_file` or the environment) and the namespace. Without the tenant secret:
EXISTS reads no payload, so there is nothing to check a MAC of.
"""

from __future__ import annotations

import threading
import time

from kvtier.index.index import Entry, Index
from kvtier.store.lane import Lane

from .common import SPLIT_MEMO_KEYS, SpecContext
from .counters import Metrics
from .tiers import redis_tier

REDIS_LOOKUP_TIMEOUT_S = 2.0  # a Redis answer later than this is a counted miss
REDIS_ANSWER_TTL_S = 1.0  # an answer not used within this is asked again


class RedisLookup:
    """Whether Redis holds a chunk, answered from a cache its own thread (`lane`) fills; its own
    lock, never the manager's (the thread runs between the manager's calls)."""

    def __init__(self, ctx: SpecContext, metrics: Metrics) -> None:
        self.ctx = ctx
        self.metrics = metrics
        self.redis = redis_tier(ctx, ctx.namespace.id)  # the client connects lazily
        self.lock = threading.Lock()
        self._want: list[tuple[bytes, int]] = []
        self._asked: dict[tuple[bytes, int], float] = {}
        self._answers: dict[tuple[bytes, int], tuple[bool, float]] = {}  # (in Redis, when)
        self._check_queued = False
        self.lane = Lane("redis-lookup", 0)

    def answer(self, split: tuple[bytes, int]) -> bool | None:
        """Whether Redis holds chunk `split`, or None while it is being asked (the caller answers
        RETRY; the first ask queues a check)."""
        with self.lock:
            now = time.monotonic()
            answer = self._answers.get(split)
            if answer is not None:  # kept for its TTL: every request waiting on it uses it
                if now - answer[1] <= REDIS_ANSWER_TTL_S:
                    return answer[0]
                del self._answers[split]  # stale: asked again below
            asked = self._asked.get(split)
            if asked is not None:
                if now - asked > REDIS_LOOKUP_TIMEOUT_S:
                    del self._asked[split]
                    self.metrics.add("redis_lookup_timeouts")
                    return False
                return None
            if len(self._asked) >= SPLIT_MEMO_KEYS:  # bounded like every per-key map here
                self._asked.clear()
            self._asked[split] = now
            self._want.append(split)
            if not self._check_queued:
                self._check_queued = self.lane.submit(self._check)
            self.metrics.add("redis_lookups_queued")
            return None

    def adopt(self, index: Index, split: tuple[bytes, int]) -> tuple[bool | None, tuple[Entry, ...]]:
        """(Whether chunk `split` is in Redis and now tracked by `index` like its own entries, or
        None while Redis is being asked (`answer`); the entries the adoption evicted, which the
        caller reports). False also while every tracked Redis entry of its group is pinned
        (tried next time)."""
        answer = self.answer(split)
        if not answer:
            return answer, ()
        r = index.put(*split, "redis")
        if r.slot is None and r.status != "present":
            return False, r.evicted
        self.metrics.add("adopted_from_redis", group=split[1])
        return True, r.evicted

    def _check(self) -> None:
        """On the lane: one pipelined EXISTS for every key queued since the last check. With
        tensor parallel a chunk is in Redis only when every rank's shard (its key under that
        rank's namespace) exists: Redis evicts keys one by one."""
        from kvtier.store.payload import chunk_header

        with self.lock:
            want, self._want = self._want, []
            self._check_queued = False
            ctx, redis = self.ctx, self.redis
        if not want or redis is None:
            return
        ids = ctx.rank_namespace_ids()
        # EXISTS asks by key (namespace, hash, group): the span is not part of it
        headers = [chunk_header(ctx.plan, i, h, g, 0, 0) for h, g in want for i in ids]
        each = redis.exists_many(headers)
        found = [all(each[k * len(ids):(k + 1) * len(ids)]) for k in range(len(want))]
        with self.lock:
            if len(self._answers) >= SPLIT_MEMO_KEYS:
                self._answers.clear()
            now = time.monotonic()
            for split, there in zip(want, found):
                if self._asked.pop(split, None) is not None:  # not reset or timed out meanwhile
                    self._answers[split] = (bool(there), now)

    def forget(self) -> None:
        """The manager's index was reset: answers from before are not used, questions in flight
        record nothing."""
        with self.lock:
            self._answers.clear()
            self._asked.clear()

    def relayout(self, ctx: SpecContext) -> None:
        """The workers' layout arrived (a new namespace): a client under it, nothing asked before kept."""
        with self.lock:
            self.ctx = ctx
            self.redis.close()
            self.redis = redis_tier(ctx, ctx.namespace.id)
            self._want.clear()
            self._asked.clear()
            self._answers.clear()

    def close(self) -> None:
        self.lane.close(5.0)
        self.redis.close()
