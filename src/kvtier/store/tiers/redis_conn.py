"""Connection plumbing for the redis tier: client construction, a per-call deadline, a circuit
breaker, quiet logs.

Kept apart from `tiers/redis.py` so the tier reads as its verbs (exists, read, write, free).
redis-py is imported here, lazily, so `import kvtier` never needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
import re
from urllib.parse import parse_qsl, unquote_plus, urlsplit, urlunsplit

from kvtier.errors import ConfigError
from kvtier.store.payload import HEADER_BYTES

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "redis+sentinel",
           "rediss+sentinel", "unix")
BUDGET_BUCKETS = 4  # a ttl window in 4 buckets: a write counts for 1 to 1.25 ttl windows


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """How to reach Redis and what the tier may do there. Every field has a safe default."""

    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False  # or a `redis+cluster://` / `rediss+cluster://` url
    username: str | None = None
    password: str | None = None  # never in logs (see __repr__)
    tls_ca_path: str | None = None  # TLS is on with `rediss://` or any tls_* path
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_verify: bool = True
    ttl_s: float | None = None  # payloads expire this long after their write (or last hit)
    budget_bytes: int | None = None  # per-namespace write budget per ttl window (needs ttl_s)
    touch_on_hit: bool | None = None  # a hit renews the TTL; default: True unless budget_bytes
    socket_timeout_s: float = 1.0  # each call's deadline (a lookup, a batch); late is a miss, not a stall
    connect_timeout_s: float = 0.5
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    pipeline_bytes: int = 64 << 20  # split a batch so one pipeline holds at most this much
    key_prefix: str = "kvtier"
    max_connections: int = 32

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in SCHEMES:
            raise ConfigError(f"redis url {redact(self.url)!r} has scheme {scheme!r}; use one of "
                              f"{', '.join(s + '://' for s in SCHEMES)}")
        if self.cluster and scheme in ("unix", "redis+sentinel", "rediss+sentinel"):
            raise ConfigError(f"cluster=True with a {scheme}:// url; a Redis Cluster is reached "
                              "with redis+cluster://host:port")
        if "+sentinel" in scheme:
            sentinel_parts(self.url)  # raises on a malformed sentinel url
        if self.budget_bytes is not None:
            if self.budget_bytes <= 0:
                raise ConfigError(
                    f"budget_bytes={self.budget_bytes} must be > 0 (or None: no budget)")
            if self.ttl_s is None:
                raise ConfigError(
                    "budget_bytes needs ttl_s (the budget counts bytes written per ttl window); "
                    "set ttl_s, or drop budget_bytes and bound Redis with maxmemory + allkeys-lru"
                )
            if self.touch_on_hit:
                raise ConfigError(
                    "touch_on_hit=True with budget_bytes would let payloads outlive the budget "
                    "window; drop one of them"
                )
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ConfigError(f"ttl_s={self.ttl_s} must be > 0 (or None: no expiry)")
        for name in ("socket_timeout_s", "connect_timeout_s", "backoff_initial_s", "backoff_max_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        if self.pipeline_bytes <= 0 or self.max_connections <= 0:
            raise ConfigError(f"pipeline_bytes={self.pipeline_bytes} and max_connections="
                              f"{self.max_connections} must be > 0")
        if ":" in self.key_prefix or "{" in self.key_prefix or not self.key_prefix:
            raise ConfigError(
                f"key_prefix {self.key_prefix!r} must be non-empty without ':' or '{{'")

    def __repr__(self) -> str:  # options get logged: no password, from the url or the field
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if f.name not in ("url", "password"))
        pw = ", password='***'" if self.password is not None else ""
        return f"RedisOptions(url={redact(self.url)!r}{pw}, {fields})"

    @property
    def is_cluster(self) -> bool:
        return self.cluster or "+cluster" in urlsplit(self.url).scheme

    @property
    def is_sentinel(self) -> bool:
        return "+sentinel" in urlsplit(self.url).scheme

    @property
    def touch(self) -> bool:
        return self.touch_on_hit if self.touch_on_hit is not None else self.budget_bytes is None



def _redis_module():  # noqa: ANN202 - the redis-py module
    try:
        import redis
    except ImportError:
        raise ConfigError("the redis tier needs redis-py: pip install 'kvtier[redis]'") from None
    return redis


def build_client(opts: RedisOptions) -> object:
    """A redis-py `Redis` or `RedisCluster` with timeouts on every call and no retries of its
    own: retrying is the breaker's job (redis-py's default 3 retries with backoff would turn a
    dead server into seconds of stall per call). Cluster clients connect here (they fetch the
    slot map), so this raises when a cluster is down; the caller counts that as a failure."""
    redis = _redis_module()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    parts = urlsplit(opts.url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"redis url scheme {parts.scheme!r} unknown; use one of "
                          f"{', '.join(s + '://' for s in SCHEMES)}")
    tls = parts.scheme.startswith("rediss") or any(
        p is not None for p in (opts.tls_ca_path, opts.tls_cert_path, opts.tls_key_path))
    scheme = "rediss" if tls else ("unix" if parts.scheme == "unix" else "redis")
    url = urlunsplit((scheme, parts.netloc, parts.path, parts.query, parts.fragment))
    kwargs: dict[str, object] = {
        "socket_timeout": opts.socket_timeout_s,
        "socket_connect_timeout": opts.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "max_connections": opts.max_connections,
    }
    if opts.username is not None:
        kwargs["username"] = opts.username
    if opts.password is not None:
        kwargs["password"] = opts.password
    if tls:
        kwargs["ssl_cert_reqs"] = "required" if opts.tls_verify else "none"
        if not opts.tls_verify:
            kwargs["ssl_check_hostname"] = False
        if opts.tls_ca_path is not None:
            kwargs["ssl_ca_certs"] = opts.tls_ca_path
        if opts.tls_cert_path is not None:
            kwargs["ssl_certfile"] = opts.tls_cert_path
        if opts.tls_key_path is not None:
            kwargs["ssl_keyfile"] = opts.tls_key_path
    if opts.is_sentinel:
        return _sentinel_client(opts, kwargs, tls)
    if opts.is_cluster:
        from redis.cluster import RedisCluster
        from redis.connection import Connection, SSLConnection

        if scheme == "unix":
            raise ConfigError("a Redis Cluster is reached over TCP; use redis+cluster://host:port")
        # every node's pool makes deadline connections; a rediss:// url would make redis-py
        # choose its own SSLConnection over this one, so TLS is asked for by the class
        kwargs["connection_class"] = with_deadline(SSLConnection if tls else Connection)
        return RedisCluster.from_url(urlunsplit(("redis",) + tuple(urlsplit(url))[1:]), **kwargs)
    client = redis.Redis.from_url(url, **kwargs)
    pool = client.connection_pool
    pool.connection_class = with_deadline(pool.connection_class)  # no connection made yet
    return client


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, int]:
    """`redis+sentinel://h1:26379,h2:26379/SERVICE[/DB]` -> (sentinels, service, db)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    try:
        pairs = (a.rsplit(":", 1) for a in netloc.split(","))
        sentinels = [(h.strip("[]"), int(p)) for h, p in pairs]
    except ValueError:
        sentinels = []
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ConfigError(f"sentinel url {redact(url)!r} must look like "
                          "redis+sentinel://host:port[,host:port...]/SERVICE[/DB]")
    return sentinels, path[0], int(path[1]) if len(path) == 2 else 0


def _sentinel_client(opts: RedisOptions, kwargs: dict[str, object], tls: bool) -> object:
    """A client of the master Sentinel names for the service. The master is looked up when a
    connection is made; after a failover the tier's breaker drops the client and the next one
    asks the sentinels again. Username/password/TLS apply to the data nodes; the sentinels are
    asked with the timeouts only (their own AUTH is a separate setting, not supported here)."""
    from redis.sentinel import Sentinel

    sentinels, service, db = sentinel_parts(opts.url)
    manager = Sentinel(sentinels, sentinel_kwargs={
        "socket_timeout": opts.socket_timeout_s,
        "socket_connect_timeout": opts.connect_timeout_s,
    })
    for sentinel in manager.sentinels:  # asked for the master inside a call: same deadline
        sentinel.connection_pool.connection_class = with_deadline(sentinel.connection_pool.connection_class)
    if tls:
        kwargs["ssl"] = True
    client = manager.master_for(service, db=db, **kwargs)
    pool = client.connection_pool
    pool.connection_class = with_deadline(pool.connection_class)
    return client


class _CallDeadline(threading.local):
    at: float | None = None  # time.monotonic() by which the thread's current call must end


_CALL = _CallDeadline()


class call_deadline:  # noqa: N801 - used as a `with` statement, like a function
    """`with call_deadline(s):` every socket operation of this thread's redis call, redis-py's
    included (connection handshake, pipeline, stream), ends by one deadline `s` from now
    (`DeadlineSocket`): a socket timeout holds per receive, and a server that drips a byte within
    each would hold a call for as long as it likes. Nested, the earlier deadline holds."""

    __slots__ = ("_seconds", "_outer")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._outer: float | None = None

    def __enter__(self) -> None:
        self._outer = _CALL.at
        at = time.monotonic() + self._seconds
        _CALL.at = at if self._outer is None else min(at, self._outer)

    def __exit__(self, *exc: object) -> None:
        _CALL.at = self._outer


REARM_S = 0.01  # a receive or send may outlast its call's deadline by at most this


class DeadlineSocket:
    """A connection's socket whose every receive and send ends by the calling thread's
    `call_deadline`: its timeout is the time left, set again when the call changes or REARM_S
    after it was last set (a settimeout is a system call; a load makes hundreds of receives a
    call), and past the deadline it raises TimeoutError without touching the socket. Outside a
    call, and for redis-py's non-blocking polls (timeout 0), it is the socket with redis-py's own
    timeout. Everything else passes through to `raw`. No watchdog thread: that is a thread
    hand-off a call, and a shut socket reads as the server closing."""

    __slots__ = ("raw", "_timeout", "_armed_for", "_rearm_at")

    def __init__(self, raw: socket.socket) -> None:
        self.raw = raw
        self._timeout = raw.gettimeout()  # redis-py's: what the socket has outside a call
        self._armed_for: float | None = None  # the deadline the raw socket's timeout was set for
        self._rearm_at = 0.0  # when that timeout is REARM_S stale

    def settimeout(self, timeout: float | None) -> None:
        self._timeout, self._armed_for = timeout, None
        self.raw.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self) -> None:
        at = _CALL.at
        if at is None or self._timeout == 0:
            if self._armed_for is not None:
                self._armed_for = None
                self.raw.settimeout(self._timeout)
            return
        now = time.monotonic()
        if now >= at:
            raise TimeoutError("the redis call ran past its deadline (socket_timeout_s after it "
                               "began): the server is slow or stalled")
        left = at - now
        self.raw.settimeout(left if self._timeout is None else min(left, self._timeout))
        self._armed_for, self._rearm_at = at, now + REARM_S

    def _armed(self) -> socket.socket:
        """The raw socket, its timeout armed for this thread's call: `_arm` only when the call
        changed or REARM_S passed (a load makes ~200 receives a batch: the common case is a
        thread-local read, a monotonic() and three compares; outside a call, no monotonic())."""
        if _CALL.at != self._armed_for or (self._armed_for is not None and time.monotonic() > self._rearm_at):
            self._arm()
        return self.raw

    def recv(self, *args: int) -> bytes:
        return self._armed().recv(*args)

    def recv_into(self, *args: object) -> int:
        return self._armed().recv_into(*args)  # type: ignore[arg-type]

    def send(self, *args: object) -> int:
        return self._armed().send(*args)  # type: ignore[arg-type]

    def sendall(self, *args: object) -> None:
        self._armed().sendall(*args)  # type: ignore[arg-type]  # its timeout bounds the whole sendall

    def sendmsg(self, *args: object) -> int:
        return self._armed().sendmsg(*args)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self.raw, name)


class _DeadlineConnection:
    """Mixed into a redis-py connection class: its socket is a DeadlineSocket from the moment it
    is connected, so the handshake (HELLO, AUTH, SELECT) is inside the call's deadline too.
    Connecting itself (TCP, and TLS's handshake inside redis-py's `_connect`) keeps
    connect_timeout_s per step."""

    def _connect(self) -> DeadlineSocket:
        return DeadlineSocket(super()._connect())  # type: ignore[misc]


_WITH_DEADLINE: dict[type, type] = {}


def with_deadline(cls: type) -> type:
    """`cls` (a redis-py connection class: plain, TLS, Unix, Sentinel-managed) whose sockets keep
    the calling thread's `call_deadline`."""
    if issubclass(cls, _DeadlineConnection):
        return cls
    sub = _WITH_DEADLINE.get(cls)
    if sub is None:
        sub = _WITH_DEADLINE[cls] = type(f"Deadline{cls.__name__}", (_DeadlineConnection, cls), {})
    return sub


def is_connection_error(exc: BaseException) -> bool:
    """A failure of the server or the network (trips the breaker), as opposed to a refused
    command (an OOM reply under maxmemory noeviction) which only fails that command."""
    try:
        from redis import exceptions as rex
    except ImportError:  # pragma: no cover
        return isinstance(exc, OSError)
    kinds: tuple[type[BaseException], ...] = (
        rex.ConnectionError, rex.TimeoutError, rex.ClusterDownError, rex.RedisClusterException,
        rex.SlotNotCoveredError, rex.ClusterError, OSError, socket.timeout,
    )
    return isinstance(exc, kinds)


def describe_error(exc: object) -> str:
    """`Type: message` for logs and `last_error` (redis-py 8's repr drops the message: it
    prints `network:ConnectionError`)."""
    if not isinstance(exc, BaseException):
        return f"unexpected reply {exc!r}"[:200]
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Breaker:
    """Skip calls after a connection failure until a backoff deadline; then let calls through.

    Backoff doubles from `initial_s` to `max_s` while tries keep failing and resets on the
    first success. One warning when the tier goes down, one info line when it is back: a dead
    Redis costs a counted miss per call, never a log flood or a stall longer than a timeout.
    """

    def __init__(self, log: logging.Logger, initial_s: float, max_s: float,
                 clock: Callable[[], float], describe: str) -> None:
        self._log = log
        self._initial_s = initial_s
        self._max_s = max_s
        self._clock = clock
        self._describe = describe
        self._lock = threading.Lock()
        self.up = True
        self.failures = 0  # total connection failures seen
        self._streak = 0  # consecutive failures since the last success
        self._backoff_s = initial_s
        self._open_until = 0.0

    def allow(self) -> bool:
        with self._lock:
            return self.up or self._clock() >= self._open_until

    def failure(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self._streak += 1
            if self.up:
                self.up = False
                self._backoff_s = self._initial_s
                self._log.warning(
                    "redis tier %s unreachable (%s); saves skipped and lookups miss, "
                    "retrying with backoff up to %.0fs", self._describe, describe_error(exc),
                    self._max_s)
            else:
                self._backoff_s = min(self._backoff_s * 2, self._max_s)
            self._open_until = self._clock() + self._backoff_s

    def success(self) -> None:
        with self._lock:
            if not self.up:
                self._log.warning("redis tier %s is back after %d failed tries",
                                  self._describe, self._streak)
            self.up = True
            self._streak = 0
            self._backoff_s = self._initial_s

    @property
    def retry_in_s(self) -> float:
        with self._lock:
            return 0.0 if self.up else max(0.0, self._open_until - self._clock())


# LogOnce lives in tiers/base.py (the disk and Redis tiers log alike); re-exported here for the
# callers that import it from this module
from kvtier.store.tiers.base import LogOnce  # noqa: E402,F401


# A query parameter whose (decoded) name says it carries a credential: redis-py hands every
# query parameter to its connection as a keyword, so `?password=` and `?ssl_password=` are
# passwords there, taking precedence over the userinfo's. Matched loosely (any name with one of
# these in it), because hiding a harmless value costs nothing and showing a secret is the bug.
_SECRET_NAME = re.compile(r"pass|pwd|secret|token|auth|cred", re.IGNORECASE)


def url_credentials(url: str) -> list[str]:
    """The credential-bearing parts of a Redis URL, by name (`"userinfo password"`, `"?password"`),
    without their values: what `redact` hides and what a logged config must not hold."""
    found = []
    netloc = url.split("://", 1)[-1].split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    userinfo, at, _ = netloc.rpartition("@")
    if at and ":" in userinfo:
        found.append("userinfo password")
    try:
        query = urlsplit(url).query
    except ValueError:
        query = url.split("?", 1)[1] if "?" in url else ""
    found += [f"?{name}" for name, _ in parse_qsl(query, keep_blank_values=True)
              if _SECRET_NAME.search(name)]
    return found


def redact(url: str) -> str:
    """The url for log lines and messages: the userinfo's password, every credential-bearing query
    value (`?password=`, `?ssl_password=`; see `url_credentials`) and the fragment as `***`.
    String surgery, so a sentinel url's `h1:p1,h2:p2` host list survives; a string that is no
    URL keeps nothing before an `@`, and one that does not parse shows its scheme only."""
    if "://" not in url:
        return "***@" + url.rpartition("@")[2] if "@" in url else url
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket: show nothing that could be a secret
        return url.split("://", 1)[0] + "://***"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}" if at and ":" in userinfo else parts.netloc
    query = "&".join(_redact_pair(pair) for pair in parts.query.split("&")) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, "***" if parts.fragment else ""))


def _redact_pair(pair: str) -> str:
    name, eq, _ = pair.partition("=")
    return f"{name}=***" if _SECRET_NAME.search(unquote_plus(name)) else pair


class WriteBudget:
    """A per-namespace write budget kept in Redis itself, shared by every process.

    Writes add their bytes to a counter per time bucket (a quarter of `ttl_s`, at least 1 s):
    `kvtier:<ns>:budget:<bucket>`. A payload written in bucket b expires by the end of bucket
    b + BUCKETS, so the buckets c - BUCKETS .. c bound the namespace's live bytes at bucket c.
    Bucket keys expire by themselves once they can no longer matter.

    Read once, then known: the buckets before the current one are closed (nobody's clock writes
    them any more, up to the skew between hosts), so their sum is read once per bucket; the
    current bucket's total comes back with every write (the INCRBY reply counts every process's
    bytes). `used` answers from what it knows while that is younger than `refresh_s` or a write's
    reply renewed it, so a process that saves steadily reads the counters once per bucket instead
    of once before every batch (a round trip each). What it cannot see is the bytes other
    processes wrote since its own last write or read, at most `refresh_s` ago: a save may
    overshoot the budget by those. The budget was approximate under concurrency before too (two
    writers that check at once overshoot by one batch each); this widens the window from one
    round trip to at most `refresh_s`.
    """

    refresh_s = 1.0

    def __init__(self, opts: RedisOptions, wall_clock: Callable[[], float],
                 clock: Callable[[], float] | None = None) -> None:
        assert opts.budget_bytes is not None and opts.ttl_s is not None
        self.budget_bytes = opts.budget_bytes
        self._prefix = opts.key_prefix
        ttl_ms = int(opts.ttl_s * 1000)
        self._width_ms = max(1000, -(-ttl_ms // BUDGET_BUCKETS))  # ceil: BUCKETS widths >= ttl
        self._wall = wall_clock
        self._clock = clock or time.monotonic
        # ns -> (bucket, sum of the closed buckets, current bucket's total, when it was learnt)
        self._known: dict[str, tuple[int, int, int, float]] = {}
        self.reads = 0  # counter reads (round trips); the tests count them

    def _bucket(self) -> int:
        return int(self._wall() * 1000) // self._width_ms

    def _key(self, ns: str, bucket: int) -> str:
        return f"{self._prefix}:{ns}:budget:{bucket}"

    def live_keys(self, ns: str) -> list[str]:
        c = self._bucket()
        return [self._key(ns, b) for b in range(c - BUDGET_BUCKETS, c + 1)]

    def used(self, ns: str) -> int | None:
        """The namespace's live bytes as last known, or None when they must be read again (a new
        bucket, or nothing learnt for `refresh_s`)."""
        k = self._known.get(ns)
        if k is None or k[0] != self._bucket() or self._clock() - k[3] > self.refresh_s:
            return None
        return k[1] + k[2]

    def learn_read(self, ns: str, keys: list[str], counters: list[object]) -> int | None:
        """Record the values read for `live_keys` (None for an absent key); their sum, or None
        when a counter is not an integer (someone else wrote that key)."""
        self.reads += 1
        try:
            values = [int(v) if isinstance(v, (bytes, str, int)) else 0 for v in counters]
        except ValueError:
            self._known.pop(ns, None)
            return None
        bucket = int(keys[-1].rsplit(":", 1)[1])
        self._known[ns] = (bucket, sum(values[:-1]), values[-1], self._clock())
        return sum(values)

    def learn_charge(self, ns: str, bucket: int, total: object) -> None:
        """Record the current bucket's total a write's INCRBY answered."""
        k = self._known.get(ns)
        if k is not None and k[0] == bucket and isinstance(total, int):
            self._known[ns] = (bucket, k[1], total, self._clock())

    def fits(self, used: int, sizes: list[int]) -> int:
        """How many leading payloads of `sizes` fit on top of `used` live bytes."""
        n = 0
        for size in sizes:
            used += size + HEADER_BYTES  # the header travels with every payload
            if used > self.budget_bytes:
                break
            n += 1
        return n

    def charge(self, ns: str, total_bytes: int) -> tuple[int, list[tuple[str | int, ...]]]:
        """The bucket and the commands that add a batch's bytes to it (sent with the batch; the
        INCRBY's reply is the bucket's new total, for `learn_charge`)."""
        bucket = self._bucket()
        key = self._key(ns, bucket)
        return bucket, [("INCRBY", key, total_bytes),
                        ("PEXPIRE", key, self._width_ms * (BUDGET_BUCKETS + 2))]


def options_from_mapping(values: Mapping[str, object], where: str = "redis option") -> RedisOptions:
    """`RedisOptions` from string-keyed settings (a config file, an engine's extra config):
    field names as keys, numbers and booleans also accepted as strings ("30", "true").
    An unknown key or an unreadable value is a ConfigError naming it and the valid keys."""
    fields = {f.name: f for f in dataclasses.fields(RedisOptions)}
    out: dict[str, object] = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown {where} {key!r}; valid: {', '.join(fields)}")
        kind = str(fields[key].type)
        try:
            if value is None or isinstance(value, bool):
                out[key] = value
            elif "bool" in kind:
                text = str(value).strip().lower()
                if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                out[key] = text in ("1", "true", "yes", "on")
            elif "float" in kind:
                out[key] = float(value)  # type: ignore[arg-type]
            elif "int" in kind:
                out[key] = int(str(value))
            else:
                out[key] = str(value)
        except ValueError:
            kind = kind.replace(" | None", "")
            raise ConfigError(f"{where} {key}={value!r} is not a {kind}") from None
    return RedisOptions(**out)  # type: ignore[arg-type]
