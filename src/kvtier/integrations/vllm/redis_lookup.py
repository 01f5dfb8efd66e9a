"""The shared Redis tier's presence, asked off the engine thread (the manager's lookup).

A key the manager's index lacks may be in Redis (another engine, an earlier process). A lookup
never makes that round trip itself: it queues the key and answers RETRY; a background thread
asks Redis for every queued key in one pipeline and records the answers, which the next lookup of
the key (vLLM retries the next step) consumes. An answer that takes longer than
REDIS_LOOKUP_TIMEOUT_S is a counted miss, so a hung Redis never holds a request back; an answer
is kept for REDIS_ANSWER_TTL_S, so every request waiting on it uses it, then asked again.
"""

from __future__ import annotations

import threading
import time

from kvtier.store.lane import Lane

from .common import SPLIT_MEMO_KEYS, SpecContext
from .counters import Metrics

REDIS_LOOKUP_TIMEOUT_S = 2.0  # a Redis answer later than this is a counted miss
REDIS_ANSWER_TTL_S = 1.0  # an answer not used within this is asked again


def _open(ctx: SpecContext):  # noqa: ANN202 - a RedisTier
    from kvtier.store.tiers.redis import RedisTier  # no torch; the client connects lazily

    from .config import redis_password

    # shared with other engines: a key this index lacks may still be in Redis
    return RedisTier.from_url(str(ctx.config.redis_url), namespace_id=ctx.namespace.id,
                              password=redis_password(ctx.config))


class RedisLookup:
    """Whether Redis holds a chunk, answered from a cache its own thread (`lane`) fills; its own
    lock, never the manager's (the thread runs between the manager's calls)."""

    def __init__(self, ctx: SpecContext, metrics: Metrics) -> None:
        self.ctx = ctx
        self.metrics = metrics
        self.redis = _open(ctx)
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

    def _check(self) -> None:
        """On the lane: one pipelined EXISTS for every key queued since the last check. With
        tensor parallel a chunk is in Redis only when every rank's shard (its key under that
        rank's namespace) exists: Redis evicts keys one by one."""
        from kvtier.store.payload import make_header

        with self.lock:
            want, self._want = self._want, []
            self._check_queued = False
            ctx, redis = self.ctx, self.redis
        if not want or redis is None:
            return
        ids = ctx.rank_namespace_ids()
        headers = [make_header(i, h, g, 0, 0, ctx.plan.groups[g].chunk_bytes) for h, g in want for i in ids]
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
            self.redis = _open(ctx)
            self._want.clear()
            self._asked.clear()
            self._answers.clear()

    def close(self) -> None:
        self.lane.close(5.0)
        self.redis.close()
