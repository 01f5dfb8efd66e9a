"""kvtier's Ray Serve request router (kvtier.integrations.ray) on real Ray Serve replicas.

A local Ray instance serves one deployment of two replicas routed by `KvtierRequestRouter`. Each
replica stands in for a vLLM engine with kvtier (no model): it publishes, on its own ZMQ socket
with vLLM's framing `[topic, seq, msgpack batch]`, the `BlockStored` events kvtier's cpu tier
announces for a prompt it served (every chunk of the full-attention group with its token ids, the
sliding group's last window), and names the socket in `record_replica_metadata`. The router learns
only from those messages, through kvtier's real `PrefixIndex` and `Subscriber`. Shown: a prompt
goes to the replica that holds its prefix; with none holding it, to the shorter queue; a holder
whose queue costs more than its hit saves loses to an idle replica.

The scoring rule alone (no Ray): per tier (a cheap tier's shorter hit beats a dear tier's longer
one) and per group (a prefix whose sliding group kept nothing restores nothing).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import sys
import threading
import time
from array import array
from pathlib import Path

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from kvtier.integrations.ray import DEFAULT_TIER_COSTS, prompt_tokens, rank, saved_tokens  # noqa: E402
from kvtier.router import PrefixIndex, decode_batch  # noqa: E402

C = 16  # chunk tokens (vLLM's block size x blocks per chunk)
W = 2 * C  # the sliding group's window: a hit loads its last two chunks
QUEUE_COST = 48  # prompt tokens one queued request costs: a 128-token cpu hit saves 120, so it
# outweighs two queued requests (120 - 96 > 0) and not three (120 - 144 < 0)


def prompt(seed: int, chunks: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 for i in range(chunks * C)]


def chunk_hash(tokens: list[int]) -> int:
    """A chained hash of the prefix through a chunk (vLLM's is sha256 of the parent and tokens)."""
    return int.from_bytes(hashlib.blake2b(array("I", tokens).tobytes(), digest_size=8).digest(), "big") >> 1


def stored(tokens: list[int], chunks: int, tier: str = "cpu", sliding: range | None = None) -> list[dict]:
    """The events kvtier publishes when a tier commits a prompt's first `chunks` chunks: group 0
    (full attention) every chunk with its tokens and parent, group 1 (sliding, window W) the
    chunks of `sliding` (by default its last two)."""
    medium, own = ("CPU", None) if tier == "cpu" else ("STORAGE", f"kvtier-{tier}")
    h = [chunk_hash(tokens[:(j + 1) * C]) for j in range(chunks)]

    def ev(j: int, g: int, kind: str, window: int | None, ids: list[int], parent: int | None) -> dict:
        return {"type": "BlockStored", "block_hashes": [h[j]], "parent_block_hash": parent, "token_ids": ids,
                "block_size": C, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": g,
                "kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": window, "ownership": own}

    out = [ev(j, 0, "full_attention", None, tokens[j * C:(j + 1) * C], None if j == 0 else h[j - 1])
           for j in range(chunks)]
    window = range(max(0, chunks - 2), chunks) if sliding is None else sliding
    return out + [ev(j, 1, "sliding_window", W, [], None) for j in window]


def wire(events: list) -> list:
    return decode_batch(msgspec.msgpack.encode([0.0, events, 0]))


# -- the scoring rule, no Ray -------------------------------------------------------------------

P = prompt(1, 8)


def test_a_cheap_tiers_shorter_hit_beats_a_dear_tiers_longer_one() -> None:
    index = PrefixIndex()
    index.apply("disk", wire(stored(P, 8, "disk")))  # all 8 chunks, on disk
    index.apply("cpu", wire(stored(P, 6, "cpu")))  # 6 of them, in host memory
    hits = {e: index.longest_prefix(P + [7], e)[0] for e in ("disk", "cpu")}
    assert (hits["disk"].tokens, hits["cpu"].tokens) == (8 * C, 6 * C)
    assert hits["disk"].loads == ((0, "disk", 8 * C), (1, "disk", 2 * C))  # per group, per tier
    dear = {"cpu": 0.1, "disk": 0.8}
    assert [c.engine for c in rank(hits, {"disk": 0, "cpu": 0}, dear)] == ["cpu", "disk"]
    cheap = {"cpu": 0.1, "disk": 0.2}
    assert [c.engine for c in rank(hits, {"disk": 0, "cpu": 0}, cheap)] == ["disk", "cpu"]
    assert saved_tokens(hits["cpu"], dear) == 6 * C - (6 * C + 2 * C) * 0.1 / 2


def test_a_prefix_whose_sliding_group_kept_nothing_scores_nothing() -> None:
    """Replica "stale" holds every full-attention chunk of P but its sliding group kept only the
    first two chunks' window; "fresh" holds 5 chunks in every group. A group-blind router picks
    "stale" (8 chunks present); kvtier's restores nothing there."""
    index = PrefixIndex()
    index.apply("stale", wire(stored(P, 8, sliding=range(0, 2))))
    index.apply("fresh", wire(stored(P, 5)))
    blind = {e: index.longest_prefix(P + [7], e, group_blind=True)[0].tokens for e in ("stale", "fresh")}
    assert blind == {"stale": 8 * C, "fresh": 5 * C}
    hits = {e: index.longest_prefix(P + [7], e)[0] for e in ("stale", "fresh")}
    assert hits["stale"].tokens == 2 * C  # the only window its sliding group holds
    assert [c.engine for c in rank(hits, {"stale": 0, "fresh": 0})] == ["fresh", "stale"]


def test_nothing_held_means_no_ranking_and_load_decides() -> None:
    index = PrefixIndex()
    index.apply("a", wire(stored(prompt(2, 4), 4)))
    hits = {e: index.longest_prefix(P, e)[0] for e in ("a", "b")}
    assert rank(hits, {"a": 0, "b": 3}) == []


def test_the_prompt_is_read_as_ray_and_vllm_pass_it() -> None:
    class Req:  # an OpenAI-style request object
        def __init__(self, **kw: object) -> None:
            self.__dict__.update(kw)

    class Tok:
        def __call__(self, text: str) -> dict:
            return {"input_ids": [len(w) for w in text.split()]}

        def apply_chat_template(self, messages: list, tokenize: bool, add_generation_prompt: bool) -> dict:
            return {"input_ids": [9] + [len(m["content"]) for m in messages] + [8]}

    assert prompt_tokens([], {"request_token_ids": [1, 2]}) == [1, 2]
    assert prompt_tokens([{"prompt_token_ids": [3, 4]}], {}) == [3, 4]
    assert prompt_tokens([Req(prompt=[5, 6])], {}) == [5, 6]
    assert prompt_tokens([Req(prompt="ab c")], {}) is None  # text without a tokenizer: routed by load
    assert prompt_tokens([Req(prompt="ab c")], {}, Tok()) == [2, 1]
    assert prompt_tokens([Req(messages=[{"role": "user", "content": "xyz"}])], {}, Tok()) == [9, 3, 8]
    assert prompt_tokens([Req(prompt=[1, "x"])], {}) is None
    assert prompt_tokens(["plain"], {}) is None


@pytest.mark.parametrize("kwargs, says", [
    ({"queue_cost_tokens": -1}, "queue_cost_tokens=-1"), ({"queue_cost_tokens": float("nan")}, "queue_cost_tokens=nan"),
    ({"queue_cost_tokens": "512"}, "queue_cost_tokens='512'"), ({"tier_costs": {"disk": 2}}, "{'disk': 2}"),
    ({"tier_costs": {"cpu": float("nan")}}, "{'cpu': nan}")])
def test_bad_router_settings_fail_at_start_with_the_value(kwargs: dict, says: str) -> None:
    pytest.importorskip("ray.serve")
    from kvtier.errors import ConfigError
    from kvtier.integrations.ray import KvtierRequestRouter

    with pytest.raises(ConfigError, match=re.escape(says)):
        KvtierRequestRouter.initialize_state(object.__new__(KvtierRequestRouter), **kwargs)


# -- real Ray Serve replicas ----------------------------------------------------------------------

class EventsOnlyEngine:
    """One replica: serves a prompt (optionally holding it `hold_s`, to load the replica) and then
    publishes what kvtier's cpu tier would announce for it; a heartbeat of GPU-cache events (which
    the router counts and ignores) shows the router has subscribed."""

    def __init__(self) -> None:
        import zmq as z

        self._sock = z.Context.instance().socket(z.PUB)
        self._port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._seq, self._lock = 0, threading.Lock()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def record_replica_metadata(self) -> dict:
        from kvtier.integrations.ray import replica_metadata

        return replica_metadata(self._port, host="127.0.0.1")

    def _publish(self, events: list) -> None:
        import msgspec as m

        with self._lock:
            self._sock.send_multipart([b"", self._seq.to_bytes(8, "big"), m.msgpack.encode([time.time(), events, 0])])
            self._seq += 1

    def _heartbeat(self) -> None:
        while True:
            self._publish([{"type": "BlockStored", "block_hashes": [1], "medium": "GPU", "group_idx": 0}])
            time.sleep(0.1)

    async def __call__(self, request: dict) -> str:
        from ray import serve

        if "started" in request:  # the test learns which replica has the request (its queue counts it)
            tmp = Path(request["started"] + ".tmp")
            tmp.write_text(serve.get_replica_context().replica_id.unique_id)
            tmp.rename(request["started"])
        await asyncio.sleep(request.get("hold_s", 0))
        tokens = request["prompt_token_ids"]
        self._publish(stored(tokens, len(tokens) // C))
        return serve.get_replica_context().replica_id.unique_id


@pytest.fixture(scope="module")
def app():  # noqa: ANN201 - (handle, router)
    pytest.importorskip("ray.serve")
    import ray
    from ray import cloudpickle, serve
    from ray.serve.config import RequestRouterConfig

    from kvtier.integrations.ray import routers

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replicas run this module's class
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Ray kills its own workers when the node's memory is over 95% full, whoever uses it (on a
        # shared test machine, other jobs): these replicas take a few MB
        env.setenv("RAY_memory_monitor_refresh_ms", "0")
        # a small object store: nothing large crosses processes here, and /dev/shm is shared
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20)
    try:
        serve.start(proxy_location="Disabled")
        deployment = serve.deployment(
            EventsOnlyEngine, name="engine", num_replicas=2, max_ongoing_requests=16, ray_actor_options={"num_cpus": 0},
            request_router_config=RequestRouterConfig(
                request_router_class="kvtier.integrations.ray.KvtierRequestRouter",
                request_router_kwargs={"queue_cost_tokens": QUEUE_COST}))
        handle = serve.run(deployment.bind(), name="kvtier-ray-router")
        handle.remote({"prompt_token_ids": prompt(99, 1)}).result(timeout_s=60)
        (router,) = [r for r in routers() if r._deployment_id.name == "engine"]
        # a replica that does not answer Ray's queue-length probe in time (0.1 s at first) is
        # ranked last with no queue length; on a loaded test machine that, not the score, decided
        router.queue_len_response_deadline_s = router.max_queue_len_response_deadline_s = 10.0
        _until(lambda: len(router.index.engines()) == 2, "the router subscribed to both replicas")
        yield handle, router
    finally:
        serve.shutdown()
        ray.shutdown()


def _until(ok, what: str, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < end, f"timed out waiting until {what}"
        time.sleep(0.02)


def _serve(handle, tokens: list[int], **kw: object) -> str:  # noqa: ANN001
    return handle.remote({"prompt_token_ids": tokens, **kw}).result(timeout_s=60)


def _held(router, tokens: list[int], engine: str) -> int:  # noqa: ANN001
    return router.index.longest_prefix(tokens + [0], engine)[0].tokens


def _place(handle, router, seed: int, chunks: int, avoid: str | None = None) -> tuple[list[int], str]:  # noqa: ANN001
    """A fresh prompt served (by load: nobody holds it) until one lands on a replica other than
    `avoid`; returns it and its holder, once the router has its events."""
    for k in range(40):
        p = prompt(seed * 100 + k, chunks)
        engine = _serve(handle, p)
        _until(lambda: _held(router, p, engine) == chunks * C, f"the router learned {engine}'s prompt")  # noqa: B023
        if engine != avoid:
            return p, engine
    raise AssertionError(f"40 fresh prompts all went to {avoid}")


@pytest.mark.timeout(120)
def test_requests_go_to_the_replica_that_holds_their_prefix(app) -> None:  # noqa: ANN001
    handle, router = app
    p, holder = _place(handle, router, 1, 8)
    q, other = _place(handle, router, 2, 8, avoid=holder)
    before = router.decisions["by_prefix"]
    # two conversations growing a chunk a turn, in an order no alternation or load balance follows
    turns = "ppqqpqpp"
    got = [_serve(handle, (p if c == "p" else q) + prompt(10 + k, k + 1)) for k, c in enumerate(turns)]
    assert got == [holder if c == "p" else other for c in turns], (holder, other, router.last)
    assert router.decisions["by_prefix"] - before == len(turns)
    assert router.last[0].restored_tokens >= 8 * C


@pytest.mark.timeout(420)  # a loaded machine: Ray may take a minute to deliver a request
def test_with_no_holder_the_shorter_queue_wins_and_a_long_queue_outweighs_a_hit(app, tmp_path: Path) -> None:  # noqa: ANN001
    handle, router = app
    p, holder = _place(handle, router, 3, 8)
    other = next(e for e in router.index.engines() if e != holder)
    held = []
    for n in range(3):  # the holder's hit (120 tokens saved) beats queues of 0, 1 and 2 (x 48 tokens)
        # Ray's cached queue lengths lag what the replicas hold (a request in transit, one that
        # finished): the router asks both replicas afresh, and a replica's own count includes a
        # request once it has started there, so the next is sent only then
        for r in router.curr_replicas:
            router.replica_queue_len_cache.invalidate_key(r)
        started = tmp_path / f"started-{n}"
        held.append(handle.remote({"prompt_token_ids": p + prompt(30 + n, 1), "hold_s": 150,  # held past the checks below
                                   "started": str(started)}))
        _until(started.exists, f"held request {n} started", 60)
        assert started.read_text() == holder, (n, router.last)
    assert [c.engine for c in router.last[:1]] == [holder] and router.last[0].queue_len == 2, router.last
    # three requests queued on the holder: 120 - 3 x 48 < 0, so the idle replica wins
    for r in router.curr_replicas:
        router.replica_queue_len_cache.invalidate_key(r)
    assert _serve(handle, p + prompt(40, 1)) == other, router.last
    assert router.last[0].engine == other and router.last[-1].queue_len == 3, router.last
    # prompts nobody holds go by load: the idle replica, every time (two replicas: Ray's power of two takes both and the shorter queue)
    assert [_serve(handle, prompt(500 + k, 3)) for k in range(4)] == [other] * 4
    assert [r.result(timeout_s=240) for r in held] == [holder] * 3


def test_the_route_bench_streams_reuse_what_each_router_is_judged_on() -> None:
    """`kvtier bench route`'s requests: each conversation turn extends the one before; every
    question over a document starts with the whole document, longer than Gemma 3's 512 window."""
    import argparse

    from kvtier.commands.bench_route import workloads

    a = argparse.Namespace(workloads=["chat", "docs"], conversations=3, turns=4, turn_tokens=200, documents=2,
                           questions=3, document_tokens=1200, seed=0)
    s = workloads(a)
    assert [len(c) for c in s["chat"]] == [4, 4, 4] and [len(c) for c in s["docs"]] == [3, 3]
    for turns in s["chat"]:
        assert [len(t) for t in turns] == [500, 700, 900, 1100]
        assert all(turns[k + 1][:len(turns[k])] == turns[k] for k in range(3))
    for questions in s["docs"]:
        assert all(q[:1200] == questions[0][:1200] and q[1200:] != questions[0][1200:] for q in questions[1:])
    assert s["docs"][0][0][:1200] != s["docs"][1][0][:1200]
