"""The chunk payload format: a fixed little-endian header, then the raw payload bytes.

Layout (`HEADER_BYTES` = 128, every integer little-endian):

    off size field
      0    4 magic b"KVTC"
      4    2 format version (FORMAT_VERSION)
      6    2 header bytes (128): lets a reader skip a header it does not understand
      8    8 namespace id (the 16 hex digits of `keys.Namespace.id`, as 8 raw bytes)
     16   32 chunk hash (the chained prefix hash; 32 bytes, zero-padded if shorter)
     48    2 group index
     50    1 dtype code (DTYPE_CODES)
     51    1 checksum kind (1 = xxh3_64, 2 = crc32, 0 = none)
     52    8 token span start
     60    8 token span end
     68    8 payload byte length
     76    8 checksum of the payload bytes
     84    8 created (unix time in ns; for `kvtier inspect` ages and rebuild order)
     92   16 MAC of bytes 0..123 (MAC and MAC kind zeroed) and the payload (`integrity`); zero
             under MAC kind 0
    108    1 MAC kind (0: written without a secret; 1: keyed BLAKE2b-128; 2: keyed BLAKE3-128;
             3: AES-256-GMAC under a key derived per value; formats 2 and 3 only)
    109   12 MAC salt (formats 2 and 3, MAC kind 3: random per value; zero otherwise)
    121    3 reserved (zero)
    124    4 crc32 of bytes 0..123 (the header's own checksum)

A byte the header does not use (reserved, a salt or MAC without the kind that needs it) must be
zero, or the header is rejected: a MAC is computed over the header as decoded, so this is what
makes it cover every one of bytes 0..123 (a decoded header encodes back to the same bytes).

Format versions: 1 (MAC kinds 0-2; bytes 109..123 zero), 2 (format 1 plus the MAC salt and MAC
kind 3, its key derived from the secret and the salt) and 3 (format 2 with the key derived from
the secret and every header byte but the checksum and the MAC fields: a repeated 96-bit salt, as
likely as a repeated random nonce after ~2^32 values, then reuses no key unless the whole header
repeats too; integrity.py). A writer writes 3 only for a payload MACed with kind 3, so unkeyed
values stay readable by a kvtier that reads format 1 alone; this kvtier reads all three.

Never pickle: a payload is bytes described by this header and nothing else. Decoding never
raises on bad input; a bad header is a `Rejected(reason)` value the caller counts as a corrupt
miss. The payload checksum is xxh3_64 when `xxhash` is installed (about as fast as a memcpy,
so disk throughput stays close to plain file I/O) and zlib.crc32 otherwise; the kind travels in
the header so either reader verifies either writer's slots. Where kvtier's small C extension `kvtier.store._xxcopy` was built (`pip install`
compiles it; it is optional), payloads over 240 bytes are hashed by it: the same XXH3-64 value,
with AVX2 where the CPU has it; `copy_checksum` copies a payload and computes its checksum in
one pass (the disk tier's verified loads) and `pwrite_checksum` writes one, checksumming each
piece right after the kernel copied it (its saves). A fast non-cryptographic hash is enough
against torn writes and bit rot (an attacker is the MAC's job, below); a sum of words is not (it
is blind to swapped blocks).

Keyed integrity (`kvtier.store.integrity.Keyed`): the checksums above catch torn writes and bit rot, not an attacker: a
writer of a shared tier (Redis, a disk directory) can keep a tenant's header fields, put in its
own bytes and recompute both checksums. With a secret set (`Store(secret=...)`,
`RedisTier(secret=...)`, `DiskTier(secret=...)`, or `KVTIER_SECRET` / `KVTIER_SECRET_FILE` in the
environment), every payload also carries a 128-bit keyed MAC over its header and its bytes, and
a reader with the secret restores only payloads whose MAC verifies: one written without the
secret, or forged, is a counted miss. A reader without a secret cannot check a MAC and treats a
MACed payload as a plain miss (kept: it is another keyed writer's). The MAC a writer writes is
AES-256-GMAC under a key derived per value from the secret and the header (MAC kind 3, format 3),
computed by OpenSSL through the `cryptography` package; no AES or GHASH is in kvtier's C. Keyed
BLAKE2b and keyed BLAKE3 (kinds 1-2, format 1) and format 2 are still read, never written where
`cryptography` is installed; the kind travels in the header, so a reader checks every kind it
can compute. A writer computes checksum and MAC (one more pass over the payload); a keyed reader
checks the MAC alone, in the same pass as its copy (the MAC covers the header with its checksum
field and every byte: `integrity`). `kvtier bench store --secret` and
`kvtier bench redis --secret` measure what it costs (docs/store.md, "Cost").
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.core.plan import Plan

try:  # optional: faster than crc32; the header says which one a slot used
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised where xxhash is absent
    _xxhash = None

try:  # optional C extension (src/kvtier/store/_xxcopy.c): XXH3-64 of > 240 bytes, fused with a copy
    from kvtier.store import _xxcopy
except ImportError:  # pragma: no cover - exercised where it was not compiled
    _xxcopy = None
FUSED_MIN_BYTES = 241  # _xxcopy's long-input path; shorter payloads go to python-xxhash

MAGIC = b"KVTC"
FORMAT_VERSION = 1  # what an unsalted header is written as (see the module docstring)
FORMAT_SALTED = 2  # a header carrying a MAC salt (MAC kind 3), its key derived from the salt (read only)
FORMAT_BOUND = 3  # the same, its key derived from the header: what a keyed writer writes
FORMATS_READ = (FORMAT_VERSION, FORMAT_SALTED, FORMAT_BOUND)
SALTED_FORMATS = (FORMAT_SALTED, FORMAT_BOUND)
HEADER_BYTES = 128
HASH_BYTES = 32

_FMT = "<4sHH8s32sHBBQQQQQ16sB12s3s"
_BODY = struct.Struct(_FMT)
_CRC = struct.Struct("<I")
assert _BODY.size == HEADER_BYTES - _CRC.size

DTYPE_CODES = {
    "uint8": 1,
    "int8": 2,
    "float16": 3,
    "bfloat16": 4,
    "float32": 5,
    "float8_e4m3fn": 6,
    "float8_e5m2": 7,
    "fp8": 8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}

CHECKSUM_NONE = 0
CHECKSUM_XXH3 = 1
CHECKSUM_CRC32 = 2
CHECKSUM_NAMES = {CHECKSUM_NONE: "none", CHECKSUM_XXH3: "xxh3_64", CHECKSUM_CRC32: "crc32"}
DEFAULT_CHECKSUM = CHECKSUM_XXH3 if _xxhash is not None else CHECKSUM_CRC32


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """What a slot claims to hold. `checksum_kind` 0 means not sealed yet (see `seal`)."""

    namespace_id: str  # 16 hex digits
    chunk_hash: bytes
    group: int
    token_start: int
    token_end: int
    payload_bytes: int
    dtype: str = "uint8"
    checksum: int = 0
    checksum_kind: int = CHECKSUM_NONE
    created_ns: int = 0
    format_version: int = FORMAT_VERSION
    mac: bytes = b""  # 16 bytes when written with a secret (`Keyed.sign`)
    mac_kind: int = 0  # MAC_BLAKE2B, MAC_BLAKE3 or MAC_GMAC with a MAC, 0 without
    mac_salt: bytes = b""  # MAC_SALT_BYTES random bytes with MAC_GMAC (format 2), else empty

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.chunk_hash, self.group)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A header or payload that must not be restored, and why (counted as a corrupt miss)."""

    reason: str


def make_header(
    namespace_id: str,
    chunk_hash: bytes,
    group: int,
    token_start: int,
    token_end: int,
    payload_bytes: int,
    dtype: str = "uint8",
) -> ChunkHeader:
    """An unsealed header (no checksum): what a caller expects a slot to hold."""
    if len(namespace_id) != 16:
        raise ConfigError(f"namespace id {namespace_id!r} must be 16 hex digits (keys.Namespace.id)")
    try:
        bytes.fromhex(namespace_id)
    except ValueError:
        raise ConfigError(f"namespace id {namespace_id!r} is not hex; use keys.Namespace.id") from None
    if len(chunk_hash) > HASH_BYTES:
        raise ConfigError(f"chunk hash of {len(chunk_hash)} bytes; at most {HASH_BYTES} fit a header")
    if dtype not in DTYPE_CODES:
        raise ConfigError(f"dtype {dtype!r} unknown; use one of {', '.join(DTYPE_CODES)}")
    return ChunkHeader(
        namespace_id=namespace_id,
        chunk_hash=chunk_hash.ljust(HASH_BYTES, b"\0"),
        group=group,
        token_start=token_start,
        token_end=token_end,
        payload_bytes=payload_bytes,
        dtype=dtype,
    )


def chunk_header(
    plan: Plan,
    namespace_id: str,
    chunk_hash: bytes,
    group: int,
    token_start: int,
    token_end: int,
    dtype: str = "uint8",
) -> ChunkHeader:
    """The (unsealed) header of chunk `(chunk_hash, group)` of `plan` under `namespace_id` (a
    `keys.Namespace.id`), claiming tokens [token_start, token_end): the payload is the plan's chunk
    bytes of that group. The one maker the Store and both vLLM halves call (SpecContext.chunk_header,
    redis_lookup); a 32-byte hash of a known dtype skips `make_header`'s checks (the hot path of a
    lookup: kvtier.core.keys gives 32 bytes), anything else goes the checked way."""
    payload_bytes = plan.groups[group].chunk_bytes
    if len(chunk_hash) == HASH_BYTES and dtype in DTYPE_CODES and len(namespace_id) == 16:
        return ChunkHeader(namespace_id, chunk_hash, group, token_start, token_end, payload_bytes, dtype)
    return make_header(namespace_id, chunk_hash, group, token_start, token_end, payload_bytes, dtype)


def as_bytes_view(data: object) -> memoryview:
    """A flat byte view of `data` (bytes, bytearray, memoryview, numpy array, CPU torch tensor)
    without copying. A torch tensor must be contiguous and on the CPU."""
    if isinstance(data, memoryview):
        view = data
    else:
        numpy = getattr(data, "numpy", None)
        if numpy is not None:  # torch.Tensor
            data = numpy()
        view = memoryview(data)  # type: ignore[arg-type]
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def checksum(data: object, kind: int = DEFAULT_CHECKSUM) -> int:
    """The payload checksum of `data`. It runs without the GIL for payloads over 240 bytes
    (xxh3_64) or 5 KiB (crc32), so the disk tier can copy on another thread meanwhile."""
    view = as_bytes_view(data)
    if kind == CHECKSUM_XXH3:
        if _xxhash is None:
            raise RuntimeError("xxhash is not installed; `pip install xxhash` to verify xxh3_64 slots")
        if _xxcopy is not None and len(view) >= FUSED_MIN_BYTES:
            return _xxcopy.xxh3(view)  # type: ignore[no-any-return]
        if len(view) < FUSED_MIN_BYTES:
            return _xxhash.xxh3_64_intdigest(view)
        h = _xxhash.xxh3_64()  # `update` releases the GIL; the one-shot intdigest does not
        h.update(view)
        return h.intdigest()
    if kind == CHECKSUM_CRC32:
        return zlib.crc32(view)
    raise ValueError(f"unknown checksum kind {kind}")


def copy_checksum(dst: memoryview, src: memoryview, kind: int) -> int | None:
    """Copy `src` into `dst` (same length) and return the checksum of `src`, in one pass over the
    bytes; None (nothing copied) where that cannot be done here: the C extension is missing, the
    kind is not xxh3_64, or the payload is too short (the caller copies, then checksums)."""
    if _xxcopy is None or kind != CHECKSUM_XXH3 or len(src) < FUSED_MIN_BYTES or len(dst) != len(src):
        return None
    return _xxcopy.copy_xxh3(dst, src)  # type: ignore[no-any-return]


PIECE_ALIGN = 1024  # pwrite_checksum's pieces: a multiple of one XXH3 block


def pwrite_checksum(fd: int, src: memoryview, offset: int, piece: int, kind: int) -> int | None:
    """Write `src` at `offset` of `fd` in `piece`-byte writes, checksumming each piece right after
    it is written, in C with the GIL released; the checksum, or None (nothing written) where the
    C extension cannot (then write, and checksum, in Python). Raises OSError as os.pwrite does."""
    if _xxcopy is None or kind != CHECKSUM_XXH3 or len(src) < FUSED_MIN_BYTES or piece % PIECE_ALIGN:
        return None
    return _xxcopy.pwrite_xxh3(fd, src, offset, piece)  # type: ignore[no-any-return]


def fused_checksum_name() -> str:
    """How this process checksums: what `kvtier bench store` reports."""
    if _xxcopy is None:
        return "python-xxhash, then copy (C extension kvtier.store._xxcopy not built)"
    return "fused copy + xxh3_64 (kvtier.store._xxcopy, " + ("AVX2)" if _xxcopy.simd() else "scalar)")


class StreamingChecksum:
    """The payload checksum fed piece by piece; `value()` equals `checksum` of the whole.

    Its `update` runs without the GIL (python-xxhash's `xxh3_64.update` releases it; its
    one-shot `xxh3_64_intdigest` does not; zlib.crc32 releases it above 5 KiB), so the disk tier
    can hash on one core while a helper thread copies on the other."""

    __slots__ = ("kind", "_xxh", "_crc")

    def __init__(self, kind: int = DEFAULT_CHECKSUM) -> None:
        self.kind = kind
        self._crc = 0
        if kind == CHECKSUM_XXH3:
            if _xxhash is None:
                raise RuntimeError("xxhash is not installed; `pip install xxhash` to verify xxh3_64 slots")
            self._xxh = _xxhash.xxh3_64()
        elif kind == CHECKSUM_CRC32:
            self._xxh = None
        else:
            raise ValueError(f"unknown checksum kind {kind}")

    def update(self, data: object) -> None:
        if self._xxh is not None:
            self._xxh.update(data)  # type: ignore[arg-type]
        else:
            self._crc = zlib.crc32(data, self._crc)  # type: ignore[arg-type]

    def value(self) -> int:
        return self._xxh.intdigest() if self._xxh is not None else self._crc


def seal(header: ChunkHeader, data: object, kind: int = DEFAULT_CHECKSUM) -> ChunkHeader:
    """`header` with the checksum of `data` and the creation time filled in."""
    return sealed_with(header, checksum(data, kind), kind)


def sealed_with(header: ChunkHeader, value: int, kind: int = DEFAULT_CHECKSUM) -> ChunkHeader:
    """`header` with a checksum computed by the caller (e.g. a `StreamingChecksum`) and the
    creation time filled in."""
    h = header  # a direct constructor call: dataclasses.replace costs ~10 us on the hot path
    return ChunkHeader(h.namespace_id, h.chunk_hash, h.group, h.token_start, h.token_end,
                       h.payload_bytes, h.dtype, value, kind, time.time_ns())
    # (no MAC: a new checksum invalidates any; `Keyed.sign` adds one after sealing)


def encode_header(header: ChunkHeader) -> bytes:
    body = _BODY.pack(
        MAGIC,
        (header.format_version if header.format_version in SALTED_FORMATS else FORMAT_BOUND)
        if header.mac_salt else FORMAT_VERSION,
        HEADER_BYTES,
        bytes.fromhex(header.namespace_id),
        header.chunk_hash.ljust(HASH_BYTES, b"\0"),
        header.group,
        DTYPE_CODES[header.dtype],
        header.checksum_kind,
        header.token_start,
        header.token_end,
        header.payload_bytes,
        header.checksum,
        header.created_ns,
        header.mac.ljust(MAC_BYTES, b"\0") if header.mac else bytes(MAC_BYTES),
        header.mac_kind if header.mac else 0,
        header.mac_salt.ljust(MAC_SALT_BYTES, b"\0") if header.mac_salt else bytes(MAC_SALT_BYTES),
        bytes(3),
    )
    return body + _CRC.pack(zlib.crc32(body))


def decode_header(buf: bytes | bytearray | memoryview) -> ChunkHeader | Rejected:
    """Parse a header; never raises. Order of checks: length, magic, version, own checksum."""
    view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
    if len(view) < HEADER_BYTES:
        return Rejected(f"header truncated: {len(view)} of {HEADER_BYTES} bytes")
    if bytes(view[0:4]) != MAGIC:
        if not any(view[0:HEADER_BYTES]):
            return Rejected("empty slot (no header)")
        return Rejected(f"bad magic {bytes(view[0:4])!r}")
    version = int.from_bytes(view[4:6], "little")
    if version not in FORMATS_READ:
        newer = "newer" if version > FORMAT_BOUND else "older"
        return Rejected(f"{newer} format version {version} (this kvtier reads "
                        f"{FORMAT_VERSION}, {FORMAT_SALTED} and {FORMAT_BOUND})")
    body = view[: _BODY.size]
    (stored_crc,) = _CRC.unpack_from(view, _BODY.size)
    if zlib.crc32(body) != stored_crc:
        return Rejected("header checksum mismatch")
    (_, _, hbytes, ns, chash, group, dcode, ckind, t0, t1, nbytes, csum, created, mac, flag, salt, spare) = (
        _BODY.unpack(body)
    )
    if hbytes != HEADER_BYTES:
        return Rejected(f"header size {hbytes} (expected {HEADER_BYTES})")
    if dcode not in _DTYPE_NAMES:
        return Rejected(f"unknown dtype code {dcode}")
    if ckind not in CHECKSUM_NAMES:
        return Rejected(f"unknown checksum kind {ckind}")
    if flag not in (0, MAC_BLAKE2B, MAC_BLAKE3, MAC_GMAC):
        return Rejected(f"unknown MAC kind {flag}")
    if (flag == MAC_GMAC) != (version in SALTED_FORMATS):  # a salt only where a kind-3 MAC needs one
        return Rejected(f"MAC kind {flag} in a format {version} header")
    # a byte this header does not use must be zero: a MAC covers the header as decoded, so a byte
    # decoding ignored could be changed under a verifying MAC (every writer writes zeros there)
    if spare != _ZERO_SPARE:
        return Rejected("reserved header bytes 121..123 are not zero")
    if flag != MAC_GMAC and salt != _ZERO_SALT:
        return Rejected(f"MAC salt bytes 109..120 are not zero under MAC kind {flag}")
    if not flag and mac != _ZERO_MAC:
        return Rejected("MAC bytes 92..107 are not zero under MAC kind 0")
    return ChunkHeader(
        namespace_id=ns.hex(),
        chunk_hash=chash,
        group=group,
        token_start=t0,
        token_end=t1,
        payload_bytes=nbytes,
        dtype=_DTYPE_NAMES[dcode],
        checksum=csum,
        checksum_kind=ckind,
        created_ns=created,
        format_version=version,
        mac=mac if flag else b"",
        mac_kind=flag,
        mac_salt=salt if flag == MAC_GMAC else b"",
    )


def mismatch(stored: ChunkHeader, expected: ChunkHeader) -> str | None:
    """Why a slot's header is not the chunk the caller asked for, or None if it is.

    The token span is a containment test: a chunk may hold only part of its span (vLLM stores a
    group's first chunk from a block mid-chunk), and it serves a load only when the span it holds
    contains the span the load needs. Equal spans, the only case outside vLLM, still match."""
    if stored.namespace_id != expected.namespace_id:
        return f"foreign namespace {stored.namespace_id} (expected {expected.namespace_id})"
    if stored.chunk_hash != expected.chunk_hash.ljust(HASH_BYTES, b"\0"):
        return "another chunk's hash"
    if stored.group != expected.group:
        return f"group {stored.group} (expected {expected.group})"
    if stored.token_start > expected.token_start or stored.token_end < expected.token_end:
        return (
            f"token span [{stored.token_start}, {stored.token_end}) does not hold "
            f"[{expected.token_start}, {expected.token_end})"
        )
    if stored.payload_bytes != expected.payload_bytes:
        return f"{stored.payload_bytes} payload bytes (expected {expected.payload_bytes})"
    if stored.dtype != expected.dtype:
        return f"dtype {stored.dtype} (expected {expected.dtype})"
    return None


SPAN_NOT_HELD = "token span"


def span_not_held(why: str | None) -> bool:
    """Whether `mismatch` said only that the stored chunk holds too few of its blocks for this
    load: a valid payload for its own span, so a plain miss that keeps the slot (a tier that
    dropped it would delete, in a shared Redis, a chunk other engines read)."""
    return why is not None and why.startswith(SPAN_NOT_HELD)


def verify(header: ChunkHeader, data: object) -> str | None:
    """Why `data` is not the payload `header` describes, or None if it is."""
    view = as_bytes_view(data)
    if len(view) != header.payload_bytes:
        return f"payload truncated: {len(view)} of {header.payload_bytes} bytes"
    why = unverifiable(header)
    if why is None and checksum(view, header.checksum_kind) != header.checksum:
        why = "payload checksum mismatch"
    return why


def unverifiable(header: ChunkHeader) -> str | None:
    """Why this reader cannot check `header`'s payload at all (then it must not be restored)."""
    if header.checksum_kind == CHECKSUM_NONE:
        return "payload has no checksum"
    if header.checksum_kind == CHECKSUM_XXH3 and _xxhash is None:
        return "payload checksum is xxh3_64 and xxhash is not installed"
    return None


# the MAC fields of the header (bytes 92..108); the MAC itself: kvtier.store.integrity
MAC_BYTES = 16
MAC_BLAKE2B = 1
MAC_BLAKE3 = 2
MAC_GMAC = 3  # AES-256-GMAC, one key per value derived from the secret and the header (format 3; the salt alone in 2)
MAC_SALT_BYTES = 12
HEADER_BODY_BYTES = _BODY.size  # the header bytes before its own CRC (what a MAC covers)
_ZERO_MAC, _ZERO_SALT, _ZERO_SPARE = bytes(MAC_BYTES), bytes(MAC_SALT_BYTES), bytes(3)
CHECKSUM_AT = struct.calcsize("<4sHH8s32sHBBQQQ")  # 76: the checksum's 8 bytes (little-endian)
MAC_AT = CHECKSUM_AT + 16  # 92: after the checksum and the creation time; then the kind's byte


def sealing_body(header: ChunkHeader, created_ns: int, salt: bytes) -> bytes:
    """The HEADER_BODY_BYTES that a keyed seal covers for `header` (unsealed): format
    FORMAT_BOUND, checksum kind xxh3_64, `created_ns` and `salt`, with checksum, MAC and MAC kind
    zero; `encode_header` of that header cut to its body, without building it (a keyed save seals
    64 values a batch; `Keyed.seal`)."""
    return _BODY.pack(MAGIC, FORMAT_BOUND, HEADER_BYTES, bytes.fromhex(header.namespace_id),
                      header.chunk_hash.ljust(HASH_BYTES, b"\0"), header.group, DTYPE_CODES[header.dtype],
                      CHECKSUM_XXH3, header.token_start, header.token_end, header.payload_bytes, 0, created_ns,
                      bytes(MAC_BYTES), 0, salt, bytes(3))


def encode_sealed(header: ChunkHeader, value: int, created_ns: int) -> bytes:
    """`encode_header(sealed_with(header, value))` for an unkeyed xxh3_64 seal of `header`
    (unsealed), packed in one go: the redis tier's save seals every value of a batch inline."""
    body = _BODY.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, bytes.fromhex(header.namespace_id),
                      header.chunk_hash.ljust(HASH_BYTES, b"\0"), header.group, DTYPE_CODES[header.dtype],
                      CHECKSUM_XXH3, header.token_start, header.token_end, header.payload_bytes, value,
                      created_ns, _ZERO_MAC, 0, _ZERO_SALT, _ZERO_SPARE)
    return body + _CRC.pack(zlib.crc32(body))


def with_seal(covered: bytes, value: int, mac: bytes, mac_kind: int) -> bytes:
    """The 128 bytes `encode_header` gives for a header whose first HEADER_BODY_BYTES, with
    checksum, MAC and MAC kind zero, are `covered`, once those three are `value`, `mac` and
    `mac_kind`: the fields written in place and the header's CRC computed (a keyed save's header
    without a second ChunkHeader and encode: `Keyed.seal`)."""
    body = b"".join((covered[:CHECKSUM_AT], value.to_bytes(8, "little"), covered[CHECKSUM_AT + 8:MAC_AT],
                     mac, bytes((mac_kind,)), covered[MAC_AT + MAC_BYTES + 1:HEADER_BODY_BYTES]))
    return body + _CRC.pack(zlib.crc32(body))
