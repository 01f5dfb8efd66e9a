"""kvtier.core.keys: chained prefix hashes, namespaces, engine block hashes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group
from kvtier.core.keys import Namespace, chunk_hashes, chunk_hashes_from_block_hashes
from kvtier.core.plan import make_plan


def _geometry(tph: int = 16) -> Geometry:
    return Geometry(
        groups=(
            Group("full", "full", 2, 16, bytes_per_token_per_layer=8),
            Group("local", "sliding", 2, 16, bytes_per_token_per_layer=8, window=32),
        ),
        tokens_per_hash=tph,
        name="toy",
    )


@pytest.fixture
def plan():
    return make_plan(_geometry(), chunk_tokens=32)


@pytest.fixture
def ns():
    return Namespace("toy-model", _geometry().fingerprint(), "bfloat16")


def test_one_hash_per_full_chunk(plan, ns):
    assert chunk_hashes(plan, ns, list(range(31))) == []
    hs = chunk_hashes(plan, ns, list(range(100)))  # 3 full chunks of 32, 4 tokens left over
    assert len(hs) == 3
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hs)
    assert len(set(hs)) == 3


def test_chain_prefix_property(plan, ns):
    a = list(range(128))
    b = a[:40] + [999] + a[41:]  # differs in chunk 1 (tokens 32..63)
    ha, hb = chunk_hashes(plan, ns, a), chunk_hashes(plan, ns, b)
    assert ha[0] == hb[0]
    assert all(x != y for x, y in zip(ha[1:], hb[1:]))
    # a longer prompt with the same head has the same leading chunk hashes
    assert chunk_hashes(plan, ns, a + [5] * 64)[:4] == ha


def test_hand_derived_chain():
    # tokens_per_hash 16, chunk 32: chunk 0 = hash after units [0,16) and [16,32)
    plan = make_plan(_geometry(), chunk_tokens=32)
    ns = Namespace("m", "f" * 16, "float16", rank=1, world_size=2, tenant="t")
    toks = list(range(1000, 1032))
    # the namespace digest: version tag, then length-prefixed strings, then rank and world size
    nh = hashlib.blake2b(b"kvtier-keys-v1", digest_size=32)
    for s in (b"m", b"f" * 16, b"float16", b"t"):
        nh.update(len(s).to_bytes(4, "little") + s)
    nh.update((1).to_bytes(4, "little") + (2).to_bytes(4, "little"))
    assert ns.digest == nh.digest()
    assert ns.id == nh.hexdigest()[:16]
    root = hashlib.blake2b(b"tokens", digest_size=32)
    root.update(ns.digest + (32).to_bytes(8, "little"))
    h = root.digest()
    for start in (0, 16):
        unit = b"".join(t.to_bytes(4, "little") for t in toks[start : start + 16])
        h = hashlib.blake2b(h + unit, digest_size=32).digest()
    assert chunk_hashes(plan, ns, toks) == [h]


@pytest.mark.parametrize(
    "field,value",
    [("model", "other"), ("geometry_fingerprint", "0" * 16), ("dtype", "float16"),
     ("rank", 1), ("tenant", "acme")],
)
def test_namespaces_never_share_keys(plan, ns, field, value):
    kwargs = dict(model=ns.model, geometry_fingerprint=ns.geometry_fingerprint, dtype=ns.dtype,
                  rank=ns.rank, world_size=2, tenant=ns.tenant)
    base = Namespace(**kwargs)
    kwargs[field] = value
    other = Namespace(**kwargs)
    assert base.digest != other.digest and base.id != other.id
    toks = list(range(64))
    assert not set(chunk_hashes(plan, base, toks)) & set(chunk_hashes(plan, other, toks))


def test_extra_keys_and_chunk_size_change_every_hash(ns):
    toks = list(range(128))
    p32 = make_plan(_geometry(), chunk_tokens=32)
    p64 = make_plan(_geometry(), chunk_tokens=64)
    base = chunk_hashes(p32, ns, toks)
    lora = chunk_hashes(p32, ns, toks, extra_keys=("adapter-a",))
    assert not set(base) & set(lora)
    assert chunk_hashes(p32, ns, toks, extra_keys=("adapter-a",)) == lora
    assert not set(lora) & set(chunk_hashes(p32, ns, toks, extra_keys=(b"adapter-a",)))
    # chunk 0 at size 64 ends at token 64, like chunk 1 at size 32, yet they are not the same key
    assert chunk_hashes(p64, ns, toks)[0] != base[1]


def test_stable_across_processes(plan, ns):
    toks = list(range(64))
    code = (
        "from kvtier.core.geometry import Geometry, Group; from kvtier.core.plan import make_plan;"
        "from kvtier.core.keys import Namespace, chunk_hashes;"
        "g = Geometry((Group('full','full',2,16,bytes_per_token_per_layer=8),"
        "Group('local','sliding',2,16,bytes_per_token_per_layer=8,window=32)),16,name='toy');"
        "p = make_plan(g, chunk_tokens=32);"
        "print(','.join(h.hex() for h in chunk_hashes(p, Namespace('toy-model', g.fingerprint(),"
        " 'bfloat16'), list(range(64)))))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ",".join(h.hex() for h in chunk_hashes(plan, ns, toks))


def test_bad_tokens_and_namespace(plan, ns):
    with pytest.raises(ConfigError, match="token id -1"):
        chunk_hashes(plan, ns, [1] * 31 + [-1])
    with pytest.raises(ConfigError, match="extra key #0"):
        chunk_hashes(plan, ns, list(range(32)), extra_keys=(1.5,))
    with pytest.raises(ConfigError, match="rank 2 must be < world_size 2"):
        Namespace("m", "f", "bfloat16", rank=2, world_size=2)
    with pytest.raises(ConfigError, match="model"):
        Namespace("", "f", "bfloat16")


def test_block_hashes_map_to_chunk_last_block(plan, ns):
    blocks = [bytes([i]) * 32 for i in range(7)]  # 16-token engine blocks, chunk = 2 blocks
    hs = chunk_hashes_from_block_hashes(plan, ns, blocks, 16)
    assert len(hs) == 3  # block 6 is the first half of an unfinished chunk
    # a chunk's hash depends only on the engine hash of its last block
    changed = list(blocks)
    changed[2] = b"x" * 32
    hs2 = chunk_hashes_from_block_hashes(plan, ns, changed, 16)
    assert hs2[0] == hs[0] and hs2[1] == hs[1] and hs2[2] == hs[2]
    changed[3] = b"y" * 32
    assert chunk_hashes_from_block_hashes(plan, ns, changed, 16)[1] != hs[1]
    # the token scheme and the engine scheme never produce the same key
    assert not set(hs) & set(chunk_hashes(plan, ns, list(range(96))))
    # 32-token engine blocks: one per chunk; int hashes are accepted too
    assert len(chunk_hashes_from_block_hashes(plan, ns, [1, 2, 3], 32)) == 3
    with pytest.raises(ConfigError, match="do not tile"):
        chunk_hashes_from_block_hashes(plan, ns, blocks, 24)
    with pytest.raises(ConfigError, match="block hash #1"):
        chunk_hashes_from_block_hashes(plan, ns, [b"a", 1.0], 16)


def test_128k_prompt_hashing_is_linear_in_the_prompt(ns, monkeypatch):
    """Hashing a 128k-token prompt feeds every token's 4 bytes to the hash once and makes one
    hash call per hash unit: counted, a bound noise cannot break (a timed bound could; speed is
    for benchmarks). A chain that rehashed the prefix per chunk would feed ~256x the bytes."""
    import hashlib

    from kvtier.core import keys

    fed = {"calls": 0, "bytes": 0}
    real = hashlib.blake2b

    class Counting:
        def __init__(self, data=b"", **kw):
            fed["calls"] += 1
            fed["bytes"] += len(data)
            self._h = real(data, **kw)

        def update(self, data):
            fed["bytes"] += len(data)
            self._h.update(data)

        def digest(self):
            return self._h.digest()

    monkeypatch.setattr(keys.hashlib, "blake2b", Counting)
    plan = make_plan(_geometry(), chunk_tokens=256)
    toks = list(range(128 * 1024))
    hs = chunk_hashes(plan, ns, toks)
    assert len(hs) == 512
    units = len(toks) // plan.geometry.tokens_per_hash
    assert units <= fed["calls"] <= units + 4  # one per hash unit, plus the namespace root
    assert 4 * len(toks) <= fed["bytes"] <= 4 * len(toks) + units * 64 + 4096  # each token once, 32-byte chain links
