"""A keyed resident read (`Keyed.copy_check`, the disk tier's mapped path): each MAC_PIECE is
copied into the caller's buffer and MACed from there, so every byte is MACed where the caller will
use it, after it landed; a changed byte anywhere, the last partial piece included, is a miss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.store import integrity as I
from kvtier.store.payload import make_header, seal
from kvtier.store.tiers.base import TierLayout
from kvtier.store.tiers.disk import DiskTier
from kvtier.store.tiers.disk_files import DATA_OFFSET, slab_name

NS = "5a5a5a5a01234567"
SECRET = b"tenant-a-" + b"k" * 23
N = 2 * I.MAC_PIECE + 12345  # two whole pieces and a partial one


def _data(n: int = N, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", [I.MAC_GMAC, I.MAC_BLAKE2B])
@pytest.mark.parametrize("n", [1, 4096, I.MAC_PIECE, 2 * I.MAC_PIECE, N])
def test_copy_check_copies_and_verifies_every_byte(n: int, kind: int) -> None:
    keyed = I.Keyed(SECRET, kind)
    data = _data(n).numpy().tobytes()
    h = keyed.sign(seal(make_header(NS, b"\x01" * 32, 0, 0, 16, n), data), data)
    dst = memoryview(bytearray(n + 7))  # a longer buffer: only its first n bytes are the payload
    assert keyed.copy_check(h, data, dst) is None and bytes(dst[:n]) == data
    assert bytes(dst[n:]) == bytes(7)  # nothing written past the payload
    for at in sorted({0, n // 2, n - 1}):  # the first byte, one in the middle, the last
        bad = bytearray(data)
        bad[at] ^= 0x40
        assert keyed.copy_check(h, bytes(bad), memoryview(bytearray(n))) == I.MAC_MISMATCH, (n, at)


def test_a_keyed_resident_read_refuses_a_byte_changed_anywhere(tmp_path: Path) -> None:
    layout = TierLayout(slot_bytes=(N,), num_slots=(1,))
    tier = DiskTier(tmp_path, layout, NS, keyed=I.Keyed(SECRET))
    header = make_header(NS, b"k" * 32, 0, 0, 16, N)
    data = _data()
    for k, at in enumerate((None, 10, N - 10)):  # intact; a byte changed in the first piece; in the last
        assert tier.write(0, 0, header, data)
        if at is not None:
            with open(tmp_path / NS / slab_name(0, N), "r+b") as f:  # the mapping sees it (MAP_SHARED)
                f.seek(DATA_OFFSET + at)
                b = f.read(1)
                f.seek(DATA_OFFSET + at)
                f.write(bytes([b[0] ^ 1]))
        out = torch.zeros(N, dtype=torch.uint8)
        got = tier.read(0, 0, header, out)
        assert got is (at is None) and tier.corrupt_dropped == k, at
        if got:
            assert torch.equal(out, data)
    assert tier.mapped_reads == 3  # all three through the mapping (resident), not preadv
    tier.close()


def test_the_mac_reads_the_callers_buffer_not_the_source(monkeypatch) -> None:
    """What the caller gets is what was MACed: a copy that lands other bytes than the source holds
    (a writer changing the slot between the copy and a MAC of the source) must fail, so the MAC
    is computed over `dst` after the copy, never over `src`."""
    import numpy as np

    class LandsOtherBytes:
        uint8, frombuffer = np.uint8, staticmethod(np.frombuffer)

        @staticmethod
        def copyto(d, s):  # type: ignore[no-untyped-def]
            np.copyto(d, s)
            d[len(d) // 2] ^= 1

    keyed = I.Keyed(SECRET)
    data = _data().numpy().tobytes()
    h = keyed.sign(seal(make_header(NS, b"\x01" * 32, 0, 0, 16, N), data), data)
    assert keyed.copy_check(h, data, memoryview(bytearray(N))) is None
    monkeypatch.setattr(I, "_np", LandsOtherBytes)
    assert keyed.copy_check(h, data, memoryview(bytearray(N))) == I.MAC_MISMATCH
