"""The worth tuner of the product (kvtier.index.tuning): its window is bounded, its shadow is
replay's loop, the child process adopts what the inline runner adopts, a tuning due while one runs
is skipped without work on the caller's thread, and a child that dies, fails or never says hello
costs one counted tuning, never w; a fork starts its own child, and close never waits."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

import kvtier
from kvtier.core.cost import compute_model
from kvtier.core.geometry import Geometry, Group
from kvtier.core.plan import make_plan
from kvtier.errors import ConfigError
from kvtier.index.placement import HitsLand
from kvtier.index import tuning, tuning_child
from kvtier.index.index import Index
from kvtier.index.tuning import (GRID, REQUEST_BYTES, Job, WorthTuner, chunk_count, default_policy,
                                 shadow_flops, worth_index)
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


def wait_child(tuner: WorthTuner, not_pid: int | None = None, timeout: float = 30.0) -> int:
    """The pid of the tuner's child once one runs (another than `not_pid`)."""
    end = time.monotonic() + timeout
    while (pid := tuner.pid) in (None, not_pid):
        assert time.monotonic() < end, "the tuner started no child"
        time.sleep(0.001)
    return pid


def wait_idle(tuner: WorthTuner, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while tuner.busy:
        assert time.monotonic() < end, "the tuning never finished"
        time.sleep(0.01)
        tuner.poll()  # kills a child past its timeout_s
    tuner.poll()


@pytest.fixture(autouse=True)
def normal_priority(monkeypatch):
    """The children of these tests run at normal priority: at idle priority a busy test machine
    (the other xdist worker) could starve them past the waits; one test checks idle."""
    monkeypatch.setattr(tuning_child, "IDLE", False)


def reaped(pid: int, timeout: float = 10.0) -> None:
    """The tuner's thread stops and reaps its child (close does not wait): no zombie stays."""
    end = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < end, "the child was never reaped"
        time.sleep(0.01)


def test_the_window_is_bounded_in_bytes():
    # stated bound: (32 + REQUEST_BYTES) bytes x max_chunks + 8 x (1 + candidates)
    assert WorthTuner.max_memory_bytes(1000) == (32 + REQUEST_BYTES) * 1000 + 8 * (1 + len(GRID))
    tuner = WorthTuner(None, max_chunks=1000, period=10**9)
    n = 0
    trace = head(400)
    longest = max(len(r.chunks) for r in trace.requests)
    for i, r in enumerate(trace.requests):
        tuner.observe(as_bytes(r.chunks), r.prompt_tokens, r.input_tokens, i > 10)
        n += len(r.chunks)
        assert tuner.chunks <= 1000 and len(tuner.window) <= 1000
        assert tuner.chunks == sum(chunk_count(rec) for rec in tuner.window)
        assert all(type(rec) is bytes for rec in tuner.window)  # one object per request
        assert tuner.memory_bytes <= WorthTuner.max_memory_bytes(1000)
    assert n > 3000 and tuner.chunks > 1000 - longest  # it does keep a window
    assert tuner.tunings == [] and tuner.pid is None


def test_the_window_costs_at_most_its_stated_bytes():
    """The worst case, one-chunk requests of 32-byte hashes filling max_chunks: what the window
    allocates (tracemalloc) stays within max_memory_bytes."""
    n = 4096
    hashes = [os.urandom(32) for _ in range(2 * n)]
    tuner = WorthTuner(None, max_chunks=n, period=10**9)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for h in hashes:
            tuner.observe((h,), 100_000, 100_000, False)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert tuner.chunks == len(tuner.window) == n
    assert tuner.memory_bytes <= WorthTuner.max_memory_bytes(n)
    assert n * 32 < used <= WorthTuner.max_memory_bytes(n), (used, WorthTuner.max_memory_bytes(n))
    print("bytes per one-chunk request", used / n)


def test_a_request_longer_than_the_window_keeps_its_prefix():
    tuner = WorthTuner(None, max_chunks=4, period=10**9)
    tuner.observe(as_bytes(range(10)), 5120, 5120, False)
    assert tuner.chunks == 4 and len(tuner.window) == 1
    assert tuning.renumber(tuner.window) == (((0, 1, 2, 3), 5120, 5120),)
    tuner.observe(range(20, 30), 5120, 5120, False)  # integer ids: the same rule
    assert tuning.renumber(tuner.window) == (((0, 1, 2, 3), 5120, 5120),)


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
        _, tuner = worth_index(PLAN, caps, share=share, placement=placement, tail_endpoints=tail, runner="inline",
                               cold_in_first=True)
        window = tuple((r.chunks, r.prompt_tokens, r.input_tokens) for r in trace.requests)
        got = [shadow_flops(tuner.shadow, window, w) for w in GRID]
        want = [replay(PLAN, trace, caps, f"worth:w={w:g}", share=share, cost=cost, tail_endpoints=tail,
                       placement=HitsLand(PLAN) if placement is not None else None).flops_saved for w in GRID]
        assert got == want and want[0] > 0, (share, got, want)
        assert len(set(want)) > 1  # the weights differ here: the comparison means something


def test_with_one_tier_the_product_shadow_stores_no_cold_chunk(monkeypatch):
    """The Store and vLLM skip cold chunks where there is one tier (replay puts them in as first
    victims): the product's shadow (cold_in_first=False) does the same, replay's puts them."""
    trace = head(300)
    window = tuple((r.chunks, r.prompt_tokens, r.input_tokens) for r in trace.requests)
    cold_puts = []
    put = Index.put

    def counting(self, h, g, tier, cold=False, **kw):
        cold_puts.append(cold)
        return put(self, h, g, tier, cold=cold, **kw)

    monkeypatch.setattr(Index, "put", counting)
    for cold_in_first in (False, True):
        cold_puts.clear()
        _, tuner = worth_index(PLAN, {"cpu": 60 * ROW}, share="proportional", placement=None, tail_endpoints=2,
                               runner="inline", cold_in_first=cold_in_first)
        assert tuner.shadow.cold_in_first is cold_in_first
        shadow_flops(tuner.shadow, window, 1.0)
        assert len(cold_puts) > 0 and any(cold_puts) is cold_in_first, cold_in_first


def test_the_job_pickles_whole():
    tuner = tuner_for("inline")
    fill(tuner, head(60))
    job = Job(tuner.shadow, tuner.grid, tuple(tuner.window))
    back = pickle.loads(pickle.dumps(job))
    assert back.scores() == job.scores() and back.window == job.window and back.shadow.plan == PLAN
    back = tuning_child.decode_job(tuning_child.encode_job((job.shadow, job.grid, job.window)))  # the pipe
    assert back == (job.shadow, job.grid, job.window)


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


def test_a_tuning_due_while_one_runs_is_skipped_and_observe_does_no_window_work(monkeypatch):
    """The renumbering and the job's pickling never run on the caller's thread."""
    threads: dict[str, set[int]] = {"renumber": set(), "dumps": set()}
    renumber, dumps = tuning.renumber, pickle.dumps

    def renumbering(*a, **kw):
        threads["renumber"].add(threading.get_ident())
        return renumber(*a, **kw)

    def pickling(*a, **kw):
        threads["dumps"].add(threading.get_ident())
        return dumps(*a, **kw)

    monkeypatch.setattr(tuning, "renumber", renumbering)
    monkeypatch.setattr(pickle, "dumps", pickling)
    trace = head(1200)
    tuner = tuner_for("process", period=1)  # every request with a chunk: a tuning is due
    try:
        fill(tuner, head(800))
        tuner.observe(as_bytes(trace.requests[0].chunks), 512, 512, True)  # the first eviction
        k = 0
        for r in trace.requests[800:]:
            tuner.observe(as_bytes(r.chunks), r.prompt_tokens, r.input_tokens, True)
            k += 1
        wait_idle(tuner)
        c = tuner.counts()
        print(c, threads)
        me = threading.get_ident()
        assert threads["dumps"] and me not in threads["dumps"]  # pickled, on the tuner's thread
        assert not threads["renumber"]  # renumbered in the child
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
        first = wait_child(tuner)
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
    reaped(second)
    assert tuner.pid is None


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
    no_anchor = make_plan(Geometry((Group("swa", "sliding", 1, 16, window=128, bytes_per_token_per_layer=2),
                                    PLAN.geometry.groups[1]), 16), chunk_tokens=512)
    assert default_policy(no_anchor, "hits") == "lru"  # a placed group needs an anchor beside it
    with pytest.raises(ConfigError, match="runner='thread' is unknown"):
        worth_index(PLAN, {"cpu": 60 * ROW}, share="learned", placement=None, runner="thread")


def test_a_window_that_never_evicts_in_a_shadow_is_skipped():
    """Every weight ties where nothing is evicted: one shadow, no adoption, counted skipped."""
    for runner in ("inline", "process"):
        tuner = tuner_for(runner, caps={"cpu": 100_000 * ROW})
        try:
            fill(tuner, head(200))
            tuner.weight.w = 3.0
            tuner.tune()
            wait_idle(tuner)
            assert tuner.counts() == {"worth_tunings": 0, "worth_tunings_skipped": 1,
                                      "worth_tunings_failed": 0}, runner
            assert tuner.weight.w == 3.0 and tuner.totals == [0.0] * len(GRID)
        finally:
            tuner.close()


def test_close_does_not_wait_and_counts_a_tuning_in_flight_failed(monkeypatch):
    monkeypatch.setattr(tuning_child, "IDLE", True)  # the product's child: idle CPU priority
    tuner = tuner_for("process")
    fill(tuner, head(800))
    tuner.tune()
    pid = wait_child(tuner)
    end = time.monotonic() + 30
    while os.sched_getscheduler(pid) != os.SCHED_IDLE:  # it lowers its priority as it starts
        assert time.monotonic() < end
        time.sleep(0.001)
    t = time.perf_counter()
    tuner.close()
    assert time.perf_counter() - t < 0.1
    assert tuner.counts()["worth_tunings_failed"] == 1 and not tuner.busy
    tuner.close()  # idempotent, nothing counted twice
    tuner.poll()
    assert tuner.counts()["worth_tunings_failed"] == 1
    reaped(pid)


def test_reset_forgets_the_window_and_keeps_w_scores_and_child():
    tuner = tuner_for("process")
    try:
        fill(tuner, head(500))
        tuner.observe(as_bytes(head(1).requests[0].chunks), 512, 512, True)
        tuner.tune()
        wait_idle(tuner)
        w, totals, pid = tuner.weight.w, list(tuner.totals), tuner.pid
        assert pid is not None and tuner.started
        tuner.reset()
        assert (len(tuner.window), tuner.chunks, tuner.since, tuner.started) == (0, 0, 0, False)
        assert (tuner.weight.w, tuner.totals, tuner.pid) == (w, totals, pid)
        tuner.tune()  # an empty window: nothing to score
        assert tuner.counts()["worth_tunings"] == 1 and not tuner.busy
    finally:
        tuner.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_copy_starts_its_own_child():
    """A fork while a tuning is in flight: the copy's tuner is idle, tunes with a child of its
    own, and the parent's tuning still finishes."""
    tuner = tuner_for("process")
    try:
        fill(tuner, head(500))
        tuner.tune()
        parent_child = wait_child(tuner)
        pid = os.fork()
        if pid == 0:  # the copy: report through the exit status only
            code = 1
            try:
                if not tuner.busy and tuner.pid is None:
                    code = 2
                    tuner.tune()
                    wait_idle(tuner, timeout=30)
                    if tuner.counts()["worth_tunings"] == 1 and tuner.pid not in (None, parent_child):
                        code = 0
                tuner.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        wait_idle(tuner)
        assert tuner.counts() == {"worth_tunings": 1, "worth_tunings_skipped": 0, "worth_tunings_failed": 0}
        assert tuner.pid == parent_child
    finally:
        tuner.close()


def test_a_child_that_writes_garbage_is_a_failed_tuning(monkeypatch, tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("import sys, time\nsys.stdout.write('hello, not kvtier\\n' * 10)\nsys.stdout.flush()\n"
                    "time.sleep(60)\n")
    monkeypatch.setattr(tuning_child, "command", lambda parent: [sys.executable, str(fake)])
    tuner = tuner_for("process")
    tuner._child.timeout_s = 2.0  # a fake child that says nothing is killed after this
    try:
        fill(tuner, head(200))
        tuner.weight.w = 3.0
        t = time.monotonic()
        tuner.tune()
        wait_idle(tuner, timeout=10)
        assert time.monotonic() - t < 5
        assert tuner.counts()["worth_tunings_failed"] == 1 and tuner.weight.w == 3.0
    finally:
        tuner.close()


def test_a_child_that_hangs_is_killed_after_its_time_and_the_next_tuning_starts_a_new_one(monkeypatch, tmp_path):
    """A child that says hello and then never answers holds no caller: `poll` kills it once
    `timeout_s` has passed (a failed tuning, w kept), and the next tuning starts a fresh child."""
    fake = tmp_path / "hang.py"
    fake.write_text("import sys, time\n"
                    f"sys.stdout.buffer.write({tuning_child.MAGIC!r})\nsys.stdout.flush()\n"
                    "sys.stdin.buffer.read(1)\ntime.sleep(120)\n")
    monkeypatch.setattr(tuning_child, "command", lambda parent: [sys.executable, str(fake)])
    tuner = tuner_for("process")
    tuner._child.timeout_s = 1.0
    try:
        fill(tuner, head(200))
        tuner.weight.w = 3.0
        t = time.monotonic()
        tuner.tune()
        first = wait_child(tuner, timeout=10)  # started, said hello, got its job
        wait_idle(tuner, timeout=10)
        assert 1.0 <= time.monotonic() - t < 5
        assert tuner.counts()["worth_tunings_failed"] == 1 and tuner.weight.w == 3.0
        with pytest.raises(ProcessLookupError):  # killed and reaped
            end = time.monotonic() + 5
            while True:
                os.kill(first, 0)
                assert time.monotonic() < end, "the hung child was not killed"
                time.sleep(0.05)
        tuner.tune()
        wait_child(tuner, not_pid=first, timeout=10)
        wait_idle(tuner, timeout=10)
        assert tuner.counts()["worth_tunings_failed"] == 2
    finally:
        tuner.close()


def test_the_child_gets_no_secrets_and_no_cwd_on_its_path(monkeypatch):
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "hunter2")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    env = tuning_child.child_env()
    assert "KVTIER_REDIS_PASSWORD" not in env and env["LC_ALL"] == "C.UTF-8" and "PATH" in env
    monkeypatch.setattr(tuning_child, "IDLE", True)
    argv = tuning_child.command(os.getpid())
    assert argv == [sys.executable, "-P", "-m", "kvtier.index.tuning", str(os.getpid())]


def test_a_child_whose_parent_is_gone_exits():
    """The watchdog: a child told of a parent that is not its parent exits at once."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a reaped pid: nobody's parent (pid 1 would be pytest's own in some containers)
    argv = tuning_child.command(gone.pid)  # not our pid: as if the parent had died
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=tuning_child.child_env())
    try:
        assert proc.wait(timeout=10) == 0  # its stdin is still open: only the watchdog ends it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def test_close_after_a_finished_tuning_or_racing_its_end_leaves_no_child(monkeypatch):
    """Idle at close: the thread closes the child's pipe and reaps it. Racing the end of a tuning
    (close between the answer and the thread's note that it is done): the same, counted failed."""
    tuner = tuner_for("process")
    fill(tuner, head(300))
    tuner.tune()
    wait_idle(tuner)
    pid = tuner.pid
    assert pid is not None and tuner.counts()["worth_tunings"] == 1
    tuner.close()
    reaped(pid)

    tuner = tuner_for("process")
    run = tuning_child.Child._run
    pids = []

    def racing(self, job):
        done = run(self, job)
        pids.append(self.pid)
        tuner.close()  # the caller closes now, on its own thread in the product
        return done

    monkeypatch.setattr(tuning_child.Child, "_run", racing)
    fill(tuner, head(300))
    tuner.tune()
    end = time.monotonic() + 60
    while not pids:
        assert time.monotonic() < end
        time.sleep(0.01)
    assert pids[0] is not None
    reaped(pids[0])
    tuner.poll()
    assert tuner.counts() == {"worth_tunings": 0, "worth_tunings_skipped": 0, "worth_tunings_failed": 1}
