"""kvtier.router under hostile input: a malformed event or message is skipped and counted per
engine and never stops the subscriber thread nor another engine's answers; per-engine caps and a
max message size bound the index; a restart or a gap in an engine's sequence numbers resets it
(a gap is replayed first when vLLM's replay endpoint is given); a geometry change mid-stream
resets; `kvtier events` escapes the control characters of what it prints.

Events are the plain msgpack maps vLLM's ZMQ publisher sends (no vLLM needed); the publisher is a
ZMQ XPUB socket with vLLM's framing `[topic, seq (8 bytes big-endian), payload]`, so a test knows
when the router has subscribed."""

from __future__ import annotations

import argparse
import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from kvtier.router import PrefixIndex, Subscriber, decode_batch  # noqa: E402

C = 4  # chunk tokens
W = 2 * C  # the sliding group's window: vLLM looks up cdiv(W, C) = 2 chunks, tokens [T-2C, T)


def stored(h: object, parent: object, tokens: object, g: object = 0, kind: object = "full_attention",
           window: object = None, medium: object = "CPU", ownership: object = None) -> dict:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": C, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": g,
            "kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": window, "ownership": ownership}


def removed(h: object, g: object = 0, medium: object = "CPU", ownership: object = None) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": g, "ownership": ownership}


def prompt(seed: int, chunks: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 for i in range(chunks * C)]


def hybrid(p: list[int], base: int | None, chunks: int, tier: str | None = None) -> list[dict]:
    """`p`'s first `chunks` chunks as kvtier stores them: every chunk of the full group 0 (with its
    tokens), the sliding group 1's last two, the state group 2's checkpoint at the end. Chunk j's
    hash is `base + j`, or (base None) a hash of the prefix through it, as vLLM's chained hash."""
    own = None if tier is None else f"kvtier-{tier}"
    med = "CPU" if tier is None else "STORAGE"
    h = [(base + j) if base is not None else hash(tuple(p[:(j + 1) * C])) & (2**63 - 1) for j in range(chunks)]
    out = [stored(h[j], None if j == 0 else h[j - 1], p[j * C:(j + 1) * C], 0, medium=med, ownership=own)
           for j in range(chunks)]
    out += [stored(h[j], None, [], 1, "sliding_window", W, med, own) for j in range(max(0, chunks - 2), chunks)]
    return out + [stored(h[chunks - 1], None, [], 2, "mamba", None, med, own)]


def wire(events: list) -> list:
    """Through msgpack, as vLLM's publisher sends a batch: `[ts, [events...], dp_rank]`."""
    return decode_batch(msgspec.msgpack.encode([0.0, events, 0]))


def restored(index: PrefixIndex, p: list[int], engine: str = "e0") -> int:
    return index.longest_prefix(p, engine)[0].tokens


A = prompt(1, 6)


# -- 1. one bad event ---------------------------------------------------------------------------

def _bad(**fields: object) -> dict:
    ev = stored(10**9, None, [1, 2, 3, 4])
    ev.update(fields)
    return ev


HOSTILE = [  # (event, the counter it lands in)
    (_bad(group_idx="x"), "skipped_group_idx"),
    (_bad(block_hashes=["zz"]), "skipped_block_hashes"),
    (_bad(block_hashes=[None]), "skipped_block_hashes"),
    (_bad(ownership=5), "skipped_ownership"),
    (_bad(group_idx=math.nan), "skipped_group_idx"),
    (_bad(token_ids=[[1, 2], [3, 4]]), "skipped_token_ids"),
    (_bad(group_idx=1, token_ids=[], kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window="abc"),
     "skipped_kv_cache_spec_sliding_window"),
    (_bad(group_idx=1, token_ids=[], kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=math.inf),
     "skipped_kv_cache_spec_sliding_window"),
    (removed(1003, g="x"), "skipped_group_idx"),
    (removed("zz"), "skipped_block_hashes"),
    ("not an event", "skipped_event"),
    ({"type": "Bogus"}, "skipped_type"),
]


@pytest.mark.parametrize("bad, counter", HOSTILE, ids=[c + str(i) for i, (_, c) in enumerate(HOSTILE)])
def test_a_bad_event_is_skipped_and_counted_and_the_rest_applies(bad: object, counter: str) -> None:
    index = PrefixIndex()
    events = hybrid(A, 1000, 5)
    index.apply("e0", wire(events[:4] + [bad] + events[4:]))
    index.apply("e1", wire(hybrid(A, 1000, 5)))
    assert [(r.engine, r.tokens) for r in index.longest_prefix(A)] == [("e0", 5 * C), ("e1", 5 * C)]
    assert index.stats("e0")[counter] == 1
    assert sum(index.stats("e1").values()) == 0


@pytest.mark.parametrize("window", ["abc", math.inf, -5, 0, True, 2.5])
def test_one_engines_bad_window_never_breaks_another_engines_answer(window: object) -> None:
    index = PrefixIndex()
    index.apply("e0", wire(hybrid(A, 1000, 5)))
    index.apply("e1", wire([stored(2000, None, A[:C])] + [stored(2000, None, [], 1, "sliding_window", window)]))
    assert [(r.engine, r.tokens) for r in index.longest_prefix(A)] == [("e0", 5 * C), ("e1", C)]
    assert index.stats("e1")["skipped_kv_cache_spec_sliding_window"] == 1
    index.summary()  # never raises either


# -- the subscriber, over real ZMQ sockets ---------------------------------------------------------

class Publisher:
    """vLLM's ZmqEventPublisher's framing by hand, on an XPUB socket (which sees subscriptions)."""

    def __init__(self, topic: bytes = b"kv", connect: str | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if connect is None:
            self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self.sock.connect(connect)
        self.topic = topic

    def subscribed(self) -> None:
        while True:
            assert self.sock.poll(5000), "the router never subscribed"
            if self.sock.recv().startswith(b"\x01"):
                return

    def send(self, seq: int, events: list | None = None, payload: bytes | None = None) -> None:
        if payload is None:
            payload = msgspec.msgpack.encode([0.0, events or [], 0])
        self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.sock.close(0)


def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def pub() -> Iterator[Publisher]:
    p = Publisher()
    yield p
    p.close()


def test_the_subscriber_survives_bad_messages(pub: Publisher) -> None:
    index = PrefixIndex()
    sub = Subscriber(index, {"e0": pub.endpoint}, topic="kv")
    try:
        pub.subscribed()
        pub.sock.send_multipart([b"kv", b"\x00\x01"])  # two frames
        pub.sock.send_multipart([b"kv", b"\x00\x01\x02", b"x"])  # a 3-byte sequence number
        pub.send(0, payload=b"\xc1garbage")  # not msgpack
        pub.send(1, payload=msgspec.msgpack.encode({"not": "a batch"}))
        pub.send(2, [bad for bad, _ in HOSTILE])
        pub.send(3, hybrid(A, 1000, 5))
        until(lambda: restored(index, A) == 5 * C)
        stats = index.stats("e0")
        assert stats["bad_messages"] == 4 and stats.get("reset_gap", 0) == 0
        assert sum(v for k, v in stats.items() if k.startswith("skipped_")) == len(HOSTILE)
    finally:
        sub.close()


def test_the_router_can_bind_for_a_publisher_that_connects(tmp_path: Path) -> None:
    """vLLM connects its publisher to a tcp endpoint without `*` (loopback): the router binds."""
    index = PrefixIndex()
    sub = Subscriber(index, {"e0": f"bind:ipc://{tmp_path}/e0"}, topic="kv")
    pub = Publisher(connect=f"ipc://{tmp_path}/e0")
    try:
        pub.subscribed()
        pub.send(0, hybrid(A, 1000, 5))
        until(lambda: restored(index, A) == 5 * C)
    finally:
        sub.close()
        pub.close()


def test_a_taken_port_or_a_bad_endpoint_is_a_one_line_error(pub: Publisher) -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match=r"engine 'e0': ZMQ endpoint 'bind:tcp://.*' failed \(Address already in use"):
        Subscriber(PrefixIndex(), {"e0": "bind:" + pub.endpoint})
    with pytest.raises(ConfigError, match=r"engine 'e0': replay endpoint 'bind:tcp://.*' failed"):
        Subscriber(PrefixIndex(), {"e0": pub.endpoint}, replay={"e0": "bind:" + pub.endpoint})


# -- 2. bounds ---------------------------------------------------------------------------------

def test_the_documented_default_caps() -> None:
    from kvtier.router import Limits

    assert Limits() == Limits(max_entries=1_000_000, max_token_bytes=256 << 20, max_groups=256, max_tiers=16, max_event_tokens=65_536,
                              max_event_hashes=65_536, max_message_bytes=64 << 20)


def test_a_cap_must_be_a_positive_integer() -> None:
    from kvtier.errors import ConfigError
    from kvtier.router import Limits

    with pytest.raises(ConfigError, match=r"Limits.max_entries=0: give a positive integer"):
        Limits(max_entries=0)


def test_caps_drop_and_count() -> None:
    from kvtier.router import Limits

    index = PrefixIndex(Limits(max_entries=8, max_groups=3, max_tiers=2, max_event_tokens=C, max_event_hashes=2))
    long = prompt(2, 10)
    index.apply("e0", wire([stored(1000 + j, None if j == 0 else 999 + j, long[j * C:(j + 1) * C]) for j in range(10)]))
    assert index.summary()["e0"]["groups"][0]["chunks"] == {"cpu": 8}
    assert restored(index, long) == 8 * C  # what was dropped is never predicted
    index.apply("e0", wire([stored(1, None, [], 3, "mamba"), stored(1, None, list(range(C + 1))),
                            {**removed(1), "block_hashes": [1, 2, 3]},
                            stored(1000, None, long[:C], 0, medium="STORAGE", ownership="kvtier-disk"),
                            stored(1000, None, long[:C], 0, medium="STORAGE", ownership="kvtier-redis")]))
    stats = index.stats("e0")
    assert {k: stats[k] for k in ("dropped_entries", "dropped_groups", "dropped_token_ids", "dropped_block_hashes",
                                  "dropped_tiers")} == {"dropped_entries": 2, "dropped_groups": 1,
                                                        "dropped_token_ids": 1, "dropped_block_hashes": 1,
                                                        "dropped_tiers": 1}
    # 8 chunks x 2 tiers: removing chunks frees room for others
    index.apply("e0", wire([removed(1007)]))
    index.apply("e0", wire([stored(1008, 1007, long[8 * C:9 * C])]))
    assert stats["dropped_entries"] == index.stats("e0")["dropped_entries"]


def _token_bytes(index: PrefixIndex, engine: str = "e0") -> int:
    e = index._engines[engine]
    return sum(len(tokens) for kids in e.children.values() for tokens in kids)


def test_one_hash_at_many_places_stays_bounded() -> None:
    """One hash stored at 3,000 (parent, tokens) places: the chain keeps at most PLACES_PER_HASH
    places per hash (the newest), never one per store, and the token ids held stay under
    `max_token_bytes`."""
    from kvtier.router import Limits
    from kvtier.router.index import PLACES_PER_HASH

    index = PrefixIndex(Limits(max_entries=10, max_token_bytes=4096))
    t0 = time.monotonic()
    for i in range(3000):
        index.apply("e0", [stored(77, 10_000 + i, [i % 50000, 1, 2, 3])])
    assert time.monotonic() - t0 < 30  # was O(n^2): a tuple of places rebuilt per store
    e = index._engines["e0"]
    assert len(e.held) == 1
    assert len(e.links) <= len(e.held) and sum(map(len, e.children.values())) <= PLACES_PER_HASH * len(e.held)
    assert len(e.links[77]) == PLACES_PER_HASH
    # distinct hashes up to the token cap: past it a store is dropped and counted
    long = prompt(2, 400)
    index.apply("e0", wire([stored(1000 + j, None if j == 0 else 999 + j, long[j * C:(j + 1) * C]) for j in range(400)]))
    e = index._engines["e0"]
    assert len(e.links) <= len(e.held) <= 10
    assert sum(map(len, e.children.values())) <= PLACES_PER_HASH * len(e.held)
    assert _token_bytes(index) <= 4096
    # a valid chain still predicts exactly, and removing it frees its token bytes
    for j in range(10):
        index.apply("e0", wire([removed(1000 + j)]))
    index.apply("e0", wire([removed(77)]))
    assert _token_bytes(index) == 0 and not index._engines["e0"].links
    index.apply("e0", wire(hybrid(A, 5000, 5)))
    assert restored(index, A) == 5 * C and "dropped_tokens" not in index.stats("e0")
    full = [stored(5000 + j, None if j == 0 else 4999 + j, A[j * C:(j + 1) * C]) for j in range(5)]
    tight = PrefixIndex(Limits(max_token_bytes=3 * C * 4))  # three chunks' token ids
    tight.apply("e0", wire(full))
    assert tight.stats("e0")["dropped_tokens"] == 2
    assert restored(tight, A) == 3 * C and restored(tight, A[:2 * C] + [1]) == 2 * C  # never more than held
    tight.apply("e0", wire([removed(5002)]) + wire(full[3:]))  # room for one more chunk: 5003's
    assert tight.stats("e0")["dropped_tokens"] == 3 and _token_bytes(tight) == 3 * C * 4
    assert restored(tight, A) == 2 * C  # chunk 2 is gone: 5003 is held but never reached


def test_an_oversized_message_is_refused(pub: Publisher) -> None:
    from kvtier.router import Limits

    index = PrefixIndex(Limits(max_message_bytes=4096))
    sub = Subscriber(index, {"e0": pub.endpoint}, topic="kv")
    try:
        pub.subscribed()
        pub.send(0, hybrid(A, 1000, 2))
        until(lambda: sub.batches == 1)
        pub.send(1, payload=msgspec.msgpack.encode([0.0, [stored(5, None, list(range(4000)))], 0]))
        # ZMQ ends the connection that sent it; the router connects again: batches sent meanwhile
        # are lost (a gap), so send new ones until one arrives
        seq = 2
        while sub.batches < 2:
            assert seq < 200, "the router never got a batch after the oversized one"
            pub.send(seq, hybrid(A, 3000, 5))
            seq += 1
            time.sleep(0.02)
        stats = index.stats("e0")
        assert stats["reset_gap"] == 1 and stats["disconnects"] == 1
        assert "bad_messages" not in stats and "dropped_token_ids" not in stats  # never received
        assert restored(index, A) == 5 * C
    finally:
        sub.close()


# -- 3. restarts and gaps ---------------------------------------------------------------------------

def test_a_restarted_engine_forgets_what_it_held(pub: Publisher) -> None:
    index = PrefixIndex()
    sub = Subscriber(index, {"e0": pub.endpoint}, topic="kv")
    try:
        pub.subscribed()
        pub.send(0, hybrid(A, 1000, 3))
        pub.send(1, hybrid(A, 1000, 5))
        until(lambda: restored(index, A) == 5 * C)
        pub.send(0, hybrid(prompt(3, 2), 5000, 2))  # restarted after a SIGKILL: no BlockRemoved
        until(lambda: sub.batches == 3)
        assert restored(index, A) == 0 and restored(index, prompt(3, 2) + [1]) == 2 * C
        assert index.stats("e0")["reset_restart"] == 1
    finally:
        sub.close()


def test_a_gap_without_replay_resets(pub: Publisher) -> None:
    index = PrefixIndex()
    sub = Subscriber(index, {"e0": pub.endpoint}, topic="kv")
    try:
        pub.subscribed()
        pub.send(0, hybrid(A, 1000, 5))
        pub.send(2, hybrid(prompt(3, 2), 5000, 2))  # seq 1 (say, the removal of A's chunks) was lost
        until(lambda: sub.batches == 2)
        assert restored(index, A) == 0 and restored(index, prompt(3, 2) + [1]) == 2 * C
        assert index.stats("e0")["reset_gap"] == 1
    finally:
        sub.close()


def _serve_replay(router: object, frames_of: Callable[[int], list[list[bytes]]]) -> int:
    """One replay request on vLLM's ROUTER socket: the start it asked for; answers `frames_of(start)`
    then vLLM's end marker (seq -1, empty payload)."""
    assert router.poll(5000), "no replay request"
    ident, empty, start = router.recv_multipart()
    assert empty == b"" and len(start) == 8
    for frames in frames_of(int.from_bytes(start, "big")):
        router.send_multipart([ident, b""] + frames)
    router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
    return int.from_bytes(start, "big")


@pytest.mark.parametrize("buffered, reset", [((1, 2), 0), ((2,), 1)], ids=["replayed", "buffer-too-short"])
def test_a_gap_is_replayed(pub: Publisher, buffered: tuple[int, ...], reset: int) -> None:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    index = PrefixIndex()
    sub = Subscriber(index, {"e0": pub.endpoint}, topic="kv", replay={"e0": replay}, replay_timeout_s=5.0)
    batches = {0: hybrid(A, 1000, 5), 1: [removed(1000 + j, g) for j in range(5) for g in range(3)],
               2: hybrid(prompt(3, 2), 5000, 2), 3: hybrid(prompt(4, 3), 6000, 3)}
    try:
        pub.subscribed()
        pub.send(0, batches[0])
        until(lambda: sub.batches == 1)
        pub.send(3, batches[3])
        # vLLM 0.32 frames a replayed batch [topic, seq, payload]; newer ones [seq, payload]
        start = _serve_replay(router, lambda s: [[b"kv", n.to_bytes(8, "big"), msgspec.msgpack.encode(
            [0.0, batches[n], 0])] for n in buffered if n >= s])
        assert start == 1
        until(lambda: sub.batches == 2 + len(buffered))
        assert restored(index, A) == 0  # A's removal was replayed, or the engine was reset
        assert restored(index, prompt(3, 2) + [1]) == 2 * C and restored(index, prompt(4, 3) + [1]) == 3 * C
        stats = index.stats("e0")
        assert stats.get("reset_gap", 0) == reset and stats["replayed_batches"] == len(buffered)
    finally:
        sub.close()
        router.close(0)


def test_a_flapping_engine_never_stalls_the_others(pub: Publisher) -> None:
    """e0's replay endpoint never answers and e0 gaps on every batch: at most one replay try per
    `replay_interval_s` (the rest reset it), and e1's batches in between are applied."""
    dead = zmq.Context.instance().socket(zmq.ROUTER)  # takes requests, never answers
    dead.setsockopt(zmq.LINGER, 0)
    replay = f"tcp://127.0.0.1:{dead.bind_to_random_port('tcp://127.0.0.1')}"
    asked, stop = [], threading.Event()

    def drain() -> None:
        while not stop.is_set():
            if dead.poll(20):
                dead.recv_multipart()
                asked.append(time.monotonic())

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    pub1 = Publisher()
    index = PrefixIndex()
    sub = Subscriber(index, {"e0": pub.endpoint, "e1": pub1.endpoint}, topic="kv", replay={"e0": replay},
                     replay_timeout_s=0.3, replay_interval_s=1.0)
    n = 20
    try:
        pub.subscribed()
        pub1.subscribed()
        t0 = time.monotonic()
        for i in range(n):
            pub.send(2 * i, hybrid(A, 1000, 5))  # seq 0, 2, 4, ...: a gap before every batch but the first
            pub1.send(i, hybrid(prompt(3, 2), 5000 + 10 * i, 2))
        until(lambda: sub.batches == 2 * n, timeout_s=30)
        elapsed = time.monotonic() - t0
        time.sleep(0.1)  # the last request reaches the drainer
        assert len(asked) <= math.ceil(elapsed / 1.0) + 1, (len(asked), elapsed)
        assert restored(index, prompt(3, 2) + [1], "e1") == 2 * C
        stats = index.stats("e0")
        assert stats["reset_gap"] == n - 1 and stats.get("replayed_batches", 0) == 0
        assert "reset_gap" not in index.stats("e1")
    finally:
        sub.close()
        stop.set()
        drainer.join()
        dead.close(0)
        pub1.close()


# -- 4. geometry and impossible values ----------------------------------------------------------------

@pytest.mark.parametrize("change", [
    [stored(7000, None, prompt(5, 2))],  # 8 tokens a chunk now
    [stored(7000, None, [], 1, "mamba")],  # the sliding group relabelled
    [stored(7000, None, [], 1, "sliding_window", 4 * W)],  # a wider window
])
def test_a_geometry_change_mid_stream_resets_the_engine(change: list) -> None:
    index = PrefixIndex()
    index.apply("e0", wire(hybrid(A, 1000, 5)))
    index.apply("e1", wire(hybrid(A, 1000, 5)))
    index.apply("e0", wire(change))
    assert restored(index, A) == 0 and restored(index, A, "e1") == 5 * C
    assert index.stats("e0")["reset_geometry"] == 1
    if change[0]["token_ids"]:
        assert index.summary()["e0"]["chunk_tokens"] == 2 * C  # the new geometry is adopted


@pytest.mark.parametrize("bad, counter", [
    (_bad(group_idx=1, token_ids=[], kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=-5),
     "skipped_kv_cache_spec_sliding_window"),
    (_bad(group_idx=True), "skipped_group_idx"),
    (_bad(group_idx=-1), "skipped_group_idx"),
    (_bad(group_idx=1.0), "skipped_group_idx"),
    (_bad(token_ids=[-1, 2, 3, 4]), "skipped_token_ids"),
    (_bad(token_ids=[2**40, 2, 3, 4]), "skipped_token_ids"),
    (_bad(token_ids=[True, 2, 3, 4]), "skipped_token_ids"),
    (_bad(block_hashes=[1.5]), "skipped_block_hashes"),
    (_bad(block_hashes=[b"x" * 65]), "skipped_block_hashes"),
    (_bad(block_hashes=[]), "skipped_block_hashes"),
    (_bad(parent_block_hash="p"), "skipped_parent_block_hash"),
    (_bad(kv_cache_spec_kind=5), "skipped_kv_cache_spec_kind"),
    (_bad(medium=["CPU"]), "skipped_medium"),
    (_bad(ownership="kvtier-" + "d" * 100), "skipped_ownership"),
])
def test_impossible_values_are_rejected(bad: dict, counter: str) -> None:
    index = PrefixIndex()
    index.apply("e0", wire(hybrid(A, 1000, 5) + [bad]))
    assert index.stats("e0") == {counter: 1}
    assert restored(index, A) == 5 * C


def test_kvtier_events_escapes_control_characters(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.commands.events import _print

    index = PrefixIndex()
    index.apply("e0", wire([stored(1, None, [1, 2, 3, 4], 0, "\x1b[31mfull", None, "STORAGE", "kvtier-\x1b[2J")]))
    _print({"batches": 1, "engines": index.summary(), "restorable": [
        {"engine": "e0", "tokens": 4, "tiers": ["\x1b[2J"]}]})
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[2J" in out and "\\x1b[31mfull" in out


def test_kvtier_events_answers_through_a_bad_engine(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from kvtier.commands.events import run

    good, bad = Publisher(), Publisher()
    (tmp_path / "p.json").write_text(json.dumps(A))
    args = argparse.Namespace(zmq=[f"good={good.endpoint}", f"bad={bad.endpoint}"], replay=None, topic="kv",
                              prompt=str(tmp_path / "p.json"), every=0.5, seconds=2.5, json=True)
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(run(args)))
    t.start()
    try:
        good.subscribed()
        bad.subscribed()
        bad.send(0, [stored(2000, None, A[:C]), stored(2000, None, [], 1, "sliding_window", "abc")])
        good.send(0, hybrid(A, 1000, 5))
        t.join(10)
    finally:
        good.close()
        bad.close()
    assert rc == [0]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["restorable"] == [{"engine": "good", "tokens": 5 * C, "tiers": ["cpu"]},
                                  {"engine": "bad", "tokens": C, "tiers": ["cpu"]}]
    assert last["engines"]["bad"]["counts"] == {"skipped_kv_cache_spec_sliding_window": 1}


# -- the fuzz ---------------------------------------------------------------------------------------

JUNK: list[object] = [None, "x", "", "\x1b[2J", -1, 2**64 - 1, -2**63, 1.5, math.nan, math.inf, True, False,
                      b"", b"\xff" * 70, [], [None], [[1]], ["a"], {}, {"a": 1}, [1.5], "CPU", "GPU", 0, 7]
BAD: dict[str, list[object]] = {  # values no event may carry in that field
    "group_idx": ["x", math.nan, math.inf, -1, 1.0, True, None, [0], {"a": 1}, 10**6, b"\x00"],
    "block_hashes": [[], ["zz"], [None], [1.5], [True], "abc", None, [[1]], [b"x" * 65], 7, {"a": 1},
                     list(range(70_000))],
    "ownership": [5, ["x"], "k" * 100, b"kvtier-disk", 1.5, {"a": 1}],
}
BAD_STORED: dict[str, list[object]] = {
    "parent_block_hash": ["x", 1.5, [1], True, b"y" * 65],
    "token_ids": [[[1, 2]], ["a"] * C, [-1] * C, [2**40] * C, [1.5] * C, "abcd", 5, [True] * C, {"1": 2},
                  list(range(70_000))],
    "medium": [5, ["CPU"], 1.5],
    "kv_cache_spec_kind": [5, ["x"], "k" * 100, 1.5],
    "kv_cache_spec_sliding_window": ["abc", math.inf, math.nan, -5, 0, True, 1.5, [W]],
}


def hostile(rng: random.Random) -> object:
    """An event no router may apply: a valid one with one field made impossible, a map of junk with
    one such field, or something that is not an event at all."""
    roll = rng.random()
    if roll < 0.1:
        return rng.choice([[1, 2], "BlockStored", 5, None, 1.5, b"\x00", {"type": rng.choice(JUNK)}])
    if roll < 0.7:
        if rng.random() < 0.5:
            ev = stored(rng.choice([1000, 1003, 10**9]), rng.choice([None, 1000]), A[:C], rng.randrange(3))
            field, values = rng.choice(list(BAD.items()) + list(BAD_STORED.items()))
        else:
            ev = removed(rng.choice([1000, 1003, 1004]), rng.randrange(3))
            field, values = rng.choice(list(BAD.items()))
        ev[field] = rng.choice(values)
        return ev
    ev = {k: rng.choice(JUNK) for k in rng.sample(list(BAD) + list(BAD_STORED) + ["type", "x"], rng.randrange(1, 8))}
    ev["type"] = rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Bogus"])
    field = rng.choice(list(BAD))
    ev[field] = rng.choice(BAD[field])
    return ev


def scenario(rng: random.Random) -> tuple[list[list[dict]], list[list[int]]]:
    """Valid batches: conversations growing a chunk a turn, some branching off others, stored in
    the cpu, disk and redis tiers, then a few chunks removed."""
    prompts = [prompt(s, rng.randrange(2, 9)) for s in range(6)]
    prompts += [prompts[0][:3 * C] + prompt(90 + s, rng.randrange(1, 5)) for s in range(3)]  # branches
    batches = [hybrid(p, None, k, rng.choice([None, None, "disk", "redis"]))
               for p in prompts for k in range(1, len(p) // C + 1)]
    held = [ev for b in batches for ev in b]
    gone = rng.sample(held, 5)
    batches.append([removed(ev["block_hashes"][0], ev["group_idx"], ev["medium"], ev["ownership"]) for ev in gone])
    queries = [p[:k] + [7] for p in prompts for k in range(C, len(p) + 1, C)] + [p[:2 * C + 1] for p in prompts]
    return batches, queries + [[rng.randrange(50000) for _ in range(3 * C)]]


def test_the_router_survives_a_fuzz_of_hostile_events() -> None:
    """Thousands of hostile events between the valid ones change no prediction: every engine
    answers exactly what a fresh index fed only the valid events answers, and every hostile event
    is counted exactly once."""
    rng = random.Random(38)
    batches, queries = scenario(rng)
    clean, fuzzed = PrefixIndex(), PrefixIndex()
    n = 0
    for batch in batches:
        clean.apply("e0", wire(batch))
        mixed: list[object] = []
        for ev in batch:
            bad = [hostile(rng) for _ in range(rng.randrange(0, 100))]
            n += len(bad)
            mixed += bad + [ev]
        fuzzed.apply("e0", wire(mixed))
        # another engine flips its geometry every batch: e0 never notices
        fuzzed.apply("e1", wire([stored(1, None, [1] * rng.randrange(1, 9), 0, rng.choice(["mamba", "full_attention"])),
                                 hostile(rng)]))
    assert n > 3000
    answers = [(clean.longest_prefix(q, "e0"), fuzzed.longest_prefix(q, "e0")) for q in queries]
    assert all(a == b for a, b in answers)
    assert sum(a[0].tokens > 0 for a, _ in answers) > len(queries) // 3  # the scenario restores things
    assert any(a[0].tiers != ("cpu",) and a[0].tokens > 0 for a, _ in answers)  # from other tiers too
    stats = fuzzed.stats("e0")
    assert sum(v for k, v in stats.items() if k.split("_")[0] in ("skipped", "dropped", "ignored")) == n
    assert clean.stats("e0") == {}
