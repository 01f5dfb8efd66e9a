"""The worth tuner of the product (kvtier.index.tuning): its window is bounded, its shadow is
replay's loop, the child process adopts what the inline runner adopts, a tuning due while one runs
is skipped without blocking, and a child that dies or fails costs one counted tuning, never w."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time
from pathlib import Path

import pytest

import kvtier
from kvtier.core.cost import compute_model
from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import make_plan
from kvtier.errors import ConfigError
from kvtier.index.placement import HitsLand
from kvtier.index.tuning import (GRID, Job, WorthTuner, default_policy, shadow_flops, worth_index)
from kvtier.replay.run import CostModel, replay
from kvtier.replay.trace import Trace, load_trace

TRACE = Path(kvtier.__file__).parent / "data" / "mooncake_conversation_head.jsonl"
ROW = 1024 + 4096  # one chunk of both groups below


def hybrid():
    g = Geometry((Group("full", "full", 1, 16, bytes_per_token_per_layer=2),
                  Group("ssm", "state", 1, 16, state_bytes_per_layer=4096)), 16)
    return make_plan(g, chunk_tokens=512)


PLAN = hybrid()


def head(n: int) -> Trace:
    return load_trace(TRACE, PLAN, limit=n)


def as_bytes(chunks) -> tuple[bytes, ...]:
    """Trace ids as a store's 32-byte chunk hashes."""
    return tuple(h.to_bytes(32, "big") for h in chunks)


def tuner_for(runner: str, caps=None, **kw) -> WorthTuner:
    _, tuner = worth_index(PLAN, caps or {"cpu": 60 * ROW}, share="learned", placement=HitsLand(PLAN),
                           runner=runner, **kw)
    assert tuner is not None
    return tuner


def fill(tuner: WorthTuner, trace: Trace, hashes=as_bytes) -> None:
    """The window, without tuning (nothing evicted yet)."""
    for r in trace.requests:
        tuner.observe(hashes(r.chunks), r.prompt_tokens, r.input_tokens, False)


def wait_idle(tuner: WorthTuner, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while tuner.busy:
        assert time.monotonic() < end, "the tuning never finished"
        time.sleep(0.01)
    tuner.poll()


def test_the_window_is_bounded_in_bytes():
    # stated bound: (32 + 64) bytes x max_chunks + 8 x (1 + candidates), hashes counted at 32 bytes
    assert WorthTuner.max_memory_bytes(1000) == 96 * 1000 + 8 * (1 + len(GRID))
    tuner = WorthTuner(None, max_chunks=1000, period=10**9)
    n = 0
    trace = head(400)
    longest = max(len(r.chunks) for r in trace.requests)
    for i, r in enumerate(trace.requests):
        tuner.observe(as_bytes(r.chunks), r.prompt_tokens, r.input_tokens, i > 10)
        n += len(r.chunks)
        assert tuner.chunks <= 1000 and len(tuner.window) <= 1000
        assert tuner.chunks == sum(len(c) for c, _, _ in tuner.window)
        assert tuner.memory_bytes <= WorthTuner.max_memory_bytes(1000)
    assert n > 3000 and tuner.chunks > 1000 - longest  # it does keep a window
    assert tuner.tunings == [] and tuner.pid is None


def test_the_shadow_is_replays_loop():
    """One rule: a shadow scores each weight exactly as `kvtier replay --policy worth:w=W` saves
    FLOPs on the same requests: placement hits with the learned share, on one tier and on two;
    every chunk with tail endpoints (cold entries) on two tiers, the second smaller (promotions
    into the first then change what it holds)."""
    trace = head(300)
    cost = CostModel(compute=compute_model(None, PLAN.geometry))
    cases = [({"cpu": 60 * ROW}, "learned", HitsLand(PLAN), None),
             ({"cpu": 30 * ROW, "disk": 60 * ROW}, "learned", HitsLand(PLAN), None),
             ({"cpu": 60 * ROW, "disk": 40 * ROW}, "proportional", None, 2)]
    for caps, share, placement, tail in cases:
        _, tuner = worth_index(PLAN, caps, share=share, placement=placement, tail_endpoints=tail, runner="inline")
        window = tuple((r.chunks, r.prompt_tokens, r.input_tokens) for r in trace.requests)
        got = [shadow_flops(tuner.shadow, window, w) for w in GRID]
        want = [replay(PLAN, trace, caps, f"worth:w={w:g}", share=share, cost=cost, tail_endpoints=tail,
                       placement=HitsLand(PLAN) if placement is not None else None).flops_saved for w in GRID]
        assert got == want and want[0] > 0, (share, got, want)
        assert len(set(want)) > 1  # the weights differ here: the comparison means something


def test_the_job_pickles_whole():
    tuner = tuner_for("inline")
    fill(tuner, head(60))
    job = Job(tuner.shadow, tuner.grid, tuner._ids())
    back = pickle.loads(pickle.dumps(job))
    assert back.scores() == job.scores() and back.window == job.window and back.shadow.plan == PLAN


def test_inline_and_process_runners_adopt_the_same_weight():
    trace = head(500)
    inline, proc = tuner_for("inline"), tuner_for("process")
    try:
        fill(inline, trace, hashes=tuple)  # replay's integer ids
        fill(proc, trace)  # a store's 32-byte hashes: the same window, renumbered
        for _ in range(2):
            inline.tune()
            proc.tune()
            wait_idle(proc)
        assert proc.counts() == inline.counts() == {"worth_tunings": 2, "worth_tunings_skipped": 0,
                                                   "worth_tunings_failed": 0}
        assert proc.tunings == inline.tunings and proc.totals == inline.totals
        assert proc.weight.w == inline.weight.w and inline.totals[0] > 0
        print("tunings", inline.tunings, "totals", inline.totals)
    finally:
        proc.close()


def test_a_tuning_due_while_one_runs_is_skipped_and_observe_does_not_wait():
    trace = head(1200)
    tuner = tuner_for("process", period=1)  # every request with a chunk: a tuning is due
    try:
        fill(tuner, head(800))
        tuner.observe(as_bytes(trace.requests[0].chunks), 512, 512, True)  # the first eviction
        slowest, k = 0.0, 0
        for r in trace.requests[800:]:
            t = time.perf_counter()
            tuner.observe(as_bytes(r.chunks), r.prompt_tokens, r.input_tokens, True)
            slowest = max(slowest, time.perf_counter() - t)
            k += 1
        wait_idle(tuner)
        c = tuner.counts()
        print(c, "slowest observe", slowest)
        assert slowest < 0.05, slowest
        assert c["worth_tunings_failed"] == 0 and c["worth_tunings"] >= 1
        assert c["worth_tunings_skipped"] >= 1
        assert c["worth_tunings"] + c["worth_tunings_skipped"] == k
    finally:
        tuner.close()


def test_a_killed_child_is_a_failed_tuning_and_the_next_one_starts_another():
    tuner = tuner_for("process")
    try:
        fill(tuner, head(500))
        tuner.weight.w = 3.0  # not in the grid: any adoption would change it
        tuner.tune()
        end = time.monotonic() + 30
        while tuner.pid is None:
            assert time.monotonic() < end
            time.sleep(0.001)
        first = tuner.pid
        os.kill(first, signal.SIGKILL)
        wait_idle(tuner)
        assert tuner.counts()["worth_tunings_failed"] == 1 and tuner.counts()["worth_tunings"] == 0
        assert tuner.weight.w == 3.0 and tuner.tunings == []
        tuner.tune()
        wait_idle(tuner)
        assert tuner.counts() == {"worth_tunings": 1, "worth_tunings_skipped": 0, "worth_tunings_failed": 1}
        assert tuner.weight.w in GRID and tuner.pid not in (None, first)
        second = tuner.pid
    finally:
        tuner.close()
    assert tuner.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)  # stopped and reaped


def test_a_shadow_that_fails_in_the_child_is_counted_and_w_kept():
    tuner = tuner_for("process")
    # a shadow the child cannot build (a tier smaller than one chunk): it answers an error
    tuner.shadow = dataclasses.replace(tuner.shadow, capacities={"cpu": 10})
    try:
        fill(tuner, head(50))
        tuner.tune()
        wait_idle(tuner)
        assert tuner.counts()["worth_tunings_failed"] == 1 and tuner.weight.w == 0.0
    finally:
        tuner.close()


def test_auto_is_worth_where_a_group_is_placed():
    llama = make_plan(Geometry((PLAN.geometry.groups[0],), 16), chunk_tokens=512)
    assert default_policy(PLAN, "hits") == default_policy(PLAN, HitsLand(PLAN)) == "worth"
    assert default_policy(PLAN, None) == default_policy(PLAN, "every") == "lru"
    assert default_policy(llama, "hits") == default_policy(llama, HitsLand(llama)) == "lru"
    index, tuner = worth_index(PLAN, {"cpu": 60 * ROW}, share="learned", placement=HitsLand(PLAN), w=2.0)
    assert tuner is None and index.policy_of(1, "cpu").weight.w == 2.0
    with pytest.raises(ConfigError, match="runner='thread' is unknown"):
        worth_index(PLAN, {"cpu": 60 * ROW}, share="learned", placement=None, runner="thread")
