"""Byte counts as people write them (`4GiB`, `500M`, `1.5GB`) and as kvtier prints them.

One table for every place that reads a size (the replay CLI, vLLM's `kvtier.*_bytes` keys), so
`500M` means the same bytes everywhere: K/M/G/T and KB/MB/GB/TB are powers of 1000, KiB/MiB/
GiB/TiB powers of 1024 (case-insensitive).
"""

from __future__ import annotations

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6,
          "MIB": 2**20, "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12,
          "TIB": 2**40}
UNIT_NAMES = "K, M, G, T, KB, MB, GB, TB, KiB, MiB, GiB, TiB"


def parse_bytes(text: str) -> int | None:
    """Bytes of `text`, or None when it is not a number with a known unit (the caller words the
    error: it knows which option or key it was). Zero and negative values are returned as such."""
    s = text.strip()
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    try:
        value = float(s[:i].strip())
    except ValueError:
        return None
    unit = _UNITS.get(s[i:].upper())
    return None if unit is None else int(value * unit)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
