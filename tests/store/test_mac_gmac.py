"""The AES-GMAC kind of the keyed MAC (integrity.MAC_GMAC, header format 3): what it covers, that
every value gets its own key (bound to its whole header), and that values MACed by the older kinds
and the older format 2 (key from the salt alone) still restore."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvtier.store import integrity as I
from kvtier.store import payload as P

pytest.importorskip("cryptography")
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

NS = "0123456789abcdef"
SECRET = b"s" * 32


def _signed(data: bytes, keyed: I.Keyed | None = None) -> tuple[P.ChunkHeader, I.Keyed]:
    k = keyed or I.Keyed(SECRET)
    h = P.seal(P.make_header(NS, b"\x07" * 32, 1, 0, 128, len(data)), data)
    return k.sign(h, data), k


def _through_bytes(h: P.ChunkHeader) -> P.ChunkHeader:
    got = P.decode_header(P.encode_header(h))
    assert isinstance(got, P.ChunkHeader), got
    return got


def test_a_keyed_write_is_gmac_in_format_3_and_round_trips() -> None:
    data = os.urandom(300_000)
    h, k = _signed(data)
    assert (h.mac_kind, len(h.mac), len(h.mac_salt)) == (P.MAC_GMAC, 16, 12)
    raw = P.encode_header(h)
    assert int.from_bytes(raw[4:6], "little") == P.FORMAT_BOUND
    back = _through_bytes(h)
    assert (back.mac, back.mac_salt, back.mac_kind) == (h.mac, h.mac_salt, P.MAC_GMAC)
    assert k.check(back, data) is None
    dst = memoryview(bytearray(len(data)))
    assert k.copy_check(back, data, dst) is None and bytes(dst) == data
    s = k.stream(back)
    for a in range(0, len(data), 4096):
        s.update(data[a:a + 4096])
    assert s.verdict() is None


def test_the_mac_is_the_gcm_tag_over_header_and_payload_under_the_values_own_key() -> None:
    """Pins the construction against an independent computation (the one-shot AEAD API): a key
    derived from the secret and the 124 header bytes with checksum, MAC and kind zeroed (salt
    kept), nonce zero, associated data = those header bytes with the checksum, then the payload.
    Both ways of writing (sign after seal, and the one-pass Keyed.seal) give it."""
    data = os.urandom(70_000)
    h, k = _signed(data)
    for raw in (P.encode_header(h), k.seal(P.make_header(NS, b"\x07" * 32, 1, 0, 128, len(data)), data)):
        assert raw is not None
        got = P.decode_header(raw)
        assert isinstance(got, P.ChunkHeader)
        head = bytearray(raw[:P.HEADER_BODY_BYTES])
        head[92:109] = bytes(17)  # MAC and MAC kind
        root = hashlib.blake2b(SECRET, digest_size=64, person=b"kvtier-gmac-v1").digest()
        unsummed = bytes(head[:76]) + bytes(8) + bytes(head[84:])  # the checksum zeroed too
        key = hashlib.blake2b(unsummed, key=root, digest_size=32, person=b"kvtier-gmac-k3").digest()
        assert AESGCM(key).encrypt(bytes(12), b"", bytes(head) + data)[:16] == got.mac


# A known answer: a fixed secret, header and payload, and the tag kvtier wrote for them before
# issue 41 (the hand-written C GMAC) and writes since (OpenSSL through `cryptography`).
KAT_SECRET = bytes(range(32))
KAT_DATA = bytes((i * 7 + 3) & 0xFF for i in range(1000))
KAT_CHECKSUM = 0x6C4F14BD97BD9E82
KAT_TAG = bytes.fromhex("9ec4a1279779ba6e3ea0bc9ec821a5bc")


def _kat_header() -> P.ChunkHeader:
    return P.ChunkHeader(NS, bytes(range(32)), 2, 64, 128, len(KAT_DATA), "bfloat16", KAT_CHECKSUM,
                         P.CHECKSUM_XXH3, 1_700_000_000_123_456_789, P.FORMAT_BOUND, b"", 0,
                         bytes(range(100, 112)))


def _independent_tag(secret: bytes, head: bytes, data: bytes) -> bytes:
    """The format 3 construction written out with the one-shot AEAD API and nothing of kvtier's:
    root key = BLAKE2b-512(secret, person "kvtier-gmac-v1"); value key = keyed BLAKE2b-256 over
    the 124 covered header bytes with the checksum zeroed (person "kvtier-gmac-k3"); tag = the
    AES-256-GCM tag, nonce zero, nothing encrypted, associated data = covered header + payload."""
    root = hashlib.blake2b(secret, digest_size=64, person=b"kvtier-gmac-v1").digest()
    key = hashlib.blake2b(head[:76] + bytes(8) + head[84:], key=root, digest_size=32,
                          person=b"kvtier-gmac-k3").digest()
    return AESGCM(key).encrypt(bytes(12), b"", head + data)[:16]


def test_a_known_answer_pins_the_tag_bit_for_bit() -> None:
    """kvtier's MAC of the fixed value equals the independent construction and the tag written
    before the change; the value verifies on every read path, and one changed payload bit or
    header field fails it."""
    h = _kat_header()
    assert P.checksum(KAT_DATA) == KAT_CHECKSUM
    head = P.encode_header(h)[:P.HEADER_BODY_BYTES]
    assert _independent_tag(KAT_SECRET, head, KAT_DATA) == KAT_TAG
    k = I.Keyed(KAT_SECRET)
    assert k.mac(h, KAT_DATA) == KAT_TAG
    signed = _through_bytes(P.ChunkHeader(**{**_fields(h), "mac": KAT_TAG, "mac_kind": P.MAC_GMAC}))
    assert k.check(signed, KAT_DATA) is None
    dst = memoryview(bytearray(len(KAT_DATA)))
    assert k.copy_check(signed, KAT_DATA, dst) is None and bytes(dst) == KAT_DATA
    s = k.stream(signed)
    for a in range(0, len(KAT_DATA), 7):
        s.update(KAT_DATA[a:a + 7])
    assert s.verdict() is None
    bad = bytearray(KAT_DATA)
    bad[500] ^= 0x10
    assert k.check(signed, bytes(bad)) == I.MAC_MISMATCH
    moved = P.ChunkHeader(**{**_fields(signed), "token_start": 0})
    assert k.check(moved, KAT_DATA) == I.MAC_MISMATCH


@pytest.mark.parametrize("n", [1, 15, 16, 240, 241, 1000, 65_537])
def test_the_one_call_seal_writes_what_the_independent_construction_gives(n: int) -> None:
    """`Keyed.seal` (a keyed save's header in one call) at every length, short payloads included:
    its tag is the independent construction's over the header it wrote, and it is what sign
    after seal would write for the same salt and time."""
    data = os.urandom(n)
    k = I.Keyed(SECRET)
    raw = k.seal(P.make_header(NS, b"\x07" * 32, 1, 0, 128, n), data)
    assert raw is not None and len(raw) == P.HEADER_BYTES
    got = P.decode_header(raw)
    assert isinstance(got, P.ChunkHeader) and got.format_version == P.FORMAT_BOUND
    assert got.checksum == P.checksum(data) and got.mac_kind == P.MAC_GMAC
    head = bytearray(raw[:P.HEADER_BODY_BYTES])
    head[92:109] = bytes(17)
    assert _independent_tag(SECRET, bytes(head), data) == got.mac
    assert k.check(got, data) is None


def test_a_repeated_salt_reuses_no_key_unless_the_whole_header_repeats() -> None:
    """Format 3 binds the GMAC key to the header: two values that draw the same salt (a 96-bit
    birthday, ~2^-32 after 2^32 values) but differ in chunk, span or creation time get different
    keys; format 2 (key from the salt alone, read only) gave them one."""
    k = I.Keyed(SECRET)
    salt = os.urandom(12)
    base = P.ChunkHeader(NS, b"\x07" * 32, 1, 0, 128, 4096, "uint8", 5, P.CHECKSUM_XXH3, 1000, P.FORMAT_BOUND,
                         b"", 0, salt)
    others = [P.ChunkHeader(**{**_fields(base), f: v}) for f, v in
              (("chunk_hash", b"\x08" * 32), ("token_start", 128), ("created_ns", 1001), ("group", 2))]
    keys = {k._gmac_key(h, P.encode_header(h)[:P.HEADER_BODY_BYTES]) for h in [base, *others]}
    assert len(keys) == 5
    old = [P.ChunkHeader(**{**_fields(h), "format_version": P.FORMAT_SALTED}) for h in [base, *others]]
    assert len({k._gmac_key(h, P.encode_header(h)[:P.HEADER_BODY_BYTES]) for h in old}) == 1
    same = P.ChunkHeader(**{**_fields(base), "checksum": 99})  # the checksum is not in the key
    assert k._gmac_key(same, P.encode_header(same)[:P.HEADER_BODY_BYTES]) in keys


def test_format_2_values_still_restore() -> None:
    """A value written in format 2 (the GMAC key from the salt alone) verifies on every path; a
    changed byte fails it."""
    data = os.urandom(300_001)
    k = I.Keyed(SECRET)
    sealed = P.seal(P.make_header(NS, b"\x07" * 32, 1, 0, 128, len(data)), data)
    h2 = P.ChunkHeader(**{**_fields(sealed), "format_version": P.FORMAT_SALTED, "mac_salt": os.urandom(12)})
    head = P.encode_header(h2)[:P.HEADER_BODY_BYTES]
    assert int.from_bytes(head[4:6], "little") == P.FORMAT_SALTED
    root = hashlib.blake2b(SECRET, digest_size=64, person=b"kvtier-gmac-v1").digest()
    key = hashlib.blake2b(h2.mac_salt, key=root, digest_size=32, person=b"kvtier-gmac-key").digest()
    tag = AESGCM(key).encrypt(bytes(12), b"", head + data)[:16]
    back = _through_bytes(P.ChunkHeader(**{**_fields(h2), "mac": tag, "mac_kind": P.MAC_GMAC}))
    assert back.format_version == P.FORMAT_SALTED
    assert k.check(back, data) is None
    dst = memoryview(bytearray(len(data)))
    assert k.copy_check(back, data, dst) is None and bytes(dst) == data
    s = k.stream(back)
    s.update(data)
    assert s.verdict() is None
    bad = bytearray(data)
    bad[-1] ^= 1
    assert k.check(back, bytes(bad)) == I.MAC_MISMATCH


def test_every_value_gets_its_own_salt_so_no_gcm_key_tags_two_values() -> None:
    data = b"x" * 4096
    salts = {_signed(data)[0].mac_salt for _ in range(200)}
    assert len(salts) == 200
    assert bytes(12) not in salts


@pytest.mark.parametrize("where", ["payload", "salt", "header", "mac"])
def test_any_changed_byte_fails_the_mac(where: str) -> None:
    data = bytearray(os.urandom(50_000))
    h, k = _signed(bytes(data))
    if where == "payload":
        data[31_337] ^= 1
    elif where == "salt":
        h = P.ChunkHeader(**{**_fields(h), "mac_salt": bytes([h.mac_salt[0] ^ 1]) + h.mac_salt[1:]})
    elif where == "header":
        h = P.ChunkHeader(**{**_fields(h), "token_end": h.token_end + 128})
    else:
        h = P.ChunkHeader(**{**_fields(h), "mac": bytes([h.mac[0] ^ 1]) + h.mac[1:]})
    h = _through_bytes(h)
    assert k.check(h, bytes(data)) == I.MAC_MISMATCH
    assert k.copy_check(h, bytes(data), memoryview(bytearray(len(data)))) == I.MAC_MISMATCH


def test_another_tenants_secret_does_not_verify_and_is_a_mac_only_miss() -> None:
    data = os.urandom(10_000)
    h, _ = _signed(data)
    why = I.integrity(I.Keyed(b"t" * 32), h, data)
    assert why == I.MAC_MISMATCH and I.mac_only(why)


@pytest.mark.parametrize("kind", [P.MAC_BLAKE3, P.MAC_BLAKE2B])
def test_values_macd_by_the_older_kinds_still_restore(kind: int) -> None:
    pytest.importorskip("blake3")
    data = os.urandom(100_000)
    old, _ = _signed(data, I.Keyed(SECRET, kind=kind))
    raw = P.encode_header(old)
    assert int.from_bytes(raw[4:6], "little") == P.FORMAT_VERSION and raw[109:124] == bytes(15)
    reader = I.Keyed(SECRET)  # writes GMAC, reads every kind
    assert reader.kind == P.MAC_GMAC
    assert reader.check(_through_bytes(old), data) is None
    data2 = bytearray(data)
    data2[0] ^= 1
    assert reader.check(_through_bytes(old), bytes(data2)) == I.MAC_MISMATCH


def test_a_salt_only_comes_with_the_gmac_kind() -> None:
    """A format-2 or -3 header must carry MAC kind 3 and a kind-3 MAC a format-2 or -3 header: a
    header that mixes them is rejected (a corrupt miss), never checked under the wrong rule."""
    import struct
    import zlib

    data = os.urandom(1000)
    h, _ = _signed(data)
    raw = bytearray(P.encode_header(h))
    raw[108] = P.MAC_BLAKE3
    struct.pack_into("<I", raw, 124, zlib.crc32(bytes(raw[:124])))
    assert P.decode_header(raw) == P.Rejected("MAC kind 2 in a format 3 header")
    raw = bytearray(P.encode_header(h))
    struct.pack_into("<H", raw, 4, P.FORMAT_VERSION)
    struct.pack_into("<I", raw, 124, zlib.crc32(bytes(raw[:124])))
    assert P.decode_header(raw) == P.Rejected("MAC kind 3 in a format 1 header")


def test_unkeyed_values_stay_format_1() -> None:
    h = P.seal(P.make_header(NS, b"\x07" * 32, 1, 0, 128, 3), b"abc")
    raw = P.encode_header(h)
    assert int.from_bytes(raw[4:6], "little") == P.FORMAT_VERSION and raw[92:124] == bytes(32)


def _fields(h: P.ChunkHeader) -> dict:
    return {f: getattr(h, f) for f in P.ChunkHeader.__slots__}
