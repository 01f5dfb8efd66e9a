"""Keyed integrity: with a tenant secret, a payload someone else forged is never restored.

The attack (reproduced before the secret existed: restored as a hit, 0 counted corrupt): a writer
of the shared tier keeps a tenant's header fields, puts in its own bytes and recomputes both the
payload checksum and the header CRC. The checksums are unkeyed, so only a MAC keyed with the
tenant's secret tells the forgery apart."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import torch

from kvtier.store.integrity import Keyed
from kvtier.store.payload import HEADER_BYTES, decode_header, encode_header, make_header, seal
from kvtier.store.tiers.base import TierLayout
from kvtier.store.tiers.disk import DiskTier
from kvtier.store.tiers.disk_files import DATA_OFFSET, slab_name
from kvtier.store.tiers.redis import RedisOptions, RedisTier

sys.path.insert(0, str(Path(__file__).parents[1]))
from redis_servers import have_redis, redis_server  # noqa: E402

NS = "5a5a5a5a01234567"
SECRET_A = b"tenant-a-" + b"k" * 23
SECRET_B = b"tenant-b-" + b"z" * 23
N = 4096


def _header(i: int = 1):
    return make_header(NS, bytes([i]) * 32, 0, 0, 16, N)


def _good() -> torch.Tensor:
    return torch.arange(N, dtype=torch.int32).to(torch.uint8)


def _forge(raw: bytes) -> bytes:
    """Keep the header fields, swap the payload, recompute the checksum and the header CRC
    (dropping the MAC, which the forger cannot compute)."""
    h = decode_header(raw[:HEADER_BYTES])
    evil = bytes([0x66]) * h.payload_bytes
    forged = seal(replace(h, mac=b"", checksum=0, checksum_kind=0), evil)
    return encode_header(forged) + evil


@pytest.fixture
def server():
    if not have_redis():
        pytest.fail("redis-server is not installed; `make test` installs it (scripts/ensure-redis.sh)")
    with redis_server() as srv:
        yield srv


def _tier(url: str, secret: bytes | None) -> RedisTier:
    return RedisTier(RedisOptions(url=url), namespace_id=NS, keyed=Keyed(secret) if secret else None)


def test_a_forged_redis_value_is_a_counted_miss_with_a_secret(server) -> None:
    a = _tier(server.url, SECRET_A)
    assert a.write(0, 0, _header(), _good())
    r = redis.Redis.from_url(server.url)
    key = a.key(_header())
    r.set(key, _forge(r.get(key)))
    out = torch.zeros(N, dtype=torch.uint8)
    assert a.read(0, 0, _header(), out) is False
    assert a.metrics()["foreign_skipped"] == 1 and not (out == 0x66).all()
    # kept: its checksum verifies, so it cannot be told from another tenant's value (deleting
    # those made tenants evict each other); A's next save of the chunk overwrites it
    assert r.get(key) is not None and a.corrupt_dropped == 0
    # without a secret the same forgery is restored: every writer of a shared tier is trusted
    plain = _tier(server.url, None)
    assert plain.write(0, 0, _header(), _good())
    r.set(key, _forge(r.get(key)))
    assert plain.read(0, 0, _header(), out) is True and bool((out == 0x66).all())
    for t in (a, plain):
        t.close()
    r.close()


def test_another_secret_or_no_secret_never_restores(server) -> None:
    a, b, plain = _tier(server.url, SECRET_A), _tier(server.url, SECRET_B), _tier(server.url, None)
    out = torch.zeros(N, dtype=torch.uint8)
    assert a.write(0, 0, _header(2), _good())
    assert plain.read(0, 0, _header(2), out) is False and plain.corrupt_dropped == 0  # kept: A's
    assert b.read(0, 0, _header(2), out) is False and b.metrics()["foreign_skipped"] == 1  # A's
    assert plain.write(0, 0, _header(3), _good())
    assert a.read(0, 0, _header(3), out) is False and a.metrics()["foreign_skipped"] == 1  # unkeyed
    assert a.corrupt_dropped == b.corrupt_dropped == 0
    assert a.write(0, 0, _header(4), _good())
    assert a.read(0, 0, _header(4), out) is True and torch.equal(out, _good())
    for t in (a, b, plain):
        t.close()


def test_a_forged_disk_slot_is_a_counted_miss_with_a_secret(tmp_path: Path) -> None:
    layout = TierLayout(slot_bytes=(N,), num_slots=(2,))
    tier = DiskTier(tmp_path, layout, NS, keyed=Keyed(SECRET_A), mapped_reads=False)
    assert tier.write(0, 1, _header(), _good())
    path = tmp_path / NS / slab_name(0, N)
    stride = DATA_OFFSET + N
    with open(path, "r+b") as f:  # someone who can write the directory rewrites the slot
        f.seek(stride)
        raw = f.read(HEADER_BYTES)
        f.seek(stride + DATA_OFFSET)
        payload = f.read(N)
        forged = _forge(raw + payload)
        f.seek(stride)
        f.write(forged[:HEADER_BYTES])
        f.seek(stride + DATA_OFFSET)
        f.write(forged[HEADER_BYTES:])
    out = torch.zeros(N, dtype=torch.uint8)
    assert tier.read(0, 1, _header(), out) is False and tier.corrupt_dropped == 1
    tier.close()


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path: Path, monkeypatch) -> None:
    from kvtier.errors import ConfigError
    from kvtier.store.integrity import keyed_from_env

    monkeypatch.delenv("KVTIER_SECRET", raising=False)
    monkeypatch.delenv("KVTIER_SECRET_FILE", raising=False)
    assert keyed_from_env() is None
    f = tmp_path / "secret"
    f.write_bytes(SECRET_A + b"\n")
    os.chmod(f, 0o644)
    monkeypatch.setenv("KVTIER_SECRET_FILE", str(f))
    with pytest.raises(ConfigError, match=r"readable by others \(mode 644\); run `chmod 600"):
        keyed_from_env()
    os.chmod(f, 0o600)
    k = keyed_from_env()
    assert k is not None and "tenant" not in repr(k)
    h = seal(_header(), _good())
    assert k.check(Keyed(SECRET_A).sign(h, _good()), _good()) is None
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        Keyed(b"short")


def test_either_mac_kind_verifies_and_an_unknown_kind_is_rejected() -> None:
    from kvtier.store.payload import MAC_BLAKE2B, MAC_BLAKE3, Rejected

    data = _good()
    h = seal(_header(), data)
    for kind in (MAC_BLAKE2B, MAC_BLAKE3):  # a reader checks whichever kind the writer used
        signed = decode_header(encode_header(Keyed(SECRET_A, kind).sign(h, data)))
        assert signed.mac_kind == kind
        assert Keyed(SECRET_A).check(signed, data) is None
        assert Keyed(SECRET_B).check(signed, data) is not None
    raw = bytearray(encode_header(Keyed(SECRET_A).sign(h, data)))
    raw[108] = 7  # a MAC kind this reader does not know: never restored
    import zlib
    raw[124:128] = zlib.crc32(bytes(raw[:124])).to_bytes(4, "little")
    assert isinstance(decode_header(bytes(raw)), Rejected)


def test_a_secret_file_is_opened_once_and_checked_on_its_descriptor(tmp_path: Path) -> None:
    """The secret file (a tenant secret, a Redis password) is opened once with O_NOFOLLOW and
    checked on that descriptor: a regular file, this user's, mode 0600 or 0400, at most 64 KiB.
    Before: stat, then open (a gap), the mode checked after reading, a symlink followed, another
    user's file accepted, /dev/zero read until memory ran out."""
    import time

    from kvtier.errors import ConfigError
    from kvtier.store.integrity import SECRET_FILE_MAX_BYTES, read_private_file

    def refused(path: str, match: str) -> str:
        with pytest.raises(ConfigError, match=match) as err:
            read_private_file(path, "KVTIER_SECRET_FILE")
        msg = str(err.value)
        assert "\n" not in msg and SECRET_A.decode() not in msg and path in msg
        return msg

    good = tmp_path / "secret"
    good.write_bytes(SECRET_A + b"\n")
    os.chmod(good, 0o600)
    assert read_private_file(str(good), "KVTIER_SECRET_FILE") == SECRET_A
    os.chmod(good, 0o400)  # read-only for the owner: accepted
    assert read_private_file(str(good), "KVTIER_SECRET_FILE") == SECRET_A
    os.chmod(good, 0o600)
    link = tmp_path / "link"
    link.symlink_to(good)  # a link to a good 0600 file: refused, it could point anywhere
    refused(str(link), r"symbolic link")
    other = tmp_path / "other"
    other.write_bytes(SECRET_B)
    os.chmod(other, 0o600)
    os.chown(other, 12345, -1)  # another user's 0600 file (we are root here)
    refused(str(other), r"owned by uid 12345.*chown")
    t0 = time.monotonic()
    refused("/dev/zero", r"not a regular file")  # a character device: refused, never read
    assert time.monotonic() - t0 < 1.0
    big = tmp_path / "big"
    big.write_bytes(b"k" * (SECRET_FILE_MAX_BYTES + 1))
    os.chmod(big, 0o600)
    refused(str(big), r"at most 65536 bytes")
    os.chmod(good, 0o644)
    refused(str(good), r"readable by others \(mode 644\); run `chmod 600 ")
    os.chmod(good, 0o640)
    refused(str(good), r"`chmod 600 ")
    refused(str(tmp_path / "absent"), r"cannot be read")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # opening a FIFO for reading would block until a writer came
    t0 = time.monotonic()
    refused(str(fifo), r"not a regular file")
    assert time.monotonic() - t0 < 1.0


def test_tenants_sharing_a_namespace_never_delete_each_others_values(server) -> None:
    """Two tenants on one model without `kvtier.tenant` share a namespace, so each reads the
    other's keys. A value whose checksum verifies and only the MAC fails (another tenant's, or an
    unkeyed writer's) is a miss counted in `foreign_skipped` and stays in Redis; before, the
    reader deleted it (counted corrupt), so the tenants evicted each other. A value that fails its
    own checksum is still dropped."""
    a, b, plain = _tier(server.url, SECRET_A), _tier(server.url, SECRET_B), _tier(server.url, None)
    r = redis.Redis.from_url(server.url)
    out = torch.zeros(N, dtype=torch.uint8)
    for writer, readers, i in ((a, (b, plain), 5), (plain, (a, b), 6)):
        assert writer.write(0, 0, _header(i), _good())
        for reader in readers:
            before = reader.metrics()
            assert reader.read(0, 0, _header(i), out) is False
            after = reader.metrics()
            assert after["foreign_skipped"] - before.get("foreign_skipped", 0) == 1
            assert after["corrupt_dropped"] == before["corrupt_dropped"]
            assert after["misses"] - before["misses"] == 1
        assert r.exists(writer.key(_header(i))) == 1  # still there: its writer reads it
        out.zero_()
        assert writer.read(0, 0, _header(i), out) is True and torch.equal(out, _good())
    # a value that fails its own checksum is dropped by any reader, keyed or not
    for reader, i in ((b, 7), (plain, 8)):
        assert a.write(0, 0, _header(i), _good())
        key = a.key(_header(i))
        raw = bytearray(r.get(key))
        raw[HEADER_BYTES + 10] ^= 0xFF  # a bit flip in the payload
        r.set(key, bytes(raw))
        before = reader.metrics()["corrupt_dropped"]
        assert reader.read(0, 0, _header(i), out) is False
        assert reader.metrics()["corrupt_dropped"] == before + 1 and r.exists(key) == 0
    for t in (a, b, plain):
        t.close()
    r.close()


def test_two_stores_with_different_secrets_keep_each_others_prefix(server) -> None:
    """The store view of the rule above: store B (another secret, same namespace) looks a prefix
    up, fails to load it (a counted foreign miss), and store A still restores all of it."""
    from kvtier.core.geometry import Geometry, Group
    from kvtier.core.keys import Namespace
    from kvtier.core.plan import make_plan
    from kvtier.store.store import Store

    geometry = Geometry(groups=(Group("full", "full", 2, 16, bytes_per_token_per_layer=64),),
                        tokens_per_hash=16, name="tenants")
    plan = make_plan(geometry, chunk_tokens=32)
    ns = Namespace(model="tenants", geometry_fingerprint=geometry.fingerprint(), dtype="bfloat16")
    tokens = list(range(129))  # 4 chunks of 32, and one token more
    payloads = {(0, i): torch.full((plan.groups[0].chunk_bytes,), i + 1, dtype=torch.uint8) for i in range(4)}

    def store(secret: bytes) -> Store:
        tier = RedisTier(RedisOptions(url=server.url), namespace_id=ns.id, keyed=Keyed(secret))
        return Store(plan, ns, shared=[tier])  # no local tier: every load comes from Redis

    sa, sb = store(SECRET_A), store(SECRET_B)
    assert sa.save_tokens(tokens, payloads) == 4
    buffers = {k: torch.zeros_like(v) for k, v in payloads.items()}
    hit_b = sb.lookup_tokens(tokens)
    assert hit_b.tokens == 128  # the keys exist ...
    assert sb.load(hit_b, buffers) == 0  # ... but none is B's: nothing restored
    assert sb.shared[0].metrics()["foreign_skipped"] >= 1
    sa2 = store(SECRET_A)  # a second engine of tenant A
    hit_a = sa2.lookup_tokens(tokens)
    assert hit_a.tokens == 128 and sa2.load(hit_a, buffers) == 128
    assert all(torch.equal(buffers[k], v) for k, v in payloads.items())
    for s in (sa, sb, sa2):
        s.close()


class _CountingXxh3:
    """Stands in for kvtier's xxh3 (the C extension and python-xxhash) and counts every call that
    hashes payload bytes, so a test can tell how many checksum passes a read made."""

    def __init__(self, real: object) -> None:
        self._real, self.calls = real, 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._real, name)
        if name in ("simd", "fence") or not callable(attr):
            return attr

        def counted(*a: object, **k: object) -> object:
            self.calls += 1
            return attr(*a, **k)
        return counted


@pytest.fixture
def xxh3_calls(monkeypatch):  # noqa: ANN001, ANN201
    import kvtier.store.payload as payload

    counters = []
    for name in ("_xxcopy", "_xxhash"):
        if getattr(payload, name) is not None:
            c = _CountingXxh3(getattr(payload, name))
            monkeypatch.setattr(payload, name, c)
            counters.append(c)
    return lambda: sum(c.calls for c in counters)


@pytest.mark.parametrize("mode", ["mapped", "preadv", "preadv-pieces"])
def test_a_keyed_disk_read_is_one_pass_the_mac_alone(tmp_path: Path, xxh3_calls, mode: str) -> None:
    """A keyed read checks the MAC and not the checksum as well (the MAC covers header and bytes,
    so the checksum was a second pass over every byte proving nothing more: load ratio 0.38).
    Every read path: resident slots copied from the mapping, one preadv, and a cold read whose
    pieces the helper thread lands while this thread hashes them. Before: one xxh3 pass each."""
    n = 64 << 10
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    layout = TierLayout(slot_bytes=(n,), num_slots=(2,))
    kw = {"mapped_reads": mode == "mapped", "pipeline": "always" if mode == "preadv-pieces" else "never",
          "piece_bytes": 8192}
    header = make_header(NS, b"k" * 32, 0, 0, 16, n)
    for keyed, passes in ((Keyed(SECRET_A), 0), (None, 1)):
        d = tmp_path / ("keyed" if keyed else "plain")
        tier = DiskTier(d, layout, NS, keyed=keyed, **kw)
        assert tier.write(0, 1, header, data)
        before = xxh3_calls()
        out = torch.zeros(n, dtype=torch.uint8)
        assert tier.read(0, 1, header, out) is True and torch.equal(out, data)
        assert (xxh3_calls() - before > 0) == bool(passes), (keyed, mode)
        assert tier.mapped_reads == (mode == "mapped") and tier.helper_ios == (mode == "preadv-pieces")
        tier.close()
    # the MAC still decides: another secret's reader of the same slot drops it, with any path
    other = DiskTier(tmp_path / "keyed", layout, NS, keyed=Keyed(SECRET_B), **kw)
    out = torch.zeros(n, dtype=torch.uint8)
    assert other.read(0, 1, header, out) is False and other.corrupt_dropped == 1
    other.close()


def test_a_keyed_redis_read_is_one_pass_and_a_mac_failure_is_still_sorted(server, xxh3_calls) -> None:
    """Redis: a keyed read of its own value makes no checksum pass (the MAC alone, fused with the
    copy into the caller's buffer); only a value whose MAC fails is checksummed, to keep an intact
    one of another tenant (foreign_skipped) and drop a broken one. Before: checksum, then MAC, for
    every value."""
    a, b = _tier(server.url, SECRET_A), _tier(server.url, SECRET_B)
    assert a.write(0, 0, _header(9), _good())
    out = torch.zeros(N, dtype=torch.uint8)
    before = xxh3_calls()
    assert a.read(0, 0, _header(9), out) is True and torch.equal(out, _good())
    assert xxh3_calls() == before
    assert b.read(0, 0, _header(9), out) is False and b.metrics()["foreign_skipped"] == 1
    assert xxh3_calls() > before  # the failure was sorted by the checksum: intact, kept
    r = redis.Redis.from_url(server.url)
    key = a.key(_header(9))
    raw = bytearray(r.get(key))
    raw[HEADER_BYTES + 1] ^= 1
    r.set(key, bytes(raw))
    assert b.read(0, 0, _header(9), out) is False and b.corrupt_dropped == 1 and r.exists(key) == 0
    for t in (a, b):
        t.close()
    r.close()


def _legacy_value(kind: str, i: int) -> bytes:
    """Header + payload of `_header(i)` as an older kvtier wrote it with SECRET_A: keyed BLAKE2b or
    BLAKE3 (format 1), or AES-GMAC under a key from the salt alone (format 2)."""
    import hashlib
    import zlib

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvtier.store.payload import FORMAT_SALTED, HEADER_BODY_BYTES, MAC_AT, MAC_BLAKE2B, MAC_BLAKE3, MAC_GMAC

    data = bytes(_good().numpy())
    h = seal(_header(i), data)
    if kind != "format 2":
        return encode_header(Keyed(SECRET_A, {"blake2b": MAC_BLAKE2B, "blake3": MAC_BLAKE3}[kind]).sign(h, data)) + data
    h2 = replace(h, format_version=FORMAT_SALTED, mac_salt=os.urandom(12))
    head = encode_header(h2)[:HEADER_BODY_BYTES]
    root = hashlib.blake2b(SECRET_A, digest_size=64, person=b"kvtier-gmac-v1").digest()
    key = hashlib.blake2b(h2.mac_salt, key=root, digest_size=32, person=b"kvtier-gmac-key").digest()
    tag = AESGCM(key).encrypt(bytes(12), b"", head + data)[:16]
    body = head[:MAC_AT] + tag + bytes((MAC_GMAC,)) + head[MAC_AT + 17:]
    return body + zlib.crc32(body).to_bytes(4, "little") + data


LEGACY = ("blake2b", "blake3", "format 2")


def test_legacy_redis_values_restore_by_default_and_are_kept_misses_when_refused(server) -> None:
    """`accept_legacy_macs=False`: a value MACed by an older kvtier (BLAKE2b, BLAKE3, format 2) is
    a counted miss, never restored, and stays in Redis (intact: a permissive tenant reads it).
    The default reader, with the same secret, still restores it (upgrades keep their cache)."""
    pytest.importorskip("blake3")
    a = _tier(server.url, SECRET_A)
    strict = RedisTier(RedisOptions(url=server.url), namespace_id=NS,
                       keyed=Keyed(SECRET_A, accept_legacy_macs=False))
    r = redis.Redis.from_url(server.url)
    out = torch.zeros(N, dtype=torch.uint8)
    for i, kind in enumerate(LEGACY, start=20):
        r.set(a.key(_header(i)), _legacy_value(kind, i))
        before = strict.metrics()
        assert strict.read(0, 0, _header(i), out) is False, kind
        after = strict.metrics()
        assert after["foreign_skipped"] - before.get("foreign_skipped", 0) == 1, kind
        assert after["misses"] - before["misses"] == 1 and after["corrupt_dropped"] == 0, kind
        assert r.exists(a.key(_header(i))) == 1
        out.zero_()
        assert a.read(0, 0, _header(i), out) is True and torch.equal(out, _good()), kind
    assert strict.write(0, 0, _header(30), _good())  # the current format: restored
    assert strict.read(0, 0, _header(30), out) is True and torch.equal(out, _good())
    for t in (a, strict):
        t.close()
    r.close()


def test_legacy_disk_slots_are_dropped_by_a_store_that_refuses_them(tmp_path: Path, monkeypatch) -> None:
    """A disk tier written by an older kvtier (keyed BLAKE2b, then a format-2 slot) restores
    through `Store(secret=...)`; `Store(secret=..., accept_legacy_macs=False)` loads none of it
    (counted corrupt, the slots dropped: a namespace directory is its writer's)."""
    import kvtier.store.integrity as integrity
    from kvtier.core.geometry import Geometry, Group
    from kvtier.core.keys import Namespace
    from kvtier.core.plan import make_plan
    from kvtier.errors import ConfigError
    from kvtier.store.payload import MAC_BLAKE2B
    from kvtier.store.store import Store

    monkeypatch.delenv("KVTIER_SECRET", raising=False)
    monkeypatch.delenv("KVTIER_SECRET_FILE", raising=False)
    geometry = Geometry(groups=(Group("full", "full", 2, 16, bytes_per_token_per_layer=64),),
                        tokens_per_hash=16, name="legacy")
    plan = make_plan(geometry, chunk_tokens=32)
    ns = Namespace(model="legacy", geometry_fingerprint=geometry.fingerprint(), dtype="bfloat16")
    tokens = list(range(129))
    payloads = {(0, i): torch.full((plan.groups[0].chunk_bytes,), i + 1, dtype=torch.uint8) for i in range(4)}
    cap = 8 * plan.groups[0].chunk_bytes

    def store(**kw: object) -> Store:
        return Store(plan, ns, disk_dir=tmp_path, disk_bytes=cap, secret=SECRET_A, **kw)

    with monkeypatch.context() as m:  # an older kvtier: its MAC was keyed BLAKE2b
        m.setattr(integrity, "default_kind", lambda: MAC_BLAKE2B)
        old = store()
        assert old.save_tokens(tokens, payloads) == 4
        old.close()
    buffers = {k: torch.zeros_like(v) for k, v in payloads.items()}
    new = store()  # default: the older values still restore
    hit = new.lookup_tokens(tokens)
    assert hit.tokens == 128 and new.load(hit, buffers) == 128
    assert all(torch.equal(buffers[k], v) for k, v in payloads.items())
    new.close()
    strict = store(accept_legacy_macs=False)
    hit = strict.lookup_tokens(tokens)
    assert hit.tokens == 128 and strict.load(hit, buffers) == 0
    assert strict.metrics()["corrupt_dropped"] >= 1
    assert strict.save_tokens(tokens, payloads) == 4  # rewritten in the current format: restored
    hit = strict.lookup_tokens(tokens)
    assert strict.load(hit, buffers) == 128
    strict.close()
    with pytest.raises(ConfigError, match=r"accept_legacy_macs=False needs a secret"):
        Store(plan, ns, disk_dir=tmp_path / "other", disk_bytes=cap, accept_legacy_macs=False)


@pytest.mark.parametrize("mode", ["mapped", "preadv"])
def test_a_format_2_disk_slot_is_refused_on_every_read_path(tmp_path: Path, mode: str) -> None:
    layout = TierLayout(slot_bytes=(N,), num_slots=(2,))
    tier = DiskTier(tmp_path, layout, NS, keyed=Keyed(SECRET_A), mapped_reads=mode == "mapped")
    for slot in (0, 1):
        assert tier.write(0, slot, _header(slot), _good())
    tier.close()
    path = tmp_path / NS / slab_name(0, N)
    with open(path, "r+b") as f:  # what an older kvtier left in the slot
        for slot in (0, 1):
            f.seek(slot * (DATA_OFFSET + N))
            f.write(_legacy_value("format 2", slot)[:HEADER_BYTES])
    out = torch.zeros(N, dtype=torch.uint8)
    tier = DiskTier(tmp_path, layout, NS, keyed=Keyed(SECRET_A), mapped_reads=mode == "mapped")
    assert tier.read(0, 0, _header(0), out) is True and torch.equal(out, _good())
    tier.close()
    tier = DiskTier(tmp_path, layout, NS, keyed=Keyed(SECRET_A, accept_legacy_macs=False),
                    mapped_reads=mode == "mapped")
    assert tier.read(0, 1, _header(1), out) is False and tier.corrupt_dropped == 1
    tier.close()


def test_non_zero_reserved_header_bytes_are_a_miss_for_every_reader(server, tmp_path: Path) -> None:
    """Bytes 121..123 changed (the header's CRC recomputed) in a keyed Redis value and a keyed
    disk slot: a counted miss for the keyed reader, and for a reader without a secret of an
    unkeyed value. Before, the keyed value restored: the MAC never saw those bytes."""
    import zlib

    def poke(raw: bytes) -> bytes:
        b = bytearray(raw)
        b[122] = 0x5A
        b[124:128] = zlib.crc32(bytes(b[:124])).to_bytes(4, "little")
        return bytes(b)

    r = redis.Redis.from_url(server.url)
    out = torch.zeros(N, dtype=torch.uint8)
    for secret, i in ((SECRET_A, 40), (None, 41)):
        t = _tier(server.url, secret)
        assert t.write(0, 0, _header(i), _good())
        key = t.key(_header(i))
        r.set(key, poke(r.get(key)))
        assert t.read(0, 0, _header(i), out) is False and t.metrics()["misses"] >= 1
        assert t.corrupt_dropped == 1 and r.exists(key) == 0  # a broken header: dropped
        t.close()
    r.close()
    layout = TierLayout(slot_bytes=(N,), num_slots=(2,))
    for keyed in (Keyed(SECRET_A), None):
        d = tmp_path / ("keyed" if keyed else "plain")
        tier = DiskTier(d, layout, NS, keyed=keyed)
        assert tier.write(0, 1, _header(), _good())
        with open(d / NS / slab_name(0, N), "r+b") as f:
            off = DATA_OFFSET + N
            f.seek(off)
            raw = f.read(HEADER_BYTES)
            f.seek(off)
            f.write(poke(raw))
        assert tier.read(0, 1, _header(), out) is False and tier.corrupt_dropped == 1
        tier.close()
