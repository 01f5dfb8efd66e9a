"""Fuzz: the payload header parser and `kvtier check`'s scan over 100,000 generated inputs each
(a seeded generator: the same inputs every run). Inputs: valid headers with random byte and bit
changes, random bytes, truncations. The rules: decoding never raises, a header it accepts encodes
back to the same 128 bytes, and the scan reports every slot (valid or with a reason) without
raising or reading more than the file holds."""

from __future__ import annotations

import os
import random
from pathlib import Path

from kvtier.store.payload import HEADER_BYTES, ChunkHeader, Rejected, decode_header, encode_header, make_header, seal
from kvtier.store.tiers.disk_files import DATA_OFFSET, slab_name, slot_stride
from kvtier.store.tiers.disk_scan import scan_dir

NS = "00112233aabbccdd"
N = 100_000


def _valid(rng: random.Random, nbytes: int, group: int = 0) -> tuple[bytes, bytes]:
    payload = rng.randbytes(nbytes)
    h = make_header(NS, rng.randbytes(32), group, 0, 16, nbytes)
    return encode_header(seal(h, payload)), payload


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    kind = rng.random()
    if kind < 0.4:  # flip a few bits anywhere
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind < 0.7:  # overwrite a field-sized run with random bytes
        i = rng.randrange(len(b))
        b[i:i + rng.choice((1, 2, 4, 8))] = rng.randbytes(rng.choice((1, 2, 4, 8)))
        b = b[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0")
    elif kind < 0.85:
        return bytes(b[:rng.randrange(HEADER_BYTES)])  # truncated
    else:
        return rng.randbytes(HEADER_BYTES)
    return bytes(b)


def test_decode_header_never_raises_and_round_trips() -> None:
    rng = random.Random(1234)
    accepted = 0
    for i in range(N):
        raw = _valid(rng, 64)[0] if i % 10 == 0 else _mutate(rng, _valid(rng, 64)[0])
        h = decode_header(raw)
        assert isinstance(h, (ChunkHeader, Rejected))
        if isinstance(h, ChunkHeader):
            accepted += 1
            assert encode_header(h) == raw[:HEADER_BYTES]
    assert accepted >= N // 10  # the unmutated tenth, plus any mutation the CRC cannot see


def test_check_scan_reports_every_generated_slot(tmp_path: Path) -> None:
    rng = random.Random(99)
    slot_bytes = 64
    stride = slot_stride(slot_bytes)
    nsdir = tmp_path / NS
    nsdir.mkdir(mode=0o700)
    per_file = 10_000
    seen = 0
    for round_ in range(N // per_file):
        path = nsdir / slab_name(round_, slot_bytes)
        expect_good = set()
        with open(path, "wb") as f:
            for s in range(per_file):
                raw, payload = _valid(rng, slot_bytes, round_)
                kind = rng.random()
                if kind < 0.3:
                    expect_good.add(s)
                elif kind < 0.6:
                    raw = _mutate(rng, raw)
                elif kind < 0.8:
                    payload = bytes(x ^ 0xFF for x in payload[:8]) + payload[8:]  # bad payload
                f.seek(s * stride)
                f.write(raw)
                if rng.random() < 0.05 and s == per_file - 1:
                    continue  # last payload missing: truncated file
                f.seek(s * stride + DATA_OFFSET)
                f.write(payload)
        records = [r for r in scan_dir(tmp_path, verify_payloads=True) if r.path == path]
        good = {r.slot for r in records if r.problem is None}
        assert expect_good <= good  # every untouched slot verifies
        assert len(good) < per_file  # and the changed ones are caught (nearly all of them)
        assert all(r.problem is None or isinstance(r.problem, str) for r in records)
        seen += per_file
        os.unlink(path)  # a scan covers one file at a time: bounded disk use
    assert seen == N
