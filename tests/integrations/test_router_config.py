"""The router's settings are checked when it starts (a one-line error naming the value and the
fix), and the disk event journal's counts reach vLLM's /metrics path (stats.py's families)."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.router import PrefixIndex, Subscriber


@pytest.mark.parametrize("name", ["replay_interval_s", "replay_timeout_s"])
@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, "10", None, True])
def test_a_bad_replay_interval_or_timeout_is_a_one_line_error(name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Subscriber(PrefixIndex(), {"e0": "tcp://127.0.0.1:1"}, **{name: value})
    msg = str(info.value)
    assert msg.startswith(f"Subscriber {name}={value!r}: give seconds as a finite number >= 0"), msg
    assert "\n" not in msg


@pytest.mark.parametrize("value", [0, 0.25, 10])
def test_a_replay_interval_of_zero_or_more_seconds_is_taken(value: float) -> None:
    Subscriber(PrefixIndex(), {"e0": "tcp://127.0.0.1:1"}, replay_interval_s=value).close()


def test_the_disk_journals_counts_reach_the_metrics_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry
    from test_vllm_journal import _disk_stored, _tracker
    from test_vllm_stats import _registry_types, _vllm_config

    from kvtier.integrations.vllm.connector import KvtierConnector
    from kvtier.integrations.vllm.counters import Metrics
    from kvtier.integrations.vllm.events import DiskJournal
    from kvtier.integrations.vllm.stats import merge

    metrics = Metrics("scheduler", None)
    journal = DiskJournal(tmp_path, metrics)
    t, keys = _tracker(journal, 2)

    def full(fd, data):  # noqa: ANN001, ANN202 - a full file system
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    t.take_events(_disk_stored(keys))
    monkeypatch.undo()
    assert journal.errors == 1 and metrics.counts["disk_journal_errors"] == 1
    monkeypatch.setattr(DiskJournal, "MAX_BYTES", 64)
    capped = DiskJournal(tmp_path / "capped", metrics)
    (tmp_path / "capped").mkdir()
    _tracker(capped, 4)[0].take_events(_disk_stored(_tracker(None, 4)[1]))
    assert capped.full == 1 and metrics.counts["disk_journal_full"] == 1
    # the scheduler's step payload, across the process hop, into Prometheus
    stats = merge(None, metrics.take_delta())
    reg = CollectorRegistry()
    prom = KvtierConnector.build_prom_metrics(_vllm_config(), _registry_types(reg), ["engine"], {0: ["0"]})
    prom.observe(stats.to_dict(), 0)
    assert reg.get_sample_value("vllm:kvtier_disk_journal_errors_total", {"engine": "0"}) == 1
    assert reg.get_sample_value("vllm:kvtier_disk_journal_full_total", {"engine": "0"}) == 1
    assert reg.get_sample_value("vllm:kvtier_disk_journal_bad_records_total", {"engine": "0"}) == 0


def test_announce_adopted_binds_the_managers_counters(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    import msgspec
    from test_vllm_journal import _manager, _tracker

    from kvtier.integrations.vllm import events as events_mod
    from kvtier.integrations.vllm.events import DiskJournal, _frame

    m = _manager(tmp_path)
    journal = DiskJournal(tmp_path)
    bad = ["+", b"k" * 32, "not a list", None, [], "16", None, None, 0, "full_attention", None]
    journal.path.write_bytes(_frame(msgspec.msgpack.encode(bad)))
    events_mod.announce_adopted(m, _tracker(journal, 0)[0], journal)
    assert journal.metrics is m.metrics
    assert m.metrics.counts["disk_journal_bad_records"] == 1
