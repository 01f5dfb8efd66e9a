"""The background I/O lane (kvtier.store.lane): FIFO, back-pressure
that drops writes and never waits, and a close that lands what is queued."""

from __future__ import annotations

import threading

from kvtier.store.lane import Lane


def test_runs_in_order_and_drain_waits_for_all() -> None:
    lane, seen = Lane("t", 1 << 20), []
    for i in range(50):
        assert lane.submit(lambda i=i: seen.append(i), write_bytes=i % 3)
    assert lane.drain(10) and seen == list(range(50))
    assert lane.close(10)


def test_writes_past_the_limit_are_dropped_and_an_empty_queue_admits_any_size() -> None:
    gate = threading.Event()
    lane = Lane("t", 100)
    assert lane.submit(lambda: gate.wait(10), write_bytes=1000)  # larger than the limit: admitted
    assert not lane.submit(lambda: None, write_bytes=1)  # queue holds 1000 > 100: dropped
    assert lane.submit(lambda: None)  # a read (no write bytes) is never dropped
    gate.set()
    assert lane.drain(10)
    assert lane.submit(lambda: None, write_bytes=100)  # room again
    assert lane.close(10)


def test_a_failing_task_does_not_stop_the_lane() -> None:
    lane, seen = Lane("t", 100), []
    lane.submit(lambda: 1 / 0)
    lane.submit(lambda: seen.append("after"))
    assert lane.drain(10) and seen == ["after"]
    assert lane.close(10)


def test_close_runs_what_is_queued_then_refuses_more() -> None:
    lane, seen = Lane("t", 1 << 20), []
    for i in range(5):
        lane.submit(lambda i=i: seen.append(i), write_bytes=10)
    assert lane.close(10) and seen == [0, 1, 2, 3, 4]
    assert not lane.submit(lambda: seen.append("late"))
