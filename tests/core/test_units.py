"""One size table for every place that reads a byte count (replay CLI, vLLM kvtier.*_bytes)."""

from __future__ import annotations

import pytest

from kvtier.core.units import human_bytes, parse_bytes


@pytest.mark.parametrize(("text", "expected"), [
    ("1234", 1234), ("64K", 64_000), ("64kb", 64_000), ("8MiB", 8 * 2**20), ("1.5GB", 1_500_000_000),
    ("2 GiB", 2 * 2**30), ("1T", 10**12), ("0", 0),
])
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "5XB", "1..2G", "ten"])
def test_parse_bytes_refuses(text: str) -> None:
    assert parse_bytes(text) is None


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (512, 1536, 3 * 2**30)] == ["512 B", "1.5 KiB", "3.0 GiB"]
