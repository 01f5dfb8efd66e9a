"""The tiers' shared rate-limited warning (`base.LogOnce`, issue 28 item 13): the disk and Redis
tiers log a corrupt drop, however many there are, once a minute, with how many were held back."""

from __future__ import annotations

import logging

import pytest

from kvtier.store.tiers import base, redis
from kvtier.store.tiers.base import LogOnce


def test_one_line_per_kind_a_minute_with_the_count_held_back(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    lim = LogOnce(logging.getLogger("kvtier.test.logonce"), lambda: now[0], interval_s=60.0)
    with caplog.at_level("WARNING", logger="kvtier.test.logonce"):
        for _ in range(5):
            lim.warn("corrupt", "dropped")
        lim.warn("other", "other kind")
        now[0] += 59.9
        lim.warn("corrupt", "dropped")
        now[0] += 0.1
        lim.warn("corrupt", "dropped")
    assert [r.getMessage() for r in caplog.records] == [
        "dropped", "other kind", "dropped (5 more like it since the last line)"]


def test_the_redis_tier_logs_through_the_same_helper() -> None:
    assert redis.LogOnce is base.LogOnce
