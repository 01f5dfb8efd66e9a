"""The payload header: round trip, and every kind of bad input is a Rejected value."""

from __future__ import annotations

import struct
import zlib

import pytest

from kvtier.store import payload as P
from kvtier.errors import ConfigError

NS = "0123456789abcdef"


def _sealed(data: bytes, kind: int = P.DEFAULT_CHECKSUM) -> P.ChunkHeader:
    h = P.make_header(NS, b"\x07" * 32, 2, 256, 512, len(data), "bfloat16")
    return P.seal(h, data, kind)


def test_round_trip_keeps_every_field() -> None:
    data = bytes(range(256)) * 8
    h = _sealed(data)
    raw = P.encode_header(h)
    assert len(raw) == P.HEADER_BYTES == 128
    back = P.decode_header(raw)
    assert back == h
    assert P.mismatch(back, h) is None
    assert P.verify(back, data) is None


def test_layout_is_fixed_little_endian() -> None:
    h = _sealed(b"abc")
    raw = P.encode_header(h)
    assert raw[:4] == b"KVTC"
    assert struct.unpack_from("<H", raw, 4)[0] == P.FORMAT_VERSION
    assert raw[8:16] == bytes.fromhex(NS)
    assert struct.unpack_from("<H", raw, 48)[0] == 2  # group
    assert struct.unpack_from("<QQQ", raw, 52) == (256, 512, 3)  # span, length
    assert struct.unpack_from("<I", raw, 124)[0] == zlib.crc32(raw[:124])


@pytest.mark.parametrize("kind", [P.CHECKSUM_CRC32, P.CHECKSUM_XXH3])
def test_checksum_kinds_verify_and_catch_a_flipped_byte(kind: int) -> None:
    if kind == P.CHECKSUM_XXH3 and P._xxhash is None:
        pytest.skip("xxhash not installed")
    data = bytearray(b"kv" * 5000)
    h = _sealed(bytes(data), kind)
    assert P.verify(h, data) is None
    data[1234] ^= 0x01
    assert P.verify(h, data) == "payload checksum mismatch"


def test_truncated_payload_is_rejected() -> None:
    data = b"x" * 100
    h = _sealed(data)
    assert P.verify(h, data[:99]) == "payload truncated: 99 of 100 bytes"


def test_bad_headers_are_values_with_reasons() -> None:
    raw = bytearray(P.encode_header(_sealed(b"abc")))
    assert P.decode_header(raw[:50]) == P.Rejected("header truncated: 50 of 128 bytes")
    assert P.decode_header(bytes(128)) == P.Rejected("empty slot (no header)")
    bad_magic = bytearray(raw)
    bad_magic[0] = ord("X")
    assert P.decode_header(bad_magic) == P.Rejected("bad magic b'XVTC'")
    flipped = bytearray(raw)
    flipped[60] ^= 0x10  # inside the token span
    assert P.decode_header(flipped) == P.Rejected("header checksum mismatch")
    newer = bytearray(raw)
    struct.pack_into("<H", newer, 4, P.FORMAT_BOUND + 1)
    struct.pack_into("<I", newer, 124, zlib.crc32(bytes(newer[:124])))
    r = P.decode_header(newer)
    assert isinstance(r, P.Rejected) and r.reason.startswith("newer format version 4")


def test_mismatch_names_the_foreign_field() -> None:
    h = _sealed(b"abc")
    other_ns = P.make_header("fedcba9876543210", b"\x07" * 32, 2, 256, 512, 3, "bfloat16")
    assert P.mismatch(h, other_ns) == f"foreign namespace {NS} (expected fedcba9876543210)"
    other_group = P.make_header(NS, b"\x07" * 32, 1, 256, 512, 3, "bfloat16")
    assert P.mismatch(h, other_group) == "group 2 (expected 1)"
    other_len = P.make_header(NS, b"\x07" * 32, 2, 256, 512, 4, "bfloat16")
    assert P.mismatch(h, other_len) == "3 payload bytes (expected 4)"


def test_torch_tensor_is_checksummed_without_copy() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    h = P.seal(P.make_header(NS, b"h", 0, 0, 16, t.numel()), t)
    assert P.verify(h, t.numpy().tobytes()) is None


def test_caller_mistakes_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="16 hex digits"):
        P.make_header("abc", b"h", 0, 0, 1, 1)
    with pytest.raises(ConfigError, match="dtype 'float64' unknown"):
        P.make_header(NS, b"h", 0, 0, 1, 1, "float64")
