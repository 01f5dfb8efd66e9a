"""How a chunk becomes one Redis value and back: header + payload bytes, verified on the way in.

Kept apart from `tiers/redis.py` (the tier's verbs) and `tiers/redis_conn.py` (connections).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.store.integrity import Keyed, integrity
from kvtier.store.payload import (
    CHECKSUM_NONE,
    DEFAULT_CHECKSUM,
    HEADER_BYTES,
    ChunkHeader,
    Rejected,
    as_bytes_view,
    copy_checksum,
    decode_header,
    encode_header,
    mismatch,
    seal,
    sealed_with,
    unverifiable,
    verify,
)


class Arena:
    """Header + payload of each chunk of a batch as one value, laid out in a reused buffer: the
    save path for Redis Cluster, whose redis-py pipeline sends one argument as one buffer (other
    servers get the zero-copy stream of `redis_wire`). One value per chunk because one SET is
    atomic, while a header key beside a payload key could be evicted apart. The buffer (as large
    as the largest batch, at most `pipeline_bytes`) is reused because fresh 100 KB+ buffers cost a
    page fault per 4 KiB; redis-py sends
    memoryview slices of it without copying them again. The copy and the checksum are one pass
    (`copy_checksum`), and the MAC reads the copy while it is still in cache. Not thread-safe:
    the caller holds a lock from `encode` until the batch is sent."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def encode(self, headers: Sequence[ChunkHeader], views: Sequence[memoryview],
               keyed: Keyed | None = None) -> list[tuple[ChunkHeader, memoryview]]:
        """(sealed header, value view) per chunk; an unsealed header gets its checksum here, and
        with a secret every header its MAC."""
        size = sum(HEADER_BYTES + h.payload_bytes for h in headers)
        if len(self._buf) < size:
            self._buf = bytearray(size)
        arena = memoryview(self._buf)
        out, off = [], 0
        for header, view in zip(headers, views):
            n = header.payload_bytes
            body = arena[off + HEADER_BYTES:off + HEADER_BYTES + n]
            value = None
            if header.checksum_kind == CHECKSUM_NONE:
                value = copy_checksum(body, view, DEFAULT_CHECKSUM)
                header = seal(header, view) if value is None else sealed_with(header, value, DEFAULT_CHECKSUM)
            if value is None:
                body[:] = view
            if keyed is not None:
                header = keyed.sign(header, body)
            arena[off:off + HEADER_BYTES] = encode_header(header)
            out.append((header, arena[off:off + HEADER_BYTES + n]))
            off += HEADER_BYTES + n
        return out


def restore(expected: ChunkHeader, raw: bytes, keyed: Keyed | None, dst: memoryview) -> str | None:
    """Check a stored value against the chunk `expected` names and copy its payload into `dst`, in
    one pass over the bytes: None when `dst` now holds the payload; else why the value must not
    be restored (bad or foreign header, truncated, checksum mismatch, a MAC that does not verify
    or cannot be checked), and `dst`'s bytes are then unspecified: the caller reports a miss and
    never uses them.

    With a secret and a MACed value, the MAC alone is checked as the bytes are copied: it covers
    the header and every payload byte, so the checksum would prove nothing more (integrity's
    docstring). Only when the MAC fails is the checksum computed, to tell a value that is intact
    but another tenant's (kept) from a broken one (dropped). Without a secret, the copy and the
    xxh3 checksum are one pass too (`copy_checksum`)."""
    view = memoryview(raw)
    stored = decode_header(view[:HEADER_BYTES])
    if isinstance(stored, Rejected):
        return stored.reason
    why = mismatch(stored, expected)
    if why is not None:
        return why
    payload = view[HEADER_BYTES:]
    n = stored.payload_bytes
    if len(payload) != n:
        return f"payload truncated: {len(payload)} of {n} bytes"
    if keyed is not None and keyed.unverifiable(stored) is None:
        why = keyed.copy_check(stored, payload, dst)
        return None if why is None else verify(stored, payload) or why
    if keyed is None and not stored.mac:
        why = unverifiable(stored)
        if why is not None:
            return why
        value = copy_checksum(dst[:n], payload, stored.checksum_kind)
        if value is None:  # no C extension, or a crc32 / short payload: check, then copy
            why = verify(stored, payload)
            if why is None:
                dst[:n] = payload
            return why
        return None if value == stored.checksum else "payload checksum mismatch"
    # never restored here (a keyed reader of an unMACed value, an unkeyed reader of a MACed one):
    # the checksum only decides whether the value is broken (dropped) or some other writer's (kept)
    return verify(stored, payload) or integrity(keyed, stored, payload)


def u8_view(data: object) -> memoryview:
    """A flat byte view (writable when the buffer is) of a tensor of any dtype or of a buffer,
    without copying."""
    if hasattr(data, "untyped_storage"):  # a torch.Tensor: bfloat16 has no numpy dtype
        import torch

        if data.dtype != torch.uint8 or data.dim() != 1:  # type: ignore[attr-defined]
            data = data.reshape(-1).view(torch.uint8)  # type: ignore[attr-defined]
        return memoryview(data.numpy())  # type: ignore[attr-defined]
    return as_bytes_view(data)


def unknown_command(results: Sequence[object]) -> bool:
    """Whether a pipeline's replies hold an "unknown command" error (an older server)."""
    return any(isinstance(r, Exception) and "unknown command" in str(r).lower() for r in results)
