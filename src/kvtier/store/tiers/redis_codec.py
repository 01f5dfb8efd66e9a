"""How a chunk becomes one Redis value and back: header + payload bytes, verified on the way in.

Kept apart from `tiers/redis.py` (the tier's verbs) and `tiers/redis_conn.py` (connections).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.store.integrity import Keyed, integrity
from kvtier.store.payload import (
    CHECKSUM_NONE,
    HEADER_BYTES,
    ChunkHeader,
    Rejected,
    as_bytes_view,
    decode_header,
    encode_header,
    mismatch,
    seal,
    verify,
)


class Arena:
    """Header + payload of each chunk of a batch as one value, laid out in a reused buffer: the
    one copy on the save path. One value per chunk because one SET is atomic, while a header key
    beside a payload key could be evicted apart. The buffer (as large as the largest batch, at
    most `pipeline_bytes`) is reused because fresh 100 KB+ buffers cost a page fault per 4 KiB,
    which measured slower than the network on loopback; redis-py sends memoryview slices of it
    without copying them again. Rejected: `SET header` + `APPEND payload` (no client copy, but
    a reader in another process could see a header without its payload). Not thread-safe: the
    caller holds a lock from `encode` until the batch is sent."""

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
            if header.checksum_kind == CHECKSUM_NONE:
                header = seal(header, view)
            if keyed is not None:
                header = keyed.sign(header, view)
            n = header.payload_bytes
            arena[off:off + HEADER_BYTES] = encode_header(header)
            arena[off + HEADER_BYTES:off + HEADER_BYTES + n] = view
            out.append((header, arena[off:off + HEADER_BYTES + n]))
            off += HEADER_BYTES + n
        return out


def check_payload(expected: ChunkHeader, raw: bytes, keyed: Keyed | None = None) -> str | None:
    """Why a stored value is not the chunk `expected` names (bad or foreign header, truncated,
    checksum mismatch, a MAC that does not verify), or None when its payload may be restored."""
    stored = decode_header(memoryview(raw)[:HEADER_BYTES])
    if isinstance(stored, Rejected):
        return stored.reason
    why = mismatch(stored, expected)
    if why is not None:
        return why
    payload = memoryview(raw)[HEADER_BYTES:]
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
