"""Bounded frequency sketches for admission: a count-min sketch with aging and a Bloom filter,
and `h64`, the 64-bit mix that maps a chunk hash (blake2b bytes, or a trace's int id) to the
integer they probe with. Split from `admission` (the rules) because they are plain data
structures, each with its own bytes stated."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_HALF = bytes(i >> 1 for i in range(256))


def h64(key: bytes | int) -> int:
    if isinstance(key, bytes):
        if len(key) >= 8:
            return int.from_bytes(key[:8], "little")
        key = int.from_bytes(key, "little")
    x = (key * 0x9E3779B97F4A7C15) & _MASK64  # splitmix64 finalizer
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class CountMin:
    """depth x width 8-bit saturating counters; halves all counters every `sample` adds."""

    def __init__(self, width: int, sample: int, depth: int = 4) -> None:
        self.width = 1 << max(4, (width - 1).bit_length())
        self.depth = depth
        self.sample = sample
        self.table = bytearray(self.width * depth)
        self.adds = 0

    def _slots(self, x: int) -> list[int]:
        w, h2 = self.width, (x >> 32) | 1
        return [r * w + ((x + r * h2) & (w - 1)) for r in range(self.depth)]

    def estimate(self, x: int) -> int:
        t = self.table
        return min(t[i] for i in self._slots(x))

    def add(self, x: int) -> None:
        t = self.table
        slots = self._slots(x)
        low = min(t[i] for i in slots)
        if low < 255:
            for i in slots:  # conservative update: only the smallest counters grow
                if t[i] == low:
                    t[i] = low + 1
        self.adds += 1
        if self.adds >= self.sample:
            self.adds = 0
            self.halve()

    def halve(self) -> None:
        """Aging: every counter halves (rounding down), so old counts fade."""
        self.table = bytearray(self.table.translate(_HALF))

    @property
    def memory_bytes(self) -> int:
        return len(self.table)


class Bloom:
    """m bits, k = 3 probes (double hashing)."""

    def __init__(self, bits: int) -> None:
        self.bits = 1 << max(6, (bits - 1).bit_length())
        self.array = bytearray(self.bits // 8)

    def _probes(self, x: int) -> tuple[int, int, int]:
        m, h2 = self.bits - 1, (x >> 32) | 1
        return (x & m, (x + h2) & m, (x + 2 * h2) & m)

    def __contains__(self, x: int) -> bool:
        a = self.array
        return all(a[p >> 3] >> (p & 7) & 1 for p in self._probes(x))

    def add(self, x: int) -> None:
        a = self.array
        for p in self._probes(x):
            a[p >> 3] |= 1 << (p & 7)

    def clear(self) -> None:
        self.array = bytearray(len(self.array))

    @property
    def memory_bytes(self) -> int:
        return len(self.array)
