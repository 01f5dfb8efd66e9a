"""kvtier.store._xxcopy: one-pass copy + XXH3-64, bit for bit python-xxhash's value."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvtier.store import payload

xx = payload._xxcopy

# every length class of the long path: 241 (shortest), each stripe count of the first block,
# block boundaries (1024 = 16 stripes; (len - 1) // 1024 decides the last block), and large ones
LENGTHS = [*range(241, 1300), 2047, 2048, 2049, 3072, 3073, 65536, 65537, (1 << 20) + 123, 8 << 20]


def test_the_extension_is_built_where_make_test_runs() -> None:
    # `pip install -e .` compiles it (setup.py); without it the disk tier's loads take the slower
    # two-pass path, which the other tests cover with the extension switched off
    assert xx is not None, "kvtier.store._xxcopy was not compiled: reinstall with `pip install -e .` (needs gcc)"


@pytest.mark.parametrize("simd", [True, False])
def test_copy_and_hash_equal_python_xxhash_and_a_plain_copy(simd: bool) -> None:
    rng = np.random.default_rng(7)
    for n in LENGTHS:
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        want = xxhash.xxh3_64_intdigest(src)
        assert xx.copy_xxh3(dst, src, simd=simd) == want, n
        assert np.array_equal(dst, src), n
        assert xx.xxh3(src, simd=simd) == want, n


def test_a_flipped_bit_anywhere_changes_the_value() -> None:
    src = np.random.default_rng(8).integers(0, 256, 5000, dtype=np.uint8)
    base = xx.xxh3(src)
    for pos in (0, 63, 64, 1023, 1024, 4935, 4936, 4999):  # first/last stripe, block edge, tail
        bad = src.copy()
        bad[pos] ^= 1
        assert xx.xxh3(bad) != base and xx.xxh3(bad) == xxhash.xxh3_64_intdigest(bad), pos


def test_reads_from_a_read_only_buffer_and_refuses_bad_lengths() -> None:
    src = bytes(range(256)) * 4
    dst = bytearray(len(src))
    assert xx.copy_xxh3(dst, memoryview(src)) == xxhash.xxh3_64_intdigest(src) and dst == src
    with pytest.raises(ValueError, match="equal lengths above 240 bytes"):
        xx.copy_xxh3(bytearray(1000), src)
    with pytest.raises(ValueError, match="equal lengths above 240 bytes"):
        xx.copy_xxh3(bytearray(200), src[:200])
    with pytest.raises(TypeError):
        xx.copy_xxh3(src, src)  # the destination must be writable


def test_payload_checksum_and_copy_checksum_agree_with_python_xxhash() -> None:
    for n in (1, 240, 241, 4096, 100_000):
        data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        assert payload.checksum(data) == xxhash.xxh3_64_intdigest(data)
        dst = bytearray(n)
        got = payload.copy_checksum(memoryview(dst), memoryview(data), payload.CHECKSUM_XXH3)
        if n < payload.FUSED_MIN_BYTES:
            assert got is None and dst == bytearray(n)  # the caller copies and hashes
        else:
            assert got == xxhash.xxh3_64_intdigest(data) and bytes(dst) == data.tobytes()
    assert payload.copy_checksum(memoryview(bytearray(4096)), memoryview(bytes(4096)), payload.CHECKSUM_CRC32) is None


def test_pwrite_xxh3_over_pieces_equals_the_one_shot_value(tmp_path) -> None:
    import os

    rng = np.random.default_rng(9)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        for n in (241, 1024, 1025, 2048, 2049, 5000, 65536, 100_000):
            src = rng.integers(0, 256, n, dtype=np.uint8)
            want = xxhash.xxh3_64_intdigest(src)
            for piece in (1024, 4096, 65536):  # every piece boundary on or past the last block
                assert xx.pwrite_xxh3(fd, src, 0, piece) == want, (n, piece)
                assert os.pread(fd, n, 0) == src.tobytes(), (n, piece)
    finally:
        os.close(fd)


def test_pwrite_xxh3_writes_every_byte_and_returns_the_checksum(tmp_path) -> None:
    import os

    rng = np.random.default_rng(10)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        for n, piece in ((241, 1024), (5000, 1024), (1 << 20, 1 << 18), ((3 << 20) + 77, 1 << 20)):
            src = rng.integers(0, 256, n, dtype=np.uint8)
            assert xx.pwrite_xxh3(fd, src, 4096, piece) == xxhash.xxh3_64_intdigest(src)
            assert os.pread(fd, n, 4096) == src.tobytes()
        with pytest.raises(ValueError, match="positive multiple of 1024"):
            xx.pwrite_xxh3(fd, bytes(5000), 0, 1000)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:  # no such descriptor: the errno comes back as OSError
        xx.pwrite_xxh3(1 << 24, bytes(5000), 0, 1024)
    assert err.value.errno == 9  # EBADF


def test_checksum_without_the_extension_is_the_same_value(monkeypatch) -> None:
    monkeypatch.setattr(payload, "_xxcopy", None)  # as where it was not compiled
    for n in (1, 240, 241, 100_000):
        data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        assert payload.checksum(data) == xxhash.xxh3_64_intdigest(data), n
