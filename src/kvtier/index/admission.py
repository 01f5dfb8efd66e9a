"""Admission: which of a request's chunks are worth storing at all.

One small interface, composable with every eviction policy and tier:
`make_admission(name, **opts) -> Admission`; `admit(chunk_hashes) -> int` is called once per
request (the store calls it once per save; replay once per request) with the request's chunk
hashes in prefix order, and returns how many *leading* chunks may be stored. The answer is
prefix-closed on purpose: a chunk without its predecessors can never be part of a hit.

Every structure here is bounded; each class states its bytes. Hashes may be bytes (kvtier.core.keys:
blake2b digests, already uniform) or ints (replay: trace ids, mixed with splitmix64).

Policies (names in `ADMISSIONS`):
- `all`: store everything (the default; LRU-without-admission).
- `nth` (`nth:N`, N >= 2): store a chunk from its N-th sighting on, counted in a count-min sketch
  (4 rows of 8-bit counters) that halves every `sample` sightings, so old counts fade.
- `tinylfu`: a TinyLFU-style doorkeeper. First sightings only set a bit in a Bloom filter (the
  doorkeeper); later sightings count in a count-min sketch. Frequency = sketch + doorkeeper bit.
  Every `sample` sightings the sketch halves and the doorkeeper is cleared (aging). A chunk is
  admitted when its frequency, this sighting included, reaches `threshold` (default 2).
- `prefix`: kvtier's prefix-aware rule (see `PrefixAdmission`): the already-seen head of a
  prompt is admitted eagerly; its new tail only when tails like it (same depth class and tail
  length class, and separately the request's last chunk) have been reused often enough lately.
  It learns online from the past only: it tracks sampled tails and sees which are asked again.
- `adaptive`: runs the rules above side by side, each with a sampled miniature LRU cache of
  what it admits, and answers with the one whose miniature hit most lately (see
  `AdaptiveAdmission`; measured in docs/admission.md: never below LRU on the Mooncake traces).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from kvtier.errors import ConfigError
from kvtier.index.sketches import Bloom, CountMin, h64 as _h64

ChunkHash = bytes | int


class Admission(Protocol):
    name: str

    def admit(self, chunk_hashes: Sequence[ChunkHash]) -> int: ...

    @property
    def memory_bytes(self) -> int: ...


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"admission option {what}={value!r} must be a positive integer")
    return value


class AdmitAll:
    name = "all"
    memory_bytes = 0

    def admit(self, chunk_hashes: Sequence[ChunkHash]) -> int:
        return len(chunk_hashes)


class NthSighting:
    """Store a chunk from its N-th sighting on. Memory: 4 * width bytes (default 1 MiB)."""

    def __init__(self, n: int = 2, width: int = 1 << 18, sample: int = 1 << 20) -> None:
        self.n = _positive(n, "n")
        if self.n < 2:
            raise ConfigError("nth admission needs n >= 2 (n=1 is 'all')")
        self.name = f"nth:{self.n}"
        self.sketch = CountMin(_positive(width, "width"), _positive(sample, "sample"))

    def admit(self, chunk_hashes: Sequence[ChunkHash]) -> int:
        sketch = self.sketch
        keys = [_h64(h) for h in chunk_hashes]
        k = 0
        while k < len(keys) and sketch.estimate(keys[k]) + 1 >= self.n:
            k += 1
        for x in keys:
            sketch.add(x)
        return k

    @property
    def memory_bytes(self) -> int:
        return self.sketch.memory_bytes


class TinyLFU:
    """Doorkeeper Bloom filter + count-min sketch with aging.

    Memory: doorkeeper `doorkeeper_bits` / 8 bytes + sketch 4 * width bytes (defaults:
    128 KiB + 1 MiB).
    """

    name = "tinylfu"

    def __init__(self, threshold: int = 2, width: int = 1 << 18, doorkeeper_bits: int = 1 << 20,
                 sample: int = 1 << 20) -> None:
        self.threshold = _positive(threshold, "threshold")
        self.sample = _positive(sample, "sample")
        self.sketch = CountMin(_positive(width, "width"), sample=1 << 62)  # aged here, below
        self.doorkeeper = Bloom(_positive(doorkeeper_bits, "doorkeeper_bits"))
        self.sightings = 0

    def frequency(self, x: int) -> int:
        return self.sketch.estimate(x) + (x in self.doorkeeper)

    def admit(self, chunk_hashes: Sequence[ChunkHash]) -> int:
        keys = [_h64(h) for h in chunk_hashes]
        k = 0
        while k < len(keys) and self.frequency(keys[k]) + 1 >= self.threshold:
            k += 1
        for x in keys:
            if x in self.doorkeeper:
                self.sketch.add(x)
            else:
                self.doorkeeper.add(x)
            self.sightings += 1
            if self.sightings >= self.sample:  # aging: the reset of TinyLFU
                self.sightings = 0
                self.sketch.halve()
                self.doorkeeper.clear()
        return k

    @property
    def memory_bytes(self) -> int:
        return self.sketch.memory_bytes + self.doorkeeper.memory_bytes


def _klass(n: int) -> int:
    return min(n, 255).bit_length()  # 0, 1, 2-3, 4-7, ... 128+


class PrefixAdmission:
    """Head eagerly, tail on evidence: prefix-aware admission that learns from the past.

    For a request with chunks h_0..h_{n-1}, the *head* is its leading chunks seen before (two
    generations of a Bloom filter: a chained hash seen before means that prefix was asked
    before), the *tail* the rest. The head is always admitted: it was reused, by definition.
    The tail's chunks other than the last, and the last chunk alone, each belong to a class:
    (head length class, tail length class, last or not), classes of powers of two. Per class
    the rule keeps a reuse estimate learned online: it tracks a sample of tails (their first
    chunk, and the last chunk) for `horizon` later chunks (give the first tier's capacity in
    chunks: a chunk not asked again within one cache turnover would be evicted anyway); a tracked chunk asked again within
    the horizon is a success, one that ages out a failure. A tail is admitted while its class
    has too few outcomes (`warmup`) or its estimate is at least `ratio` (0.5) times the running
    mean of all classes; the last chunk likewise (Mooncake-style traces end a prompt with a partial
    block whose hash the next turn does not repeat: the rule learns that by itself).
    Memory: Bloom 2 * bloom_bits / 8 bytes + at most `track` tracked entries (~120 bytes each)
    + 2 counters per class (<= 2 * 9 * 9 * 2); defaults: 256 KiB + ~1 MiB.
    """

    name = "prefix"

    def __init__(self, horizon: int = 1 << 15, track: int = 8192, ratio: float = 0.5,
                 warmup: int = 32, bloom_bits: int = 1 << 20, sample: int = 4) -> None:
        self.horizon = _positive(horizon, "horizon")
        self.track = _positive(track, "track")
        self.warmup = _positive(warmup, "warmup")
        self.sample = _positive(sample, "sample")
        if not isinstance(ratio, (int, float)) or ratio <= 0:
            raise ConfigError(f"admission option ratio={ratio!r} must be a number > 0")
        self.ratio = float(ratio)
        self.generation_size = _positive(bloom_bits, "bloom_bits") // 8  # keep false hits rare
        self.seen = [Bloom(bloom_bits), Bloom(bloom_bits)]
        self.in_current = 0
        self.clock = 0  # chunks seen so far
        self.tracked: OrderedDict[int, tuple[tuple[int, int, bool], int]] = OrderedDict()
        self.stats: dict[tuple[int, int, bool], list[int]] = {}  # class -> [successes, trials]

    def _seen(self, x: int) -> bool:
        return x in self.seen[0] or x in self.seen[1]

    def _remember(self, x: int) -> None:
        self.seen[0].add(x)
        self.in_current += 1
        if self.in_current >= self.generation_size:  # rotate: forget the older generation
            self.seen = [Bloom(self.seen[0].bits), self.seen[0]]
            self.in_current = 0

    def _outcome(self, klass: tuple[int, int, bool], success: bool) -> None:
        s = self.stats.setdefault(klass, [0, 0])
        s[0] += success
        s[1] += 1

    def _worth(self, klass: tuple[int, int, bool]) -> bool:
        s = self.stats.get(klass)
        if s is None or s[1] < self.warmup:
            return True
        total_s = sum(v[0] for v in self.stats.values())
        total_t = sum(v[1] for v in self.stats.values())
        mean = (total_s + 1) / (total_t + 2)
        return (s[0] + 1) / (s[1] + 2) >= self.ratio * mean

    def admit(self, chunk_hashes: Sequence[ChunkHash]) -> int:
        keys = [_h64(h) for h in chunk_hashes]
        n = len(keys)
        tracked = self.tracked
        for x in keys:  # outcomes: tracked chunks asked again
            hit = tracked.pop(x, None)
            if hit is not None:
                self._outcome(hit[0], True)
        self.clock += n
        while tracked:  # outcomes: tracked chunks aged out
            x, (klass, born) = next(iter(tracked.items()))
            if self.clock - born <= self.horizon and len(tracked) <= self.track:
                break
            del tracked[x]
            self._outcome(klass, False)
        head = 0
        while head < n and self._seen(keys[head]):
            head += 1
        for x in keys[head:]:
            self._remember(x)
        if head == n:
            return n
        tail = n - head
        body = (_klass(head), _klass(tail), False)
        last = (_klass(head), _klass(tail), True)
        if tail > 1 and keys[head] % self.sample == 0:
            tracked[keys[head]] = (body, self.clock)
        if keys[-1] % self.sample == 0:
            tracked[keys[-1]] = (last, self.clock)
        if tail > 1 and not self._worth(body):
            return head
        return n if self._worth(last) else n - 1

    @property
    def memory_bytes(self) -> int:
        return sum(b.memory_bytes for b in self.seen) + 120 * len(self.tracked) + 16 * len(self.stats)


class AdaptiveAdmission:
    """Follow the rule that would have hit most lately: miniature simulations of candidate rules.

    The rule, in full: every candidate admission rule (default `all`, `prefix`, `tinylfu`,
    `nth:2`, sized for a cache of `horizon` chunks the way `kvtier replay` sizes them) sees
    every request and says its own k. Next to each candidate runs a *miniature* LRU cache of
    the chunks that candidate admits, spatially sampled (SHARDS, Waldspurger et al., FAST'15;
    "miniature simulations", ATC'17): only chunks whose 64-bit hash is 0 mod `sample` are
    simulated, in `horizon // sample` slots, so the miniature behaves like a cache of
    `horizon` chunks at 1/`sample` of the cost. A miniature's hits for a request are its
    sampled chunks present from the prompt's start up to the first sampled miss (the prefix
    rule, at sampled resolution); they are touched, then the sampled chunks the candidate
    admits are stored (LRU). Each candidate's score is its miniature's hits, decayed by
    (1 - 1/`window`) per chunk seen (default window: 2 x horizon, two turnovers). `admit`
    returns the k of the candidate with the highest score *before* this request (a tie keeps
    the current choice; the first choice is the first candidate), so it learns from the past
    only. It cannot beat its best candidate by much; what it buys is not losing: each
    capacity and trace gets the rule that suits it (measured in docs/admission.md).

    `sample` defaults to the largest power of two that leaves at least 1024 slots in each
    miniature (1 below 2048 chunks: exact). Memory: the candidates' own (prefix <= 1.3 MiB,
    tinylfu 1.1 MiB, nth:2 1 MiB) + at most 4 x 2048 sampled entries (~100 bytes each,
    ~0.8 MiB); defaults: <= 4.2 MiB.
    """

    name = "adaptive"
    CANDIDATES = ("all", "prefix", "tinylfu", "nth:2")

    def __init__(self, horizon: int = 1 << 15, sample: int | None = None, window: int | None = None,
                 candidates: Sequence[str] = CANDIDATES) -> None:
        self.horizon = _positive(horizon, "horizon")
        if sample is None:
            sample = 1
            while self.horizon // (2 * sample) >= 1024:
                sample *= 2
        self.sample = _positive(sample, "sample")
        self.window = _positive(window if window is not None else 2 * self.horizon, "window")
        if isinstance(candidates, str) or not candidates:
            raise ConfigError(f"adaptive admission: candidates={candidates!r} must be a non-empty "
                              f"list of admission names, e.g. {list(self.CANDIDATES)}")
        self.candidates: list[Admission] = []
        for cand in candidates:
            base = str(cand).partition(":")[0]
            if base == "adaptive":
                raise ConfigError("adaptive admission: a candidate cannot be 'adaptive' itself")
            self.candidates.append(sized_admission(str(cand), self.horizon))
        self.names = [str(c) for c in candidates]
        self.slots = max(1, self.horizon // self.sample)
        self.minis: list[OrderedDict[int, None]] = [OrderedDict() for _ in self.candidates]
        self.scores = [0.0] * len(self.candidates)
        self.decay = 1.0 - 1.0 / self.window if self.window > 1 else 0.0
        self.current = 0
        self.chosen = [0] * len(self.candidates)  # requests answered by each candidate

    def admit(self, chunk_hashes: Sequence[ChunkHash]) -> int:
        keys = [_h64(h) for h in chunk_hashes]
        sampled = [(i, x) for i, x in enumerate(keys) if x % self.sample == 0]
        fade = self.decay ** len(keys)
        answer = 0
        for j, (cand, mini) in enumerate(zip(self.candidates, self.minis)):
            k = int(cand.admit(chunk_hashes))
            if j == self.current:
                answer = k
            hits = 0
            for _, x in sampled:  # lookup: sampled chunks present from the start
                if x not in mini:
                    break
                mini.move_to_end(x)
                hits += 1
            self.scores[j] = self.scores[j] * fade + hits
            for i, x in sampled:  # save: the sampled chunks this candidate admits
                if i >= k:
                    break
                if x in mini:
                    mini.move_to_end(x)
                else:
                    mini[x] = None
                    if len(mini) > self.slots:
                        mini.popitem(last=False)
        self.chosen[self.current] += 1
        best = self.current
        for j, s in enumerate(self.scores):
            if s > self.scores[best]:
                best = j
        self.current = best
        return answer

    @property
    def memory_bytes(self) -> int:
        return sum(c.memory_bytes for c in self.candidates) + 100 * sum(len(m) for m in self.minis)


ADMISSIONS: dict[str, Callable[..., Admission]] = {
    "all": AdmitAll,
    "nth": NthSighting,
    "tinylfu": TinyLFU,
    "prefix": PrefixAdmission,
    "adaptive": AdaptiveAdmission,
}


def make_admission(name: str, **opts: object) -> Admission:
    """`name` or `name:N` (nth:3) or `name:key=value,key=value` (prefix:ratio=1.5)."""
    base, _, rest = name.partition(":")
    if base not in ADMISSIONS:
        raise ConfigError(f"unknown admission policy {name!r}; use one of: {', '.join(ADMISSIONS)}")
    kwargs: dict[str, object] = dict(opts)
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            if base != "nth":
                raise ConfigError(f"admission option {part!r} in {name!r} is not key=value")
            key, value = "n", part
        try:
            kwargs[key] = float(value) if "." in value else int(value)
        except ValueError:
            raise ConfigError(f"admission option {key}={value!r} in {name!r} is not a number") from None
    if base == "all" and kwargs:
        raise ConfigError("admission 'all' takes no options")
    import inspect

    accepted = [p for p in inspect.signature(ADMISSIONS[base]).parameters if p != "candidates"]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise ConfigError(f"admission {name!r}: unknown option {unknown[0]!r}; {base} takes: "
                          f"{', '.join(accepted)} (e.g. {base}:{accepted[0]}=...)")
    return ADMISSIONS[base](**kwargs)


def sized_admission(name: str, capacity_chunks: int) -> Admission:
    """`make_admission(name)` sized for a first tier of `capacity_chunks` chunks (options given
    in the name win): `prefix` and `adaptive` learn over one turnover (`horizon`), `tinylfu`
    ages every 10 x capacity sightings (TinyLFU's W). How `kvtier replay` and `adaptive`'s
    candidates are sized."""
    base = name.partition(":")[0]
    opts: dict[str, object] = {}
    if base in ("prefix", "adaptive"):
        opts["horizon"] = capacity_chunks
    elif base == "tinylfu":
        opts["sample"] = 10 * capacity_chunks
    return make_admission(name, **opts)
