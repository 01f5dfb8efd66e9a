"""AES-256-GMAC in C (kvtier.store._xxcopy, _ghash.h): bit for bit cryptography's GCM tag, alone,
fused with a copy, and fused with the XXH3-64 checksum that seals a payload."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from kvtier.store import integrity
from kvtier.store.integrity import MAC_MISMATCH, Keyed
from kvtier.store.payload import MAC_AT, MAC_GMAC, ChunkHeader, seal

gm = integrity._gmac_c
needs_c = pytest.mark.skipif(gm is None, reason="kvtier.store._xxcopy not built or no AES-NI/PCLMULQDQ here")
MODES = list(range(1, gm.gmac_mode() + 1)) if gm is not None else []
# the header's length decides where the payload's first bytes fall in a block (124: kvtier's);
# payload lengths cover every tail of a block, one and several 512-byte steps of the wide kernel
HEADS = [0, 5, 16, 124, 128]
LENGTHS = [*range(0, 70), 511, 512, 513, 1036, 4096, 65543, (1 << 20) + 5]


def reference(key: bytes, head: bytes, src: object) -> bytes:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    e = Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()
    e.authenticate_additional_data(head)
    e.authenticate_additional_data(bytes(memoryview(src)))  # type: ignore[arg-type]
    e.finalize()
    return e.tag  # type: ignore[no-any-return]


def test_the_extension_runs_where_make_test_runs() -> None:
    # `pip install -e .` compiles it (setup.py); every x86-64 build machine has AES-NI and PCLMULQDQ
    import platform

    from kvtier.store import _xxcopy

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the GHASH kernels are x86-64 only; on {platform.machine()} cryptography computes the tags")

    assert _xxcopy.gmac_mode() >= 1, "kvtier.store._xxcopy found no AES-NI/PCLMULQDQ on this x86-64 CPU"


@needs_c
@pytest.mark.parametrize("mode", MODES)
def test_tags_equal_cryptography_and_the_copy_is_exact(mode: int) -> None:
    rng = np.random.default_rng(3)
    for hlen in HEADS:
        for n in LENGTHS:
            key, head = os.urandom(32), os.urandom(hlen)
            src = rng.integers(0, 256, n, dtype=np.uint8)
            dst = np.zeros(n, dtype=np.uint8)
            want = reference(key, head, src)
            assert gm.gmac(key, head, src, dst, mode) == want, (hlen, n)
            assert np.array_equal(dst, src), (hlen, n)
            assert gm.gmac(key, head, src, None, mode) == want, (hlen, n)


@needs_c
@pytest.mark.parametrize("mode", MODES)
def test_sealing_tags_equal_cryptography_over_the_header_with_its_checksum(mode: int) -> None:
    """seal_gmac's one pass: XXH3-64 of the payload, and the tag of the header with that checksum
    written into it, then the payload: the tag cryptography gives for those bytes."""
    rng = np.random.default_rng(6)
    for hlen, at in ((124, 76), (128, 0), (100, 92), (33, 25), (16, 8)):
        for n in [241, 242, 255, 256, 257, 1023, 1024, 1025, 16380, 16384, 16388, 16400, 70001,
                  (256 << 10) + 3, 1 << 20]:
            key, head = os.urandom(32), bytearray(os.urandom(hlen))
            head[at:at + 8] = bytes(8)
            src = rng.integers(0, 256, n, dtype=np.uint8)
            value, tag = gm.seal_gmac(key, bytes(head), src, at, mode)
            assert value == xxhash.xxh3_64_intdigest(src), (hlen, n)
            head[at:at + 8] = value.to_bytes(8, "little")
            assert tag == reference(key, bytes(head), src), (hlen, n)
    with pytest.raises(ValueError, match="240"):
        gm.seal_gmac(bytes(32), bytes(124), np.zeros(240, np.uint8), 76)
    for at in (120, -1, (1 << 63) - 8, (1 << 63) - 1):  # past the head, or overflowing at + 8
        with pytest.raises((ValueError, OverflowError), match="checksum bytes|too large|overflow"):
            gm.seal_gmac(bytes(32), bytes(124), np.zeros(300, np.uint8), at)
    with pytest.raises(ValueError, match="checksum bytes"):
        gm.seal_gmac(bytes(32), bytes(4), np.zeros(300, np.uint8), 0)


@needs_c
def test_any_changed_bit_of_key_header_or_payload_changes_the_tag() -> None:
    rng = np.random.default_rng(4)
    key, head = bytearray(os.urandom(32)), bytearray(os.urandom(124))
    src = rng.integers(0, 256, 3 * 512 + 37, dtype=np.uint8)
    base = gm.gmac(bytes(key), bytes(head), src)
    for pos in (0, 3, 4, 15, 16, 511, 512, 1536, len(src) - 1):  # the shared block, steps, tail
        bad = src.copy()
        bad[pos] ^= 1
        assert gm.gmac(bytes(key), bytes(head), bad) != base, pos
    for pos in (0, 111, 112, 123):
        h = bytearray(head)
        h[pos] ^= 0x80
        assert gm.gmac(bytes(key), bytes(h), src) != base, pos
    key[31] ^= 1
    assert gm.gmac(bytes(key), bytes(head), src) != base


@needs_c
def test_bad_arguments_are_one_line_errors() -> None:
    src = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="32-byte key"):
        gm.gmac(b"short", b"", src)
    with pytest.raises(ValueError, match="length"):
        gm.gmac(bytes(32), b"", src, np.zeros(99, np.uint8))
    with pytest.raises(ValueError, match="mode"):
        gm.gmac(bytes(32), b"", src, None, gm.gmac_mode() + 1)


@needs_c
def test_keyed_values_cross_the_c_and_cryptography_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value signed by the C path verifies through cryptography's, and the other way round; a
    forged byte fails both, and copy_check lands the exact bytes."""
    k = Keyed(os.urandom(32), kind=MAC_GMAC)
    data = np.random.default_rng(5).integers(0, 256, (256 << 10) + 9, dtype=np.uint8)
    h = seal(ChunkHeader("0123456789abcdef", b"\x07" * 16, 0, 0, 256, data.size, "uint8"), data)
    signed_c = k.sign(h, data)
    with monkeypatch.context() as m:
        m.setattr(integrity, "_gmac_c", None)
        signed_py = k.sign(h, data)
        assert k.check(signed_c, data) is None
        dst = np.zeros_like(data)
        assert k.copy_check(signed_c, data, memoryview(dst)) is None and np.array_equal(dst, data)
    for signed in (signed_c, signed_py):
        assert k.check(signed, data) is None
        dst = np.zeros_like(data)
        assert k.copy_check(signed, data, memoryview(dst)) is None and np.array_equal(dst, data)
        bad = data.copy()
        bad[-1] ^= 1
        assert k.check(signed, bad) == MAC_MISMATCH
        assert k.copy_check(signed, bad, memoryview(np.zeros_like(data))) == MAC_MISMATCH


def test_with_seal_writes_what_encode_header_writes() -> None:
    from kvtier.store.payload import CHECKSUM_XXH3, HEADER_BODY_BYTES, encode_header, with_seal

    h = ChunkHeader("0123456789abcdef", b"\x09" * 32, 2, 256, 512, 4096, "bfloat16", 0, CHECKSUM_XXH3,
                    123456789, 2, b"", 0, b"\x01" * 12)
    full = ChunkHeader(*[getattr(h, f) for f in ChunkHeader.__slots__][:7], 0xDEADBEEF12345678, CHECKSUM_XXH3,
                       123456789, 2, b"\xab" * 16, MAC_GMAC, b"\x01" * 12)
    assert with_seal(encode_header(h)[:HEADER_BODY_BYTES], 0xDEADBEEF12345678, b"\xab" * 16, MAC_GMAC) == \
        encode_header(full)


def test_sealing_body_is_what_encode_header_writes_for_the_sealed_header() -> None:
    from kvtier.store.payload import CHECKSUM_XXH3, FORMAT_BOUND, HEADER_BODY_BYTES, encode_header, sealing_body

    h = ChunkHeader("0123456789abcdef", b"\x09" * 20, 2, 256, 512, 4096, "bfloat16")
    full = ChunkHeader(*[getattr(h, f) for f in ChunkHeader.__slots__][:7], 0, CHECKSUM_XXH3, 987654321,
                       FORMAT_BOUND, b"", 0, b"\x05" * 12)
    assert sealing_body(h, 987654321, b"\x05" * 12) == encode_header(full)[:HEADER_BODY_BYTES]


@needs_c
def test_keyed_seal_is_checksum_and_mac_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keyed.seal's header decodes to the caller's header with the payload's XXH3-64, a fresh salt
    and a MAC that verifies on the C and the cryptography path; any changed byte fails it."""
    from kvtier.store.payload import CHECKSUM_XXH3, decode_header, verify

    k = Keyed(os.urandom(32), kind=MAC_GMAC)
    data = np.random.default_rng(9).integers(0, 256, (256 << 10) + 5, dtype=np.uint8)
    h = ChunkHeader("0123456789abcdef", b"\x07" * 32, 1, 0, 256, data.size, "bfloat16")
    raw = k.seal(h, data)
    got = decode_header(raw)
    assert isinstance(got, ChunkHeader)
    assert (got.namespace_id, got.chunk_hash, got.group, got.token_start, got.token_end, got.payload_bytes,
            got.dtype) == (h.namespace_id, h.chunk_hash, h.group, h.token_start, h.token_end, h.payload_bytes,
                           h.dtype)
    assert got.checksum_kind == CHECKSUM_XXH3 and got.checksum == xxhash.xxh3_64_intdigest(data)
    assert verify(got, data) is None  # the unkeyed reader's check: intact
    assert got.mac_kind == MAC_GMAC and len(got.mac_salt) == 12 and got.created_ns > 0
    assert decode_header(k.seal(h, data)).mac_salt != got.mac_salt  # type: ignore[union-attr]
    assert k.check(got, data) is None
    with monkeypatch.context() as m:
        m.setattr(integrity, "_gmac_c", None)
        assert k.check(got, data) is None  # cryptography agrees
        assert k.seal(h, data) is None  # no C: the caller seals, then signs
    bad = data.copy()
    bad[3] ^= 1  # in the block the payload shares with the header
    assert k.check(got, bad) == MAC_MISMATCH
    assert Keyed(os.urandom(32), kind=MAC_GMAC).check(got, data) == MAC_MISMATCH


def _batch(k: Keyed, sizes: list[int], seed: int) -> tuple[list[ChunkHeader], list[np.ndarray], bytes, bytes]:
    rng = np.random.default_rng(seed)
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    headers = [ChunkHeader("0123456789abcdef", bytes([i + 1]) * 32, i % 3, 256 * i, 256 * (i + 1), n, "bfloat16")
               for i, n in enumerate(sizes)]
    prep = k.seal_batch(headers, datas)
    assert prep is not None
    return headers, datas, *prep


LAYOUT = (integrity.CHECKSUM_AT, MAC_AT, MAC_GMAC)


def _sealed_right(k: Keyed, header: ChunkHeader, raw: bytes, data: np.ndarray) -> None:
    """`raw` is what Keyed.seal writes for `header` and `data` (with its own salt and time): it
    decodes to the caller's fields, its checksum verifies, and its MAC verifies on both paths."""
    from kvtier.store.payload import CHECKSUM_XXH3, decode_header, verify

    got = decode_header(raw)
    assert isinstance(got, ChunkHeader), got
    assert (got.namespace_id, got.chunk_hash, got.group, got.token_start, got.token_end, got.payload_bytes,
            got.dtype) == (header.namespace_id, header.chunk_hash, header.group, header.token_start,
                           header.token_end, header.payload_bytes, header.dtype)
    assert got.checksum_kind == CHECKSUM_XXH3 and verify(got, data) is None
    assert got.mac_kind == MAC_GMAC and k.check(got, data) is None
    assert k.copy_check(got, data, memoryview(np.zeros_like(data))) is None
    bad = data.copy()
    bad[-1] ^= 1
    assert k.check(got, bad) == MAC_MISMATCH


@needs_c
def test_a_batch_seal_writes_what_the_one_value_seal_writes() -> None:
    """Each header out of `seal_batch` is, byte for byte, the one-value C seal of the same body
    and key (`seal_gmac` + `with_seal`), and verifies as Keyed.seal's does."""
    from kvtier.store.payload import CHECKSUM_AT, HEADER_BODY_BYTES, with_seal

    k = Keyed(os.urandom(32), kind=MAC_GMAC)
    sizes = [241, 4096, 4099, (256 << 10) + 3, 65543]
    headers, datas, keys, bodies = _batch(k, sizes, 11)
    assert len(keys) == 32 * len(sizes) and len(bodies) == HEADER_BODY_BYTES * len(sizes)
    state, out = bytearray(len(sizes)), bytearray(128 * len(sizes))
    for i, (h, d) in enumerate(zip(headers, datas)):
        raw = gm.seal_batch(keys, bodies, d, state, out, i, *LAYOUT)
        body, key = bodies[HEADER_BODY_BYTES * i:HEADER_BODY_BYTES * (i + 1)], keys[32 * i:32 * (i + 1)]
        assert raw == with_seal(body, *gm.seal_gmac(key, body, d, CHECKSUM_AT), MAC_GMAC)
        assert state[i] == 2 and out[128 * i:128 * (i + 1)] == raw
        _sealed_right(k, h, raw, d)
    salts = {bodies[HEADER_BODY_BYTES * i + 109:HEADER_BODY_BYTES * i + 121] for i in range(len(sizes))}
    assert len(salts) == len(sizes)  # a fresh salt each


@needs_c
def test_a_batch_value_is_sealed_once_by_whoever_claims_it_and_the_sender_never_waits() -> None:
    """State byte k: free (0) -> claimed (1) -> sealed (2). The helper seals only a free value;
    the sender takes a sealed value's header as it is, claims and seals a free one, and seals a
    copy of its own for a value the helper is still on (never reading the half-written slot);
    `seal_batch_halt` claims every free value, so the helper stops."""
    k = Keyed(os.urandom(32), kind=MAC_GMAC)
    headers, datas, keys, bodies = _batch(k, [8192] * 4, 12)
    state, out = bytearray(4), bytearray(128 * 4)

    assert gm.seal_batch(keys, bodies, datas[0], state, out, 0, *LAYOUT, helper=True) is True
    assert state[0] == 2
    sealed = bytes(out[:128])
    _sealed_right(k, headers[0], sealed, datas[0])
    assert gm.seal_batch(keys, bodies, datas[0], state, out, 0, *LAYOUT) == sealed  # taken as it is
    assert gm.seal_batch(keys, bodies, datas[0], state, out, 0, *LAYOUT, helper=True) is False
    assert bytes(out[:128]) == sealed  # sealed once

    state[1] = 1  # the helper is on value 1: its slot is not ready
    raw = gm.seal_batch(keys, bodies, datas[1], state, out, 1, *LAYOUT)
    _sealed_right(k, headers[1], raw, datas[1])
    assert state[1] == 1 and out[128:256] == bytes(128)  # its own copy; the slot stays the helper's
    assert gm.seal_batch(keys, bodies, datas[1], state, out, 1, *LAYOUT, helper=True) is False
    assert out[128:256] == bytes(128)  # a claimed value is not the helper's to seal again

    raw = gm.seal_batch(keys, bodies, datas[2], state, out, 2, *LAYOUT)  # free: the sender claims it
    assert state[2] == 2 and out[256:384] == raw
    _sealed_right(k, headers[2], raw, datas[2])

    gm.seal_batch_halt(state)
    assert list(state) == [2, 1, 2, 1]  # value 3 claimed: no helper seals it
    assert gm.seal_batch(keys, bodies, datas[3], state, out, 3, *LAYOUT, helper=True) is False
    assert out[384:] == bytes(128)


@needs_c
def test_a_helper_and_a_sender_racing_over_batches_seal_each_value_once() -> None:
    """Two threads on the same batches, from value 0 (the redis save stream's shape, many times
    over). The helper is given other keys than the sender, so every header tells who sealed it:
    each one the sender gets is wholly one writer's (a slot written by both, which the claim rules
    out, would verify under neither), each slot is the helper's exactly where it says it sealed
    it, and both writers won some values."""
    import threading

    k, other = Keyed(os.urandom(32), kind=MAC_GMAC), Keyed(os.urandom(32), kind=MAC_GMAC)
    won = {"helper": 0, "sender": 0}
    for trial in range(30):
        headers, datas, keys, bodies = _batch(k, [(64 << 10) + 64 * i for i in range(16)], 100 + trial)
        helper_keys = b"".join(other._gmac_key_bound(bodies[124 * i:124 * (i + 1)]) for i in range(16))
        state, out = bytearray(16), bytearray(128 * 16)
        mine: list[bool] = []

        def helper() -> None:
            for i, d in enumerate(datas):  # noqa: B023
                mine.append(gm.seal_batch(helper_keys, bodies, d, state, out, i, *LAYOUT, helper=True))  # noqa: B023

        t = threading.Thread(target=helper)
        t.start()
        got = [gm.seal_batch(keys, bodies, d, state, out, i, *LAYOUT) for i, d in enumerate(datas)]
        gm.seal_batch_halt(state)
        t.join()
        for i, (h, raw, d) in enumerate(zip(headers, got, datas)):
            by_helper = raw[92:108] == gm.seal_gmac(helper_keys[32 * i:32 * (i + 1)],
                                                     bodies[124 * i:124 * (i + 1)], d, integrity.CHECKSUM_AT)[1]
            _sealed_right(other if by_helper else k, h, raw, d)
            if by_helper:  # the sender took the helper's slot, so the helper claimed it
                assert mine[i] and bytes(out[128 * i:128 * (i + 1)]) == raw
            won["helper" if mine[i] else "sender"] += 1
    assert won["helper"] and won["sender"], won


@needs_c
def test_batch_seal_bad_arguments_are_one_line_errors() -> None:
    k = Keyed(os.urandom(32), kind=MAC_GMAC)
    _, datas, keys, bodies = _batch(k, [4096, 4096], 13)
    state, out = bytearray(2), bytearray(256)
    bad = [
        ((keys[:-1], bodies, datas[0], state, out, 0, *LAYOUT), "32-byte keys"),
        ((keys, bodies, datas[0], state, bytearray(255), 0, *LAYOUT), "32-byte keys"),
        ((keys, bodies, datas[0], state, out, 2, *LAYOUT), "0 <= k < n"),
        ((keys, bodies, datas[0][:240], state, out, 0, *LAYOUT), "more than 240 bytes"),
        ((keys, bodies, datas[0], state, out, 0, 76, 70, MAC_GMAC), "apart"),
        ((keys, bodies, datas[0], state, out, 0, 120, 92, MAC_GMAC), "apart"),
        ((keys, bodies, datas[0], state, out, 0, 76, 110, MAC_GMAC), "apart"),
        ((keys, bodies, datas[0], state, out, 0, -1, 92, MAC_GMAC), "apart"),
        ((keys, bodies, datas[0], state, out, 0, 76, 92, 256), "one byte"),
        ((keys, bytes(300 * 2), datas[0], state, bytearray(304 * 2), 0, 76, 92, MAC_GMAC), "at most 256"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            gm.seal_batch(*args)
    assert list(state) == [0, 0] and out == bytearray(256)  # nothing claimed, nothing written


@needs_c
def test_seal_batch_says_none_where_the_one_pass_does_not_run() -> None:
    from kvtier.store.payload import MAC_BLAKE3

    k = Keyed(os.urandom(32), kind=MAC_GMAC)
    h = ChunkHeader("0123456789abcdef", b"\x01" * 32, 0, 0, 256, 4096, "uint8")
    d = np.zeros(4096, np.uint8)
    assert k.seal_batch([h], [d]) is not None
    assert k.seal_batch([h, h], [d, d[:240]]) is None  # a short payload: python-xxhash's
    assert k.seal_batch([h], [d[:4000]]) is None  # not the header's length
    assert k.seal_batch([seal(h, d)], [d]) is None  # sealed already
    pytest.importorskip("blake3")
    assert Keyed(os.urandom(32), kind=MAC_BLAKE3).seal_batch([h], [d]) is None
