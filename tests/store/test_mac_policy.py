"""What a keyed reader accepts: every header byte is covered (a byte the header does not use must
be zero), and `accept_legacy_macs=False` refuses MAC kinds 1-2 and format 2, accepting only
AES-GMAC in format 3. Disk and Redis: tests/system/test_keyed_integrity.py."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import pytest

from kvtier.errors import ConfigError
from kvtier.store import integrity as I
from kvtier.store import payload as P

pytest.importorskip("cryptography")
pytest.importorskip("blake3")
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

NS = "0123456789abcdef"
SECRET = b"s" * 32
DATA = os.urandom(4096)


def _sealed(data: bytes = DATA) -> P.ChunkHeader:
    return P.seal(P.make_header(NS, b"\x07" * 32, 1, 0, 128, len(data)), data)


def _format_2(data: bytes = DATA) -> bytes:
    """A value's header as kvtier wrote format 2: AES-GMAC under a key from the salt alone."""
    h = _sealed(data)
    h2 = P.ChunkHeader(h.namespace_id, h.chunk_hash, h.group, h.token_start, h.token_end, h.payload_bytes,
                       h.dtype, h.checksum, h.checksum_kind, h.created_ns, P.FORMAT_SALTED, b"", 0, os.urandom(12))
    head = P.encode_header(h2)[:P.HEADER_BODY_BYTES]
    root = hashlib.blake2b(SECRET, digest_size=64, person=b"kvtier-gmac-v1").digest()
    key = hashlib.blake2b(h2.mac_salt, key=root, digest_size=32, person=b"kvtier-gmac-key").digest()
    tag = AESGCM(key).encrypt(bytes(12), b"", head + data)[:16]
    return bytes(head[:P.MAC_AT]) + tag + bytes((P.MAC_GMAC,)) + bytes(head[P.MAC_AT + 17:]) + bytes(4)


def _raw(which: str, data: bytes = DATA) -> bytes:
    """The 128 header bytes of `data` as each writer writes them."""
    if which == "format 2":
        raw = bytearray(_format_2(data))
    elif which == "unkeyed":
        raw = bytearray(P.encode_header(_sealed(data)))
    else:
        kind = {"gmac": P.MAC_GMAC, "blake3": P.MAC_BLAKE3, "blake2b": P.MAC_BLAKE2B}[which]
        raw = bytearray(P.encode_header(I.Keyed(SECRET, kind).sign(_sealed(data), data)))
    struct.pack_into("<I", raw, P.HEADER_BODY_BYTES, zlib.crc32(bytes(raw[:P.HEADER_BODY_BYTES])))
    return bytes(raw)


def _decoded(raw: bytes) -> P.ChunkHeader:
    h = P.decode_header(raw)
    assert isinstance(h, P.ChunkHeader), h
    return h


def _changed(raw: bytes, at: int, mask: int) -> bytes:
    """`raw` with byte `at` xor `mask` and its CRC recomputed (what a writer of the tier can do)."""
    b = bytearray(raw)
    b[at] ^= mask
    struct.pack_into("<I", b, P.HEADER_BODY_BYTES, zlib.crc32(bytes(b[:P.HEADER_BODY_BYTES])))
    return bytes(b)


@pytest.mark.parametrize("which", ["gmac", "format 2", "blake3", "blake2b"])
def test_every_header_byte_is_covered_for_a_keyed_reader(which: str) -> None:
    """Any header byte changed (CRC recomputed) is a miss for a keyed reader: decoding rejects it
    or the MAC fails. Bytes 121..123 (reserved) and, in format 1, 109..120 (the salt) used to be
    dropped by decoding, so the MAC never saw them and the value restored."""
    raw = _raw(which)
    k = I.Keyed(SECRET)
    assert k.check(_decoded(raw), DATA) is None
    restored = []
    for at in range(P.HEADER_BODY_BYTES):
        for mask in (0x01, 0x80):
            h = P.decode_header(_changed(raw, at, mask))
            if isinstance(h, P.ChunkHeader) and k.check(h, DATA) is None:
                restored.append(at)
    assert restored == []


@pytest.mark.parametrize("which", ["unkeyed", "gmac", "format 2", "blake2b"])
def test_a_header_decodes_only_to_its_own_bytes(which: str) -> None:
    """Every header a reader accepts, keyed or not, encodes back to the same 128 bytes: no byte is
    ignored (reserved, a salt without MAC kind 3, MAC bytes without a MAC kind must be zero)."""
    raw = _raw(which)
    for at in range(P.HEADER_BODY_BYTES):
        changed = _changed(raw, at, 0x40)
        h = P.decode_header(changed)
        assert isinstance(h, P.Rejected) or P.encode_header(h) == changed, at


def test_non_zero_reserved_bytes_are_rejected_with_the_reason() -> None:
    for which in ("unkeyed", "gmac", "format 2", "blake3"):
        for at in (121, 122, 123):
            assert P.decode_header(_changed(_raw(which), at, 0x01)) == P.Rejected(
                "reserved header bytes 121..123 are not zero")


@pytest.mark.parametrize("which", ["blake2b", "blake3", "format 2"])
def test_accept_legacy_macs_false_refuses_older_kinds_and_format_2(which: str) -> None:
    h = _decoded(_raw(which))
    assert I.Keyed(SECRET).check(h, DATA) is None  # default: permissive, upgrades keep their cache
    strict = I.Keyed(SECRET, accept_legacy_macs=False)
    assert strict.unverifiable(h) == I.LEGACY_MAC
    assert strict.check(h, DATA) == I.LEGACY_MAC
    assert strict.copy_check(h, DATA, memoryview(bytearray(len(DATA)))) == I.LEGACY_MAC
    # intact, only not acceptable here: a shared tier keeps it (a permissive tenant reads it)
    assert I.mac_only(I.integrity(strict, h, DATA))


def test_accept_legacy_macs_false_still_reads_the_current_format() -> None:
    strict = I.Keyed(SECRET, accept_legacy_macs=False)
    h = _decoded(_raw("gmac"))
    assert (h.mac_kind, h.format_version) == (P.MAC_GMAC, P.FORMAT_BOUND)
    assert strict.check(h, DATA) is None
    dst = memoryview(bytearray(len(DATA)))
    assert strict.copy_check(h, DATA, dst) is None and bytes(dst) == DATA
    s = strict.stream(h)
    s.update(DATA)
    assert s.verdict() is None
    signed = strict.sign(_sealed(), DATA)  # and what it writes it reads
    assert strict.check(_decoded(P.encode_header(signed)), DATA) is None


def test_accept_legacy_macs_false_with_an_older_writing_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"accept_legacy_macs=False.*MAC kind 2.*cryptography"):
        I.Keyed(SECRET, P.MAC_BLAKE3, accept_legacy_macs=False)


def test_the_vllm_key_reaches_the_secret(tmp_path, monkeypatch) -> None:
    from kvtier.integrations.vllm.config import parse_config, tier_secret

    monkeypatch.delenv("KVTIER_SECRET", raising=False)
    monkeypatch.delenv("KVTIER_SECRET_FILE", raising=False)
    f = tmp_path / "secret"
    f.write_bytes(SECRET)
    os.chmod(f, 0o600)
    base = {"kvtier.cpu_bytes": "1MiB", "kvtier.secret_file": str(f)}
    assert parse_config(base).accept_legacy_macs is True
    assert tier_secret(parse_config(base)).accept_legacy_macs is True
    strict = parse_config({**base, "kvtier.accept_legacy_macs": False})
    assert strict.accept_legacy_macs is False
    keyed = tier_secret(strict)
    assert keyed.accept_legacy_macs is False and keyed.check(_decoded(_raw("blake2b")), DATA) == I.LEGACY_MAC
    with pytest.raises(ConfigError, match=r"kvtier.accept_legacy_macs='no' must be true or false"):
        parse_config({**base, "kvtier.accept_legacy_macs": "no"})
    with pytest.raises(ConfigError, match=r"kvtier.accept_legacy_macs=false needs a secret.*kvtier.secret_file"):
        parse_config({"kvtier.cpu_bytes": "1MiB", "kvtier.accept_legacy_macs": False})
    monkeypatch.setenv("KVTIER_SECRET", SECRET.decode())  # the environment's secret counts
    assert tier_secret(parse_config({"kvtier.cpu_bytes": "1MiB",
                                     "kvtier.accept_legacy_macs": False})).accept_legacy_macs is False
