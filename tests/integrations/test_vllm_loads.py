"""Each request's loads on the scheduler side (LoadLedger in kvtier.integrations.vllm.manager):
which chunks a failed load forgets, and the pins its jobs hold; without an engine."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm.manager import LoadLedger  # noqa: E402

A, B = (b"a", 0), (b"b", 1)


def test_a_failed_load_returns_its_chunks_once() -> None:
    ledger = LoadLedger()
    ledger.started("r", [A, B])
    ledger.mark_failed(["r"])
    ledger.completed("r")
    assert ledger.failing("r")
    ledger.clear_failed()
    assert ledger.failed("r") == [A, B]
    assert ledger.failed("r") == [] and not ledger.busy()


def test_a_request_finished_while_loading_keeps_its_chunks_until_the_load_completes() -> None:
    ledger = LoadLedger()
    ledger.started("r", [A])
    ledger.finished("r")  # an abort: vLLM signals it before the load completes
    ledger.mark_failed(["r"])
    ledger.completed("r")
    ledger.clear_failed()
    assert ledger.failed("r") == [A]


def test_a_load_that_worked_after_the_finish_drops_its_chunks() -> None:
    ledger = LoadLedger()
    ledger.started("r", [A])
    ledger.finished("r")
    assert ledger.busy()
    ledger.completed("r")
    assert not ledger.busy() and ledger.failed("r") == []


def test_chunks_are_kept_until_the_last_load_job_completes() -> None:
    ledger = LoadLedger()
    ledger.started("r", [A])
    ledger.started("r", [A, B])  # a second job: the latest chunks are kept
    ledger.finished("r")
    ledger.completed("r")
    assert ledger.busy()  # one job still in flight
    ledger.completed("r")
    assert not ledger.busy()


def test_a_request_finished_without_a_load_in_flight_drops_its_chunks() -> None:
    ledger = LoadLedger()
    ledger.started("r", [A])
    ledger.completed("r")
    assert ledger.busy()  # kept: a later load_failed may still need them
    ledger.finished("r")
    assert not ledger.busy()


def test_pins_are_released_oldest_first_and_the_latest_names_the_source() -> None:
    ledger = LoadLedger()
    ledger.pinned("k", "disk")
    ledger.pinned("k", "cpu")
    assert ledger.source("k") == "cpu" and ledger.pins() == 2 and ledger.busy()
    assert ledger.unpin("k") == "disk"
    assert ledger.unpin("k") == "cpu"
    assert ledger.unpin("k") is None and ledger.source("k") is None and not ledger.busy()


def test_clear_forgets_loads_and_pins_but_not_the_failed_marks() -> None:
    ledger = LoadLedger()
    ledger.started("r", [A])
    ledger.pinned("k", "cpu")
    ledger.mark_failed(["r"])
    ledger.clear()
    assert not ledger.busy() and ledger.pins() == 0 and ledger.failing("r")
