"""The `redis` tier: chunk payloads in a shared Redis / Valkey (standalone, Sentinel, Cluster).

Key-addressed (`shared = True`): many processes on many hosts read and write one namespace, so
the key is the address and there are no slots. A payload is kvtier's 128-byte header followed by
the raw bytes, stored as one string value (SET is atomic: no reader sees half a value) under

    kvtier:<namespace id>:{<chunk hash hex>}:<group>

The `{...}` is a Redis Cluster hash tag on the chunk hash: every group of one chunk lives on one
node (one chunk's groups come and go together), while the chunks of a prefix spread over all
nodes (a tag on the namespace would put a whole model's cache on one node).
Batches are pipelines; a cluster pipeline splits a batch by node and sends each node its part, so
a whole prefix costs one round trip per node.

Capacity. The server's `maxmemory` with `allkeys-lru` (or `volatile-lru`, every kvtier key has a
TTL when `ttl_s` is set) is the real bound: Redis evicts least recently used payloads for every
process at once, and an evicted payload is a miss. On top, `budget_bytes` is an optional
per-namespace write budget: every write adds its bytes to a time-bucketed counter in Redis, and a
write is skipped (counted) when the bytes written in the last `ttl_s` would exceed the budget.
Since every payload expires `ttl_s` after its write (hits do not extend the TTL when a budget is
set), that bounds the namespace's live bytes; it is conservative (deletes and evictions give
nothing back until their bucket ages out): Redis evictions and expiries never decrement a
counter, so a plain one would drift for ever.

Failures are values: Redis down at start or mid-run, slow (a call past its deadline,
`socket_timeout_s` after it began: `redis_conn.call_deadline`), out of memory, a payload evicted
between lookup and load, or one that fails its header or checksum is a counted miss or skipped
save, never an exception and never wrong bytes. After a connection failure a
circuit breaker skips every call until a backoff deadline (doubling up to `backoff_max_s`), then
lets one call through; one log line when the tier goes down, one when it is back.

Tenants. A reader deletes a value only when it is broken for everyone: a bad header, another
chunk's or namespace's header under the key, a checksum that fails. A value whose checksum
verifies and only the MAC fails (written with another tenant's secret, or with none, by an
engine sharing the namespace) is a miss counted in `foreign_skipped` and kept: deleting it made
two tenants on one model (no `kvtier.tenant`) evict each other. Tenants who want nothing shared
set `kvtier.tenant` (a namespace salt).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvtier.core.counters import REDIS_EXTRA, TIER_BASE, UndeclaredCounter
from kvtier.errors import ConfigError
from kvtier.store.integrity import Keyed, mac_only
from kvtier.store.payload import HASH_BYTES, HEADER_BYTES, ChunkHeader, decode_header, span_not_held
from kvtier.store.tiers.base import LogOnce, Tier
from kvtier.store.tiers.redis_codec import Arena, restore, u8_view, unknown_command
from kvtier.store.tiers.redis_reader import OversizedValue, ReplyReader, Streamed, read_value
from kvtier.store.tiers.redis_wire import get_stream, set_stream
from kvtier.store.tiers.redis_conn import (
    Breaker,
    RedisOptions,
    WriteBudget,
    build_client,
    call_deadline,
    describe_error,
    is_connection_error,
    redact,
)

log = logging.getLogger("kvtier.store.tiers.redis")

__all__ = ["RedisOptions", "RedisTier"]

# the slowest link a batch's bytes may take before its call counts as hung (32 MiB/s): the deadline
# of a call moving B bytes is socket_timeout_s + B / MIN_RATE_BYTES_S, so a 64 MiB batch on a
# healthy link is never cut off, and a drip still is
MIN_RATE_BYTES_S = 32 << 20
SLOT_MEMORY = 4096  # (group, slot) -> last header written, for free(group, slot)


# beyond the Tier base counters (reads, misses, writes, failed_writes, corrupt_dropped, bytes)
_EXTRA = REDIS_EXTRA  # declared in kvtier.core.counters (TIER), with their help


class RedisTier(Tier):
    """Chunk payloads in Redis, addressed by (namespace, chunk hash, group) from the header."""

    name = "redis"
    shared = True  # key-addressed: the slot argument of the Tier contract is ignored
    persistent = True  # outlives this process; `list()` shows what the namespace holds

    def __init__(self, options: RedisOptions | None = None, *, namespace_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, keyed: Keyed | None = None) -> None:
        super().__init__()
        self.keyed = keyed  # a tenant secret: payloads are MACed and only verified MACs restore
        if namespace_id is not None and (
                len(namespace_id) != 16 or any(c not in "0123456789abcdef" for c in namespace_id)):
            raise ConfigError(f"namespace id {namespace_id!r} must be 16 lowercase hex digits "
                              "(keys.Namespace.id)")
        self.namespace_id = namespace_id  # restricts `list()`; None: every kvtier namespace
        self.options = options or RedisOptions()
        self._budget = (WriteBudget(self.options, wall_clock, clock)
                        if self.options.budget_bytes is not None else None)
        self._breaker = Breaker(log, self.options.backoff_initial_s, self.options.backoff_max_s,
                                clock, describe=redact(self.options.url))
        self._log = LogOnce(log, clock)
        self._lock = threading.Lock()
        self._extra = dict.fromkeys(_EXTRA, 0)
        self._arena = Arena()  # reused encode buffer of write batches (Redis Cluster)
        self._arena_lock = threading.Lock()
        self._slot_headers: OrderedDict[tuple[int, int], ChunkHeader] = OrderedDict()
        self._client: object | None = None  # built lazily: Redis may be down at start
        self._client_lock = threading.Lock()
        self._getex = True  # GETEX reads and renews the TTL in one command (Redis >= 6.2)
        self._ttl_ms = int(self.options.ttl_s * 1000) if self.options.ttl_s is not None else None

    @classmethod
    def from_url(cls, url: str, *, namespace_id: str | None = None, keyed: Keyed | None = None,
                 **options: object) -> RedisTier:
        """`redis://[user:pass@]host:port/db`, `rediss://...` (TLS), `redis+cluster://host:port`
        (any node of a cluster), `redis+sentinel://host:port[,host:port]/SERVICE[/DB]`, plus
        any `RedisOptions` field as a keyword."""
        return cls(RedisOptions(url=url, **options), namespace_id=namespace_id, keyed=keyed)  # type: ignore[arg-type]

    # -- keys ---------------------------------------------------------------------------------

    def key(self, header: ChunkHeader) -> str:
        hexhash = header.chunk_hash.ljust(HASH_BYTES, b"\0").hex()
        return f"{self.options.key_prefix}:{header.namespace_id}:{{{hexhash}}}:{header.group}"

    # -- counters -----------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._add(name, n)

    def _count_all(self, counts: dict[str, int]) -> None:
        """`_count` of a whole batch under one lock (one acquisition, not one per chunk)."""
        with self._lock:
            for name, n in counts.items():
                if n:
                    self._add(name, n)

    def _add(self, name: str, n: int) -> None:
        """Under self._lock: a redis counter or a base one (TIER_BASE); anything else raises."""
        if name in self._extra:
            self._extra[name] += n
        elif name in TIER_BASE:
            setattr(self, name, getattr(self, name) + n)
        else:
            raise UndeclaredCounter(f"{name!r} is not a counter of the redis tier; declare it in "
                                    "kvtier/core/counters.py (TIER)")

    def metrics(self) -> dict[str, int | bool]:
        """The base TierStats counters plus the redis ones, and whether the breaker is closed."""
        with self._lock:
            out: dict[str, int | bool] = {k: getattr(self.stats(), k)
                                          for k in self.stats().__slots__}  # type: ignore[attr-defined]
            out.update(self._extra)
        out["up"] = self._breaker.up
        out["connection_failures"] = self._breaker.failures
        return out

    @property
    def up(self) -> bool:
        return self._breaker.up

    # -- the client and the breaker -----------------------------------------------------------

    def _get_client(self) -> object:
        with self._client_lock:
            if self._client is None:
                self._client = build_client(self.options)
            return self._client

    def _run(self, build: Callable[[object], object], skipped: str, n: int) -> list[object] | None:
        """Run one pipeline built by `build(pipe)`; None (and `n` counted as `skipped`) when the
        breaker is open or the connection fails. Per-command errors come back in the list."""
        def execute(client: object) -> list[object]:
            pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
            build(pipe)
            return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

        return self._call(execute, skipped, n)

    def _deadline_s(self, nbytes: int) -> float:
        """A call's deadline: `socket_timeout_s`, plus the time its payload bytes take at
        MIN_RATE_BYTES_S, so a healthy link moving a big batch is never cut off as if hung."""
        return self.options.socket_timeout_s + nbytes / MIN_RATE_BYTES_S

    def _call(self, execute: Callable[[object], list[object]], skipped: str,
              n: int, nbytes: int = 0) -> list[object] | None:
        """`execute(client)` (a pipeline, or a `redis_wire` stream) behind the breaker and within
        one deadline, `socket_timeout_s` from now, for all of its I/O (`call_deadline`): its
        replies, or None (and `n` counted as `skipped`) when the breaker is open or the call
        fails or runs late. A value longer than its chunk (`OversizedValue`) fails the call
        without tripping the breaker: the server is fine, one value is not."""
        if not self._breaker.allow():
            self._count(skipped, n)
            return None
        try:
            with call_deadline(self._deadline_s(nbytes)):
                results = execute(self._get_client())
        except Exception as exc:  # noqa: BLE001 - any failure of a remote cache is a miss
            if isinstance(exc, ConfigError):
                raise
            if is_connection_error(exc) and not isinstance(exc, OversizedValue):
                self._breaker.failure(exc)
                self._drop_client()
            else:
                self._log.warn("error", f"redis tier call failed: {describe_error(exc)}")
                self._count("errors")
            self.last_error = describe_error(exc)
            self._count(skipped, n)
            return None
        conn_errors = [r for r in results if isinstance(r, Exception) and is_connection_error(r)]
        if conn_errors:
            self._breaker.failure(conn_errors[0])
            self._drop_client()
        else:
            self._breaker.success()
        return list(results)

    def _drop_client(self) -> None:
        # After a connection failure the pool's idle connections (and a cluster client's slot
        # map) are stale; the next allowed call builds a fresh client rather than spending one
        # more failed try per stale connection.
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        """Drop the client (a later call builds a new one)."""
        self._drop_client()

    # -- batched operations (what the store uses) ---------------------------------------------

    def exists_many(self, headers: Sequence[ChunkHeader]) -> list[bool]:
        """Which chunks the tier holds, in one pipeline (one round trip per node), without
        reading payloads. Unreachable Redis: all False (counted as skipped reads)."""
        if not headers:
            return []
        names = [self.key(h) for h in headers]
        res = self._run(lambda p: [p.exists(k) for k in names], "skipped_reads", 0)
        if res is None:
            return [False] * len(headers)
        return [isinstance(r, int) and r > 0 for r in res]

    def write_many(self, items: Iterable[tuple[int, int, ChunkHeader, object]]) -> list[bool]:
        """Store each (group, slot, header, data); True when stored. A down or full Redis, or
        an exhausted budget: False, counted in failed_writes, no exception."""
        items = list(items)
        ok = [False] * len(items)
        by_ns: dict[str, list[int]] = {}
        for i, (g, _, h, _) in enumerate(items):
            _check_group(g, h)
            by_ns.setdefault(h.namespace_id, []).append(i)
        for ns, idx in by_ns.items():
            self._write_namespace(ns, [(i, items[i][2], items[i][3]) for i in idx], ok)
        with self._lock:
            for (g, slot, h, _), stored in zip(items, ok):
                if stored and slot >= 0:  # a negative slot means "no slot" (store.SHARED_SLOT)
                    self._slot_headers[(g, slot)] = h
                    self._slot_headers.move_to_end((g, slot))
            while len(self._slot_headers) > SLOT_MEMORY:
                self._slot_headers.popitem(last=False)
        return ok

    def read_many(self, items: Iterable[tuple[int, int, ChunkHeader, object]]) -> list[bool]:
        """Fill each caller buffer `out` (uint8, at least `header.payload_bytes` long) with the
        payload `header` names; True when filled. Absent, evicted since lookup, foreign,
        truncated or failing its checksum: False (counted; a bad payload is deleted), and the
        buffer's bytes are then unspecified and must not be used. A value whose checksum verifies
        and only the MAC is not this reader's (another tenant's secret, or none) is a miss counted
        in `foreign_skipped` and stays in Redis for its writer (the module docstring, "Tenants")."""
        items = list(items)
        for g, _, h, _ in items:
            _check_group(g, h)
        ok = [False] * len(items)
        start = 0
        while start < len(items):  # split so one pipeline's replies stay under pipeline_bytes
            end, size = start, 0
            while end < len(items) and (end == start or size < self.options.pipeline_bytes):
                size += items[end][2].payload_bytes + HEADER_BYTES
                end += 1
            self._read_batch(items, start, end, ok)
            start = end
        return ok

    # -- the single-item Tier contract --------------------------------------------------------

    def write(self, group: int, slot: int, header: ChunkHeader, data: object) -> bool:
        return self.write_many([(group, slot, header, data)])[0]

    def read(self, group: int, slot: int, header: ChunkHeader, out: object) -> bool:
        return self.read_many([(group, slot, header, out)])[0]

    def delete_many(self, headers: Sequence[ChunkHeader]) -> int:
        """Remove these chunks (key-addressed free); how many were there."""
        if not headers:
            return 0
        names = [self.key(h) for h in headers]
        res = self._run(lambda p: [p.delete(k) for k in names], "skipped_saves", 0)
        n = sum(1 for r in res if r == 1) if res is not None else 0
        self._count("deleted", n)
        return n

    def free(self, group: int, slot: int, header: ChunkHeader | None = None) -> None:
        """Remove a chunk. Key-addressed: pass `header` to name any chunk. Without it, for
        callers that think in slots, this removes the chunk this process last wrote with this
        (group, slot), if it still remembers it (the last SLOT_MEMORY writes); else nothing."""
        if header is None:
            with self._lock:
                header = self._slot_headers.pop((group, slot), None)
            if header is None:
                return
        _check_group(group, header)
        self.delete_many([header])

    def list(self) -> Iterator[tuple[int, int, ChunkHeader]]:
        """Every valid header of this tier's namespace (all kvtier namespaces without one): SCAN
        plus GETRANGE of the 128 header bytes, never the payloads. Slot is always 0. Nothing
        when Redis is unreachable."""
        ns = self.namespace_id or "*"
        names = self._scan(f"{self.options.key_prefix}:{ns}:{{*")
        for i in range(0, len(names), 512):
            part = names[i:i + 512]
            res = self._run(lambda p, part=part: [p.getrange(k, 0, HEADER_BYTES - 1) for k in part],
                            "skipped_reads", 0)
            if res is None:
                return
            for raw in res:
                if isinstance(raw, bytes):
                    h = decode_header(raw)
                    if isinstance(h, ChunkHeader) and ns in ("*", h.namespace_id):
                        yield (h.group, 0, h)

    def _scan(self, pattern: str) -> list[bytes]:
        """Every key matching `pattern`: a deadline for each key taken from SCAN's pages, so for
        each page fetched (a whole keyspace may take longer than one call may)."""
        if not self._breaker.allow():
            return []
        names: list[bytes] = []
        try:
            keys = iter(self._get_client().scan_iter(match=pattern, count=1000))  # type: ignore[attr-defined]
            while True:
                with call_deadline(self.options.socket_timeout_s):
                    name = next(keys, None)
                if name is None:
                    break
                names.append(name)
        except Exception as exc:  # noqa: BLE001
            if is_connection_error(exc):
                self._breaker.failure(exc)
                self._drop_client()
            return []
        self._breaker.success()
        return names

    # -- internals ----------------------------------------------------------------------------

    def _check_write(self, header: ChunkHeader, view: memoryview) -> None:
        if len(view) != header.payload_bytes:
            raise ConfigError(f"payload of {len(view)} bytes for a header of "
                              f"{header.payload_bytes}; pass the chunk's exact bytes")
        if self.namespace_id is not None and header.namespace_id != self.namespace_id:
            raise ConfigError(f"header namespace {header.namespace_id} written to a redis tier "
                              f"of namespace {self.namespace_id}; build one tier per namespace")

    def _write_namespace(self, ns: str, items: list[tuple[int, ChunkHeader, object]],
                         ok: list[bool]) -> None:
        views = [u8_view(d) for _, _, d in items]
        for (_, h, _), v in zip(items, views):
            self._check_write(h, v)
        allowed = self._budget_allows(ns, [h.payload_bytes for _, h, _ in items])
        if allowed is None:  # Redis unreachable (counted as skipped saves)
            self._count("failed_writes", len(items))
            return
        self._count("budget_skipped", len(items) - allowed)
        self._count("failed_writes", len(items) - allowed)
        start = 0
        while start < allowed:  # batches of at most pipeline_bytes (at least one item)
            end, size = start, 0
            while end < allowed and (end == start or size < self.options.pipeline_bytes):
                size += HEADER_BYTES + items[end][1].payload_bytes
                end += 1
            part = [(i, self.key(h), h) for i, h, _ in items[start:end]]
            if self.options.is_cluster:  # redis-py's cluster pipeline routes keys to their nodes
                with self._arena_lock:
                    values = self._arena.encode([h for _, _, h in part], views[start:end], self.keyed)
                    self._write_batch(ns, [(i, k, v) for (i, k, _), (_, v) in zip(part, values)], ok)
            else:
                self._stream_batch(ns, part, views[start:end], ok)
            start = end

    def _stream_batch(self, ns: str, part: list[tuple[int, str, ChunkHeader]],
                      views: list[memoryview], ok: list[bool]) -> None:
        """One batch as a zero-copy SET stream, each value sealed just before it is sent
        (`redis_wire`): no arena copy."""
        total = sum(HEADER_BYTES + len(v) for v in views)
        bucket, extra = self._budget.charge(ns, total) if self._budget is not None else (0, [])
        res = self._call(lambda client: set_stream(
            client, [k for _, k, _ in part], [h for _, _, h in part], views, self.keyed,
            self._ttl_ms, extra), "skipped_saves", len(part), total)
        if res is None:
            self._count("failed_writes", len(part))
            return
        if self._budget is not None:
            self._budget.learn_charge(ns, bucket, res[len(part)])
        self._count_writes([(i, HEADER_BYTES + len(v)) for (i, _, _), v in zip(part, views)],
                           res[:len(part)], ok)

    def _write_batch(self, ns: str, batch: list[tuple[int, str, memoryview]],
                     ok: list[bool]) -> None:
        """One batch through a redis-py pipeline (Redis Cluster), values laid out in the arena."""
        ttl = self._ttl_ms
        total = sum(len(v) for _, _, v in batch)
        bucket, extra = self._budget.charge(ns, total) if self._budget is not None else (0, [])

        def build(p: object) -> None:
            for _, k, v in batch:
                p.set(k, v, px=ttl)  # type: ignore[attr-defined]
            for c in extra:
                p.execute_command(*c)  # type: ignore[attr-defined]

        res = self._run(build, "skipped_saves", len(batch))
        if res is None:
            self._count("failed_writes", len(batch))
            return
        if self._budget is not None:
            self._budget.learn_charge(ns, bucket, res[len(batch)])
        self._count_writes([(i, len(v)) for i, _, v in batch], res[:len(batch)], ok)

    def _count_writes(self, sent: list[tuple[int, int]], replies: list[object], ok: list[bool]) -> None:
        """Counters and `ok` from one batch's SET replies; `sent` is (item index, value bytes)."""
        counts = dict.fromkeys(("writes", "bytes_written", "failed_writes", "skipped_saves"), 0)
        for (i, size), r in zip(sent, replies):
            if r is True:
                ok[i] = True
                counts["writes"] += 1
                counts["bytes_written"] += size - HEADER_BYTES
            else:  # e.g. an OOM reply under maxmemory noeviction
                counts["failed_writes"] += 1
                counts["skipped_saves"] += 1
                self.last_error = describe_error(r)
                self._log.warn("save", f"redis tier save failed: {self.last_error}")
        self._count_all(counts)

    def _read_batch(self, items: list[tuple[int, int, ChunkHeader, object]], start: int,
                    end: int, ok: list[bool]) -> None:
        names = [self.key(h) for _, _, h, _ in items[start:end]]
        ttl = self._ttl_ms if self.options.touch else None
        n = end - start
        self._count("reads", n)
        dsts = []
        for _, _, header, out in items[start:end]:
            dst = u8_view(out)
            if len(dst) < header.payload_bytes:  # the caller's mistake: raised before any I/O
                raise ConfigError(f"read buffer of {len(dst)} bytes for a payload of "
                                  f"{header.payload_bytes}; pass a uint8 buffer at least that large")
            dsts.append(dst)
        reasons: list[str | None] = ["not read"] * n

        def verify(j: int, raw: bytes) -> None:
            # verified and copied in one pass; on any reason `dst` is unspecified: a miss
            reasons[j] = restore(items[start + j][2], raw, self.keyed, dsts[j])

        oversized: list[int] = []

        def direct(j: int, reader: ReplyReader, length: int) -> Streamed:
            # straight off the socket into dsts[j], checked as it lands (redis_reader)
            try:
                got = read_value(reader, length, items[start + j][2], dsts[j], self.keyed)
            except OversizedValue:  # not read: the stream stops here, the key is dropped below
                oversized.append(j)
                raise
            reasons[j] = got.why
            return got

        def commands() -> list[tuple[str | int, ...]]:
            if ttl is None:
                return [("GET", k) for k in names]
            if self._getex:
                return [("GETEX", k, "PX", ttl) for k in names]
            return [("GET", k) for k in names] + [("PEXPIRE", k, ttl) for k in names]

        def call() -> list[object] | None:
            if self.options.is_cluster:  # redis-py's cluster pipeline routes keys to their nodes
                got = self._run(lambda p: [p.execute_command(*c) for c in commands()], "skipped_reads", n)
                for j, raw in enumerate(got[:n] if got is not None else []):
                    if isinstance(raw, bytes):
                        verify(j, raw)
                return got
            return self._call(lambda client: get_stream(client, commands(), n, direct, verify), "skipped_reads", n,
                              sum(HEADER_BYTES + it[2].payload_bytes for it in items[start:end]))

        res = call()
        if res is not None and self._getex and ttl is not None and unknown_command(res):
            self._getex = False  # GETEX is Redis >= 6.2 / Valkey; ask once more without it
            log.warning("redis tier: the server has no GETEX; renewing TTLs with PEXPIRE")
            res = call()
        bad = [names[j] for j in oversized]  # longer than its chunk: broken for every reader
        if res is None:
            self._count_all({"misses": n, "corrupt_dropped": len(bad)})
            self._drop(bad)
            return
        res = res[:n]  # the PEXPIRE replies, if any, follow the reads
        counts = dict.fromkeys(("misses", "vanished", "errors", "foreign_skipped", "corrupt_dropped",
                                "bytes_read"), 0)
        for j, raw in enumerate(res):
            header = items[start + j][2]
            if raw is None:
                counts["vanished"] += 1  # never stored, expired, or evicted since lookup
                counts["misses"] += 1
                continue
            if not isinstance(raw, (bytes, Streamed)):  # an error reply for this key
                counts["errors"] += 1
                counts["misses"] += 1
                self.last_error = describe_error(raw)
                self._log.warn("error", f"redis tier read failed: {self.last_error}")
                continue
            reason = reasons[j]
            if reason is None:
                ok[start + j] = True
                counts["bytes_read"] += header.payload_bytes
                continue
            counts["misses"] += 1
            if span_not_held(reason):  # valid for the blocks it holds: kept
                continue
            if mac_only(reason):  # intact, another tenant's or an unkeyed writer's: kept
                counts["foreign_skipped"] += 1
                continue
            counts["corrupt_dropped"] += 1
            self._log.warn("corrupt", f"redis tier dropped a bad payload ({reason})")
            bad.append(names[j])
        self._count_all(counts)
        self._drop(bad)

    def _drop(self, bad: list[str]) -> None:
        """Remove corrupt payloads, so no other process trips on them."""
        if bad:
            res = self._run(lambda p: [p.delete(k) for k in bad], "skipped_saves", 0)
            if res is not None:
                self._count("deleted", sum(1 for r in res if r == 1))

    def _budget_allows(self, ns: str, sizes: list[int]) -> int | None:
        """How many leading items fit the namespace's write budget (all, without a budget);
        None when Redis cannot be asked. The counters are read once per bucket, not before every
        batch: each write's INCRBY reply brings the current bucket's total back (`WriteBudget`)."""
        if self._budget is None:
            return len(sizes)
        used = self._budget.used(ns)
        if used is None:
            names = self._budget.live_keys(ns)
            res = self._run(lambda p: [p.get(k) for k in names], "skipped_saves", len(sizes))
            if res is None:
                return None
            used = self._budget.learn_read(ns, names, res)
            if used is None:
                self.last_error = f"a write budget counter of namespace {ns} is not an integer"
                self._log.warn("budget", f"redis tier: {self.last_error}; skipping saves (delete the "
                                         f"{names[0].rsplit(':', 1)[0]}:* keys to reset it)")
                self._count("errors")
                return 0
        n = self._budget.fits(used, sizes)
        if n < len(sizes):
            self._log.warn("budget", f"redis tier namespace {ns} is at its budget of "
                                     f"{self._budget.budget_bytes} bytes; skipping saves")
        return n


def _check_group(group: int, header: ChunkHeader) -> None:
    if group != header.group:
        raise ConfigError(f"group {group} does not match the header's group {header.group}")
