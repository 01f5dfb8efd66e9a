"""Chained prefix hashing and namespaces: the identity of a chunk.

A chunk key is `(chunk_hash, group_index)`. `chunk_hash` is the chained hash of the prompt
through the chunk's last hash boundary, with the namespace mixed into the root, so:
- two prompts share a chunk hash only if they share every token up to that chunk's end
  (and the same extra keys), in the same namespace and with the same `chunk_tokens`;
- two namespaces (models, geometries, dtypes, ranks, tenants) never share a key.

Hash: blake2b (32-byte digests), never Python's `hash` (salted per process, 64 bits). The chain
runs in `tokens_per_hash` units, as the engines hash blocks: h_0 = H(root || tokens of unit 0),
h_k = H(h_{k-1} || tokens of unit k). Token ids are packed once as little-endian uint32
(`array('I')`), so hashing a 128k-token prompt is one bytes conversion plus one blake2b call
per hash unit (a few milliseconds), not a Python loop over tokens.

`chunk_tokens` is mixed into the root: with chunk size 256 the hash at token 512 names the chunk
[256, 512), with chunk size 512 it names [0, 512). Without it, two processes with different
chunk sizes sharing a disk directory would read each other's payloads as their own.

Extra keys (a LoRA adapter id, multimodal input hashes, a cache salt) are mixed into the root as
well: a prompt with different extra keys shares no chunk with another. Sharing less is never
wrong; restoring KV computed for another image is.

Engine hashes (vLLM's `request.block_hashes`, one bytes-like hash per engine block, already
chained by the engine) map to chunk hashes by taking the engine hash at each chunk's last block
and hashing it with the root: `H(root' || block_hash)`, with a different domain tag than the
token chain so the two schemes never produce the same key.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.core.plan import Plan

DIGEST_BYTES = 32
_KEY_VERSION = b"kvtier-keys-v1"
_TOKENS_TAG = b"tokens"
_ENGINE_TAG = b"engine"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who may share a chunk: same model, geometry layout, dtype, parallel rank and tenant."""

    model: str
    geometry_fingerprint: str
    dtype: str
    rank: int = 0
    world_size: int = 1
    tenant: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "geometry_fingerprint", "dtype", "tenant"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"namespace field {name!r} is {getattr(self, name)!r}; use a string")
        if not self.model:
            raise ConfigError("namespace field 'model' is empty; give the model's name or path")
        if not self.geometry_fingerprint:
            raise ConfigError(
                "namespace field 'geometry_fingerprint' is empty; use geometry.fingerprint()"
            )
        for name in ("rank", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"namespace field {name!r} is {value!r}; use an integer >= 0")
        if self.world_size < 1 or self.rank >= self.world_size:
            raise ConfigError(
                f"namespace rank {self.rank} must be < world_size {self.world_size} (world_size >= 1)"
            )

    @property
    def digest(self) -> bytes:
        """32 bytes naming the namespace; length-prefixed fields, so no two encode alike."""
        h = hashlib.blake2b(_KEY_VERSION, digest_size=DIGEST_BYTES)
        for text in (self.model, self.geometry_fingerprint, self.dtype, self.tenant):
            raw = text.encode()
            h.update(len(raw).to_bytes(4, "little"))
            h.update(raw)
        h.update(self.rank.to_bytes(4, "little"))
        h.update(self.world_size.to_bytes(4, "little"))
        return h.digest()

    @property
    def id(self) -> str:
        """16 hex digits: a file-name and Redis-key prefix."""
        return self.digest.hex()[:16]


def _root(plan: Plan, namespace: Namespace, tag: bytes, extra_keys: Iterable[object]) -> bytes:
    h = hashlib.blake2b(tag, digest_size=DIGEST_BYTES)
    h.update(namespace.digest)
    h.update(plan.chunk_tokens.to_bytes(8, "little"))
    for i, key in enumerate(extra_keys):
        raw = _extra_bytes(key, i)
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.digest()


def _extra_bytes(key: object, i: int) -> bytes:
    if isinstance(key, str):
        return b"s" + key.encode()
    if isinstance(key, (bytes, bytearray, memoryview)):
        return b"b" + bytes(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return b"i" + str(key).encode()
    raise ConfigError(
        f"extra key #{i} is a {type(key).__name__}; use str, bytes or int "
        "(e.g. the adapter name, a multimodal content hash)"
    )


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids  # tensors, ndarrays
    try:
        packed = array("I", ids)
    except (OverflowError, TypeError):
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32), None)
        raise ConfigError(
            f"token id {bad!r} is not an integer in [0, 2**32); give the prompt's token ids"
        ) from None
    if packed.itemsize != 4:  # pragma: no cover - 'I' is 4 bytes on every platform we run on
        packed = array("L", ids)
    if sys.byteorder == "big":  # pragma: no cover - keys must match across machines
        packed.byteswap()
    return packed.tobytes()


def chunk_hashes(
    plan: Plan,
    namespace: Namespace,
    token_ids: Sequence[int],
    extra_keys: Iterable[object] = (),
) -> list[bytes]:
    """One chained hash per full chunk of `token_ids` (a trailing partial chunk has none)."""
    tph = plan.geometry.tokens_per_hash
    per_chunk = plan.chunk_tokens // tph  # plan guarantees chunk_tokens % tokens_per_hash == 0
    num_chunks = len(token_ids) // plan.chunk_tokens
    if num_chunks == 0:
        return []
    data = memoryview(_pack_tokens(token_ids[: num_chunks * plan.chunk_tokens]))
    unit_bytes = 4 * tph
    prev = _root(plan, namespace, _TOKENS_TAG, extra_keys)
    blake = hashlib.blake2b
    out: list[bytes] = []
    pos = 0
    for _ in range(num_chunks):
        for _ in range(per_chunk):
            h = blake(prev, digest_size=DIGEST_BYTES)
            h.update(data[pos : pos + unit_bytes])
            prev = h.digest()
            pos += unit_bytes
        out.append(prev)
    return out


def chunk_hashes_from_block_hashes(
    plan: Plan,
    namespace: Namespace,
    block_hashes: Sequence[object],
    block_tokens: int,
) -> list[bytes]:
    """Chunk hashes from an engine's chained per-block hashes (one per `block_tokens` tokens).

    The engine's hash of a chunk's last block already covers the whole prefix, so each chunk
    hash is `H(root || that block hash)`. Blocks past the last full chunk are ignored.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ConfigError(f"block_tokens={block_tokens!r} must be a positive integer")
    if plan.chunk_tokens % block_tokens:
        raise ConfigError(
            f"engine blocks of {block_tokens} tokens do not tile chunk_tokens={plan.chunk_tokens}; "
            f"use a chunk size that is a multiple of {block_tokens}"
        )
    per_chunk = plan.chunk_tokens // block_tokens
    root = _root(plan, namespace, _ENGINE_TAG, ())
    blake = hashlib.blake2b
    out: list[bytes] = []
    for last in range(per_chunk - 1, len(block_hashes), per_chunk):
        h = blake(root, digest_size=DIGEST_BYTES)
        h.update(_block_hash_bytes(block_hashes[last], last))
        out.append(h.digest())
    return out


def _block_hash_bytes(value: object, i: int) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, int) and not isinstance(value, bool):
        # some engines (older vLLM, tests) use integer hashes: fixed-width two's complement
        return value.to_bytes(32, "little", signed=True)
    raw = getattr(value, "hash_value", None)  # vLLM <= 0.9 BlockHash(hash_value, token_ids, ...)
    if raw is not None:
        return _block_hash_bytes(raw, i)
    raise ConfigError(
        f"block hash #{i} is a {type(value).__name__}; give bytes-like engine block hashes "
        "(vLLM's request.block_hashes)"
    )
