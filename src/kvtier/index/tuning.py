"""Eviction by worth, tuned online: the one rule of replay, the Store and the vLLM manager.

`worth_index(...)` builds an Index whose pools evict by worth (`kvtier.index.worth.WorthLRU`)
and, unless w is given, a `WorthTuner` that sets w from recent traffic. `default_policy(...)` is
what policy "auto" means everywhere: worth where placement "hits" places a group that is not an
anchor (only there do entries of one pool differ in the compute they save), LRU elsewhere.

The tuner keeps a window of the most recent requests (chunk hashes in prefix order, at most
`max_chunks` chunks in all). From the first eviction in the first tier on, every `period` chunks
requested it replays the window, its hashes renumbered as integers, in a *shadow* for each weight
of `grid`: a fresh index of the same capacities, share, first split, anchoring and placement
rule with that w fixed (`shadow_flops`, the loop of `kvtier.replay.run.replay` for one policy and
no admission; index/ may not import replay/, a test checks the two agree). It adopts the weight
whose shadows saved the most prefill FLOPs, summed over the tunings with older ones fading by
`FADE` (one window is noisy); a tie keeps the smaller weight, so where worth does not pay w stays
0, which is LRU. It learns from the past only.

Where the shadows run (`runner`): "inline" scores in `observe` (replay, tests); "process" (the
product's) in a child process `python -m kvtier.index.tuning`, started at the first tuning.
Not multiprocessing: vLLM's engine core may run in a daemonic multiprocessing process, which may
have no multiprocessing children. One daemon thread of the tuner writes the job and reads the
answer, length-prefixed pickles over the child's pipes (both ends are this module: no foreign
data is unpickled), so `observe` only hands a job over; a tuning due while one is in flight is
skipped and counted, and a finished one is adopted at the next `observe` or `poll`. A child that
dies, answers garbage or takes longer than `timeout_s` is a counted failure: w is kept and the
next tuning starts a new child. The child lowers its own CPU priority: serving comes first.

Memory (`memory_bytes`, bounded by `max_memory_bytes`): `hash_bytes` per chunk held (the Store's
and vLLM's hashes are bytes of up to 32) + 64 bytes per request record (at most `max_chunks`: a
request has at least one chunk; empty ones are not kept) + w and one fading score per candidate.
A tuning adds, while it runs, the window as integer ids (8 bytes a chunk) and, in the child, the
shadow indexes of one window; the last `KEPT_TUNINGS` adopted weights are kept in `tunings`.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import queue
import signal
import site
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from kvtier.core.cost import ComputeModel, compute_model
from kvtier.core.plan import Plan
from kvtier.errors import ConfigError
from kvtier.index.index import Index
from kvtier.index.placement import HitsLand, learned_start
from kvtier.index.policies import policy_options
from kvtier.index.worth import WorthLRU, WorthWeight, worth_value

log = logging.getLogger("kvtier.index.tuning")

GRID = (0.0, 1.0, 2.0, 4.0)
FADE = 0.5  # each tuning, the candidates' past scores count half
REQUEST_BYTES = 64  # a request record: token counts, the tuple header
KEPT_TUNINGS = 64  # adopted weights kept in `tunings` (the count is in `counts()`)
RUNNERS = ("inline", "process")
ANCHORS = ("full", "mla")
_LEARNED = object()  # worth_index's default start: `learned_start`, as the Store and replay start
_MAX_MESSAGE = 1 << 31  # a length prefix above this is garbage, not a job or an answer

Req = tuple[tuple[int, ...], int, int]  # a window request: chunk ids, prompt tokens, input tokens


def default_policy(plan: Plan, placement: object) -> str:
    """Policy "auto": "worth" under placement "hits" (the name or a HitsLand) on a plan with a
    cacheable group that is not an anchor; "lru" elsewhere (one group, or every chunk warm)."""
    hits = isinstance(placement, HitsLand) or (isinstance(placement, str) and placement == "hits")
    placed = any(gp.kind not in ANCHORS for gp in plan.cacheable_groups)
    return "worth" if hits and placed else "lru"


def worth_options(name: str) -> dict[str, float | int]:
    """`worth` or `worth:w=4,max_chunks=N,period=N` -> options (w fixes the weight: no tuning)."""
    return policy_options(name, "worth", ("w", "max_chunks", "period"), "w",
                          "worth takes w=W (fixed, no tuning), max_chunks=N, period=N")


@dataclass(frozen=True, slots=True)
class Shadow:
    """What a shadow replay needs besides the window and w (it travels to the child with each
    job, so it pickles): the placement as HitsLand's parameters (None: every chunk warm)."""

    plan: Plan
    capacities: Mapping[str, int]
    share: str | Mapping[str, float]
    start: str | Mapping[str, float] | None
    placement: tuple[int, float, int, int] | None  # HitsLand's tree_nodes, ratio, warmup, decay
    tail_endpoints: int | None
    compute: ComputeModel
    anchored: bool = True


@dataclass(frozen=True, slots=True)
class Job:
    """One tuning: the window scored under every weight of the grid."""

    shadow: Shadow
    grid: tuple[float, ...]
    window: tuple[Req, ...]

    def scores(self) -> list[float]:
        return [shadow_flops(self.shadow, self.window, w) for w in self.grid]


def _build(plan: Plan, capacities: Mapping[str, int], share: str | Mapping[str, float],
           start: str | Mapping[str, float] | None, anchored: bool, placement: object,
           weight: WorthWeight, compute: ComputeModel) -> Index:
    """An Index whose pools evict by worth with `weight`; depth from the placement's prefix tree."""
    index = Index(plan, capacities, policy=lambda slots: WorthLRU(slots, weight), share=share,
                  start=start, anchored=anchored)
    tree = getattr(placement, "tree", None)
    depth = tree.depth if tree is not None else (lambda key: 0)
    for gp in plan.cacheable_groups:
        value = worth_value(gp.kind, compute.flops, plan.chunk_tokens, depth)
        for tier in capacities:
            index.policy_of(gp.index, tier).value = value  # type: ignore[attr-defined]
    return index


def worth_index(plan: Plan, capacities: Mapping[str, int], *, share: str | Mapping[str, float],
                placement: object, cost: object | None = None, tail_endpoints: int | None = None,
                w: float | None = None, runner: str = "process", max_chunks: int = 32768,
                period: int = 32768, start: object = _LEARNED, anchored: bool = True,
                grid: Sequence[float] = GRID) -> tuple[Index, WorthTuner | None]:
    """An Index whose pools evict by worth and its tuner (None when `w` fixes the weight).
    `cost`: a ComputeModel, or replay's CostModel (its `.model`); default: the plan geometry's
    estimate. `start`: the learned share's first split (default `learned_start`, as the Store and
    replay start); the shadows use the same one, and a fresh placement of the same rule."""
    compute = _compute(plan, cost)
    if start is _LEARNED:
        start = learned_start(plan, share, placement, capacities)
    weight = WorthWeight(0.0 if w is None else w)
    index = _build(plan, capacities, share, start, anchored, placement, weight, compute)  # type: ignore[arg-type]
    if w is not None:
        return index, None
    if placement is None:
        rule = None
    elif isinstance(placement, HitsLand):
        rule = (placement.tree.max_nodes, placement.ratio, placement.warmup, placement.decay)
    else:
        raise ConfigError(f"policy 'worth': tuning w needs placement 'hits' or 'every', not "
                          f"{getattr(placement, 'name', placement)!r}; give a fixed weight (worth:w=W)")
    shadow = Shadow(plan, dict(capacities), share if isinstance(share, str) else dict(share),
                    start if start is None or isinstance(start, str) else dict(start),  # type: ignore[arg-type]
                    rule, tail_endpoints, compute, anchored)
    return index, WorthTuner(shadow, weight, runner=runner, max_chunks=max_chunks, period=period, grid=grid)


def _compute(plan: Plan, cost: object | None) -> ComputeModel:
    if cost is None:
        return compute_model(None, plan.geometry)
    model = getattr(cost, "model", cost)
    if not isinstance(model, ComputeModel):
        raise ConfigError(f"cost={cost!r}: give a kvtier.core.cost.ComputeModel (or replay's CostModel)")
    return model


def tail_chunks(plan: Plan, group: int, num_chunks: int, endpoints: int) -> list[int]:
    """What a non-anchor group must hold so hits can end at the prompt's last `endpoints` chunk
    boundaries: the union of `plan.chunks_for_hit` over T = j*C, j = n-endpoints+1 .. n.

    Why: a sliding window or a state checkpoint serves only hits that end near it, and follow-up
    requests (the next turn of a chat) hit at the end of an earlier prompt, so a sliding group's
    early chunks and a state group's early checkpoints are bytes few hits read. With
    endpoints=2 a Mooncake next turn (which repeats all but the last, partial block) still hits.
    Replay stores these warm; the group's other chunks are stored *cold* (evicted before
    any warm entry, never refreshed by a save), so they cost nothing while there is room and
    still serve a prompt that branches in the middle of a cached one.
    """
    if endpoints <= 0:
        raise ConfigError(f"tail endpoints {endpoints} must be a positive number of chunk boundaries")
    c = plan.chunk_tokens
    out: set[int] = set()
    for j in range(max(1, num_chunks - endpoints + 1), num_chunks + 1):
        out.update(plan.chunks_for_hit(group, j * c))
    return sorted(out)


def shadow_flops(shadow: Shadow, window: Sequence[Req], w: float) -> float:
    """Prefill FLOPs the window's hits save in a fresh index with w fixed: `replay`'s loop
    (lookup, promotion, write-through save by placement, learned share) without its accounting."""
    plan, caps = shadow.plan, dict(shadow.capacities)
    rule = shadow.placement
    placement = None if rule is None else HitsLand(plan, tree_nodes=rule[0], ratio=rule[1],
                                                     warmup=rule[2], decay=rule[3])
    index = _build(plan, caps, shadow.share, shadow.start, shadow.anchored, placement,
                   WorthWeight(w), shadow.compute)
    tiers = list(caps)
    first, c = tiers[0], plan.chunk_tokens
    order = sorted(plan.cacheable_groups, key=lambda gp: gp.kind not in ANCHORS)  # anchors first
    cache: dict[int, list[tuple[int, set[int] | None, set[int] | None]]] = {}

    def wanted(n: int) -> list[tuple[int, set[int] | None, set[int] | None]]:
        got = cache.get(n)
        if got is None:
            got = []
            for gp in order:
                idx = plan.store_chunks(gp.index, n * c)
                warm = None
                if shadow.tail_endpoints and gp.kind not in ANCHORS:
                    warm = set(tail_chunks(plan, gp.index, n, shadow.tail_endpoints))
                got.append((gp.index, None if idx == list(range(n)) else set(idx), warm))
            cache[n] = got
        return got

    def save(h: int, g: int, cold: bool = False) -> None:
        if not cold:
            for tier in tiers:  # write-through
                index.put(h, g, tier)
        elif len(tiers) > 1:  # cold: the tiers after the first
            for tier in tiers[1:]:
                index.put(h, g, tier)
        else:  # one tier: into it as a first victim
            index.put(h, g, first, cold=True)

    flops_of: dict[int, float] = {}
    saved = 0.0
    contains, touch_all = index.contains, index.touch_all
    learned = bool(index.learners)
    for chunks, prompt_tokens, input_tokens in window:
        hit = index.lookup(chunks, prompt_tokens)
        if hit.tokens:
            tok = min(hit.tokens, input_tokens)
            f = flops_of.get(tok)
            if f is None:
                f = flops_of[tok] = shadow.compute.flops(tok)
            saved += f
            for g, loads in enumerate(hit.chunks):
                for ld in loads:
                    if ld.tier != first and not contains(ld.chunk_hash, g, first):
                        index.put(ld.chunk_hash, g, first)  # promotion
        n = len(chunks)
        spots = placement.place(chunks, n) if placement is not None else None
        if n:
            for g, idx, warm in wanted(n):
                if spots is not None and g in spots:
                    warm_g, cold_g = spots[g]
                    for i in range(n):
                        if idx is not None and i not in idx:
                            continue
                        if warm_g is None or i in warm_g:
                            if not touch_all(chunks[i], g):
                                save(chunks[i], g)
                        elif i in cold_g and not contains(chunks[i], g):
                            save(chunks[i], g, True)
                    continue
                for i in range(n):
                    if idx is not None and i not in idx:
                        continue
                    if warm is not None and i not in warm:
                        if not contains(chunks[i], g):
                            save(chunks[i], g, True)
                    elif not touch_all(chunks[i], g):
                        save(chunks[i], g)
        if learned:
            index.observe()
    return saved


class WorthTuner:
    """Window of recent requests + periodic shadow replays over `grid` (module docstring)."""

    def __init__(self, shadow: Shadow | None, weight: WorthWeight | None = None, *, runner: str = "inline",
                 max_chunks: int = 32768, period: int = 32768, grid: Sequence[float] = GRID,
                 hash_bytes: int = 32, timeout_s: float = 600.0) -> None:
        if max_chunks <= 0 or period <= 0 or not grid or any(g < 0 for g in grid):
            raise ConfigError(f"worth tuner: max_chunks={max_chunks} and period={period} must be "
                              f"positive, grid={tuple(grid)} non-empty and >= 0")
        if runner not in RUNNERS:
            raise ConfigError(f"worth tuner: runner={runner!r} is unknown; use one of {', '.join(RUNNERS)}")
        if runner == "process" and shadow is None:
            raise ConfigError("worth tuner: runner='process' needs a Shadow to send (worth_index builds one)")
        self.shadow = shadow
        self.weight = weight if weight is not None else WorthWeight()
        self.runner = runner
        self.max_chunks, self.period, self.grid = max_chunks, period, tuple(sorted(grid))
        self.hash_bytes = hash_bytes
        self.window: deque[tuple[tuple[Hashable, ...], int, int]] = deque()
        self.chunks = 0  # chunks in the window
        self.since = 0  # chunks requested since the last tuning (or the first eviction)
        self.started = False
        self.tunings: list[float] = []  # the weight adopted at each tuning (the last KEPT_TUNINGS)
        self.totals = [0.0] * len(self.grid)  # each candidate's fading sum of window scores
        self._counts = dict.fromkeys(("worth_tunings", "worth_tunings_skipped", "worth_tunings_failed"), 0)
        self._child: _Child | None = None
        if runner == "process":
            self._child = _Child(timeout_s)
            self._finalizer = weakref.finalize(self, self._child.close)

    def observe(self, chunk_hashes: Sequence[Hashable], prompt_tokens: int, input_tokens: int,
                evicted: bool) -> None:
        """After each request: remember it; tune when a period of chunks has gone by since the
        first eviction (`evicted`: the first tier has evicted something)."""
        self.poll()
        chunks = tuple(chunk_hashes)
        self._add(chunks, prompt_tokens, input_tokens)
        if not self.started:
            self.started = bool(evicted)
            return
        self.since += len(chunks)
        if self.since >= self.period:
            self.since = 0
            self.tune()

    def _add(self, chunks: tuple[Hashable, ...], prompt_tokens: int, input_tokens: int) -> None:
        """Remember one request (the oldest leave while the window holds too many chunks)."""
        n = len(chunks)
        if n == 0 or n > self.max_chunks:
            return
        self.window.append((chunks, prompt_tokens, input_tokens))
        self.chunks += n
        while self.chunks > self.max_chunks:
            self.chunks -= len(self.window.popleft()[0])

    def tune(self) -> None:
        """Score the window under every weight: inline, now; in the child, handed over (skipped
        and counted while one is in flight)."""
        if self._child is not None:
            if self._child.busy or not self._child.submit(Job(self.shadow, self.grid, self._ids())):  # type: ignore[arg-type]
                self._counts["worth_tunings_skipped"] += 1
            return
        self._adopt(self._scores(self._ids()))

    def _ids(self) -> tuple[Req, ...]:
        """The window with its hashes renumbered 0, 1, ... (a dict built for this tuning only)."""
        ids: dict[Hashable, int] = {}
        return tuple((tuple(ids.setdefault(h, len(ids)) for h in chunks), p, i) for chunks, p, i in self.window)

    def _scores(self, window: tuple[Req, ...]) -> list[float]:
        assert self.shadow is not None, "a tuner without a shadow scores with its own _scores"
        return Job(self.shadow, self.grid, window).scores()

    def _adopt(self, scores: Sequence[float]) -> None:
        self.totals = [FADE * t + s for t, s in zip(self.totals, scores)]
        best = max(range(len(self.grid)), key=lambda i: (self.totals[i], -i))
        self.weight.w = self.grid[best]
        self.tunings.append(self.weight.w)
        del self.tunings[:-KEPT_TUNINGS]
        self._counts["worth_tunings"] += 1

    def poll(self) -> None:
        """Adopt a tuning the child finished (a failed one is counted; w is kept)."""
        if self._child is None:
            return
        done = self._child.take()
        if done is None:
            return
        ok, scores = done
        if ok:
            self._adopt(scores)
        else:
            self._counts["worth_tunings_failed"] += 1

    @property
    def busy(self) -> bool:
        """A tuning is in flight in the child."""
        return self._child is not None and self._child.busy

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs (None inline or before the first tuning)."""
        return self._child.pid if self._child is not None else None

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def close(self) -> None:
        """Stop the child (an unfinished tuning is dropped). Idempotent."""
        if self._child is not None:
            self._child.close()

    @property
    def memory_bytes(self) -> int:
        return self.hash_bytes * self.chunks + REQUEST_BYTES * len(self.window) + 8 * (1 + len(self.grid))

    @staticmethod
    def max_memory_bytes(max_chunks: int, hash_bytes: int = 32, candidates: int = len(GRID)) -> int:
        return (hash_bytes + REQUEST_BYTES) * max_chunks + 8 * (1 + candidates)


class _Child:
    """The process runner: one child process, fed by one daemon thread (module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._since: float | None = None  # when the job in flight was handed over
        self._done: tuple[bool, list[float]] | None = None
        self._closed = False

    @property
    def busy(self) -> bool:
        return self._since is not None

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def submit(self, job: Job) -> bool:
        with self._lock:
            if self._since is not None or self._closed:
                return False
            self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvtier-worth-tuner", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        return True

    def take(self) -> tuple[bool, list[float]] | None:
        """The finished job's (ok, scores), once; kills a child past its time (read as a failure)."""
        with self._lock:
            done, self._done = self._done, None
            now = time.monotonic()
            late = done is None and self._since is not None and now - self._since > self.timeout_s
            proc = self._proc if late else None
            if late:
                self._since = now  # killed once; the thread reads the end of its pipe
        if proc is not None:
            log.warning("worth tuner: the shadow process took over %gs; stopped", self.timeout_s)
            proc.kill()
        return done

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            done = self._run(job)
            with self._lock:
                self._done, self._since = done, None

    def _run(self, job: Job) -> tuple[bool, list[float]]:
        try:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            _send(proc.stdin, pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
            reply = _recv(proc.stdout)
            if reply is None:
                raise EOFError(f"the shadow process exited ({proc.poll()})")
            if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "error":
                raise RuntimeError(f"the shadow failed: {reply[1]}")
            if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "ok"
                    and isinstance(reply[1], list) and len(reply[1]) == len(job.grid)
                    and all(isinstance(s, float) and math.isfinite(s) for s in reply[1])):
                raise ValueError(f"the shadow process answered {type(reply).__name__}, not scores")
            return True, reply[1]
        except Exception as exc:  # any failure of the child or its pipes: a failed tuning, w kept
            log.warning("worth tuner: tuning failed, w kept: %s", exc)
            self._stop()
            return False, []

    def _start(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        self._stop()
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.index.tuning"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=_child_env())
        with self._lock:
            closed = self._closed
            if not closed:
                self._proc = proc
        if closed:
            _reap(proc)
            raise RuntimeError("the tuner is closed")
        return proc

    def _stop(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            _reap(proc)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            proc, busy = self._proc, self._since is not None
        self._jobs.put(None)
        if proc is None:
            return
        if busy:  # a job in flight: the thread may be inside a write or read of the pipes
            proc.kill()
            return
        with self._lock:
            self._proc = None
        try:
            assert proc.stdin is not None
            proc.stdin.close()  # the child's loop reads EOF and exits
            proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        _reap(proc)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass


def _child_env() -> dict[str, str]:
    """The parent's environment, with the parent's kvtier first on the path unless it was
    installed into site-packages: the child runs the code its parent runs."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds kvtier/
    sites = {os.path.abspath(p) for p in [*getattr(site, "getsitepackages", list)(),
                                           getattr(site, "getusersitepackages", str)()] if p}
    if root not in sites:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    return env


def _send(stream: IO[bytes], data: bytes) -> None:
    stream.write(len(data).to_bytes(8, "big") + data)
    stream.flush()


def _recv(stream: IO[bytes]) -> object | None:
    """One length-prefixed pickle; None at a clean end of stream."""
    head = stream.read(8)
    if not head:
        return None
    if len(head) < 8:
        raise EOFError("the stream ended inside a length prefix")
    n = int.from_bytes(head, "big")
    if n > _MAX_MESSAGE:
        raise ValueError(f"a message of {n} bytes: not one of ours")
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the stream ended inside a message")
    return pickle.loads(data)  # noqa: S301 - written by this module at the other end of the pipe


def _serve() -> None:
    """The child's loop: read a job, answer its scores, until the parent closes the pipe."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, never into the answers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's; its closed pipe ends us
    try:
        os.nice(5)
    except OSError:
        pass
    inp = sys.stdin.buffer
    while True:
        job = _recv(inp)
        if job is None:
            return
        try:
            if not isinstance(job, Job):
                raise TypeError(f"a {type(job).__name__}, not a Job")
            reply: tuple[str, object] = ("ok", job.scores())
        except Exception as exc:  # the parent counts it failed and keeps w
            reply = ("error", f"{type(exc).__name__}: {exc}")
        _send(out, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    from kvtier.index.tuning import _serve as serve  # the module itself, so a Job unpickles as its Job

    serve()
