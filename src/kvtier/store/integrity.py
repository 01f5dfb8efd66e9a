"""Keyed integrity of stored payloads: a tenant secret MACs every disk and Redis payload.

The payload checksums (`payload`) catch torn writes and bit rot, not an attacker: a writer of a
shared tier can keep a tenant's header fields, put in its own bytes and recompute both checksums.
With a secret, every payload also carries a 128-bit MAC over its header and bytes, stored in the
header's MAC field, and a reader with the secret restores only payloads whose MAC verifies. The
kind travels in the header, so every reader checks every kind it can compute:

- MAC_GMAC (written where the `cryptography` package is installed; format 3): AES-256-GMAC, the
  GCM tag over header and payload as associated data and nothing encrypted. Its key is derived
  per value: keyed BLAKE2b of the secret over the header's bytes (checksum and MAC fields
  zeroed), which carry a random 12-byte salt besides namespace, chunk hash, span, length and
  creation time in ns, so GCM's nonce (fixed at zero) is never reused under a key, with no
  counter to keep across writers and restarts. A key from the salt alone (format 2, still read)
  is no better than a random nonce under one fleet-wide key: two of ~2^32 values share a salt
  with probability ~2^-32, and two tags under one key give away its GHASH key, letting a writer
  of the shared tier forge any value carrying that salt; bound to the whole header, a repeated
  salt reuses no key unless the same chunk was also written in the same nanosecond. OpenSSL
  (through `cryptography`, which releases the GIL while it hashes) computes it with AES-NI and
  the CPU's carry-less multiply, several times keyed BLAKE3 (docs/store.md, "Cost"): one
  streamed GCM context a value, fed the header and then the payload (`_hasher`, `seal`), or
  piece by piece (`copy_check`, `stream`). No AES or GHASH is written by hand here (OpenSSL's
  is faster and reviewed).
- MAC_BLAKE3 (keyed BLAKE3) where `cryptography` is not installed and `blake3` is, and
  MAC_BLAKE2B (the standard library's, the slowest) where neither is: both still read. See
  docs/store.md, "Threat model". Split from `payload` (the format) because the secret and its
  checks are their own job.

A keyed read is one pass over the bytes: the MAC alone (`Keyed.copy_check`, `Keyed.stream`), not
the payload checksum and then the MAC. Skipping the unkeyed checksum there is sound only because
the MAC covers the header (checksum field, lengths, key, span) *and* every payload byte: any byte
that differs from what the secret's holder signed fails the MAC, which is strictly more than the
checksum proves. The checksum still matters where the MAC fails or is absent: a shared tier
computes it then, to tell an intact value of another tenant (kept) from a broken one (dropped).
`copy_check` copies into the caller's buffer as it hashes, so on a failure that buffer holds
unverified bytes: the caller reports a miss and never uses them.

One core per MAC (`max_threads=1` for BLAKE3), never a thread pool: the hosts kvtier runs on
keep their cores busy (an engine's scheduler, its workers, the disk tier's helper), and on the
2-core build machine two threads hashed no faster than one (docs/store.md, "Cost"). The disk
tier overlaps a cold read's MAC with its I/O on its own helper thread; the redis tier seals every
value inline on its sender (redis_wire says why).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

from kvtier.errors import ConfigError
from kvtier.store.payload import (CHECKSUM_AT, CHECKSUM_NONE, CHECKSUM_XXH3, DEFAULT_CHECKSUM, FORMAT_BOUND,
                                  FORMAT_SALTED, HEADER_BODY_BYTES, MAC_BLAKE2B, MAC_BLAKE3, MAC_BYTES,
                                  MAC_GMAC, MAC_SALT_BYTES, ChunkHeader, as_bytes_view, checksum,
                                  encode_header, sealing_body, with_seal)


SECRET_MIN_BYTES = 16
SECRET_FILE_MAX_BYTES = 64 << 10  # a secret or a password file is tiny; more is a mistake (or /dev/zero)
_MAC_PERSON = b"kvtier-mac-v1"
try:  # comes with torch; copies without the GIL (`Keyed.copy_check`)
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None
try:  # optional: keyed BLAKE3 is ~10x keyed BLAKE2b on this machine's cores
    import blake3 as _blake3
except ImportError:  # pragma: no cover - exercised where blake3 is absent
    _blake3 = None
try:  # optional: AES-GMAC is ~4x keyed BLAKE3 where the CPU multiplies carry-less (most x86, arm64)
    from cryptography.hazmat.primitives.ciphers import Cipher as _Cipher
    from cryptography.hazmat.primitives.ciphers import algorithms as _algorithms
    from cryptography.hazmat.primitives.ciphers import modes as _modes
except ImportError:  # pragma: no cover - exercised where cryptography is absent
    _Cipher = None
_GCM_NONCE = bytes(12)  # every GMAC key tags one value (module docstring): one nonce is enough
_GCM = _modes.GCM(_GCM_NONCE) if _Cipher is not None else None  # immutable: made once (~0.5 us a value)
NO_SECRET_FOR_MAC = "payload carries a MAC and this reader has no secret"
NO_MAC = "payload written without the secret (no MAC)"
MAC_MISMATCH = "payload MAC mismatch (forged, or written with another secret)"
NO_BLAKE3 = "payload MAC is keyed BLAKE3 and the blake3 package is not installed"
NO_GMAC = "payload MAC is AES-GMAC and the cryptography package is not installed"
LEGACY_MAC = ("payload MAC is an older kind or format (keyed BLAKE2b/BLAKE3, or format 2) and this "
              "reader accepts only AES-GMAC in format 3 (accept_legacy_macs=False)")
# What `integrity` says when the payload checksum verified and only the MAC did not: the value is
# intact, just not this reader's to restore (another tenant's, an unkeyed writer's, or a legacy
# value a permissive tenant of the namespace may still read).
MAC_ONLY = (NO_SECRET_FOR_MAC, NO_MAC, MAC_MISMATCH, NO_BLAKE3, NO_GMAC, LEGACY_MAC)


class Keyed:
    """A tenant's secret: signs payloads on write and checks them on read (see the module
    docstring). The secret never leaves this object: no repr, never in a log line.

    `accept_legacy_macs=False` verifies only what this kvtier writes, AES-GMAC in format 3: MAC
    kinds 1-2 and format 2 are refused (LEGACY_MAC, a counted miss): format 2's key repeats with
    its salt (module docstring), and each construction still read is one more a forger can aim at.
    True (the default) reads them, so an upgrade keeps its cache; turn it off once values written
    before the upgrade have expired."""

    __slots__ = ("_key2", "_key3", "_keyg", "kind", "accept_legacy_macs")

    def __init__(self, secret: bytes, kind: int | None = None, *, accept_legacy_macs: bool = True) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < SECRET_MIN_BYTES:
            raise ConfigError(f"a kvtier secret must be at least {SECRET_MIN_BYTES} bytes "
                              "(e.g. `head -c 32 /dev/urandom > secret`); got a shorter or non-bytes value")
        # blake2b takes keys of up to 64 bytes, blake3 exactly 32: both derived from the secret
        self._key2 = bytes(secret) if len(secret) <= 64 else hashlib.blake2b(bytes(secret)).digest()
        self._key3 = hashlib.blake2b(bytes(secret), digest_size=32, person=b"kvtier-key3-v1").digest()
        self._keyg = hashlib.blake2b(bytes(secret), digest_size=64, person=b"kvtier-gmac-v1").digest()
        self.kind = kind if kind is not None else default_kind()
        if self.kind == MAC_BLAKE3 and _blake3 is None:
            raise ConfigError("MAC kind blake3 needs the blake3 package: `pip install blake3`")
        if self.kind == MAC_GMAC and _Cipher is None:
            raise ConfigError("MAC kind AES-GMAC needs the cryptography package: `pip install cryptography`")
        if not isinstance(accept_legacy_macs, bool):
            raise ConfigError(f"accept_legacy_macs={accept_legacy_macs!r} must be True or False")
        if not accept_legacy_macs and self.kind != MAC_GMAC:  # it would refuse its own writing
            raise ConfigError(f"accept_legacy_macs=False reads AES-GMAC only, and this secret writes MAC kind "
                              f"{self.kind}; `pip install cryptography` (AES-GMAC) or keep accept_legacy_macs=True")
        self.accept_legacy_macs = accept_legacy_macs

    def __repr__(self) -> str:
        return "Keyed(<secret>)"

    def mac(self, header: ChunkHeader, data: object, kind: int | None = None) -> bytes:
        kind = self.kind if kind is None else kind
        h = self._hasher(header, kind)
        h.update(as_bytes_view(data)[:header.payload_bytes])
        return h.digest()

    def _gmac_key(self, header: ChunkHeader, covered: bytes) -> bytes:
        """The value's own GMAC key (module docstring): keyed BLAKE2b of the secret over the header
        bytes the MAC covers, checksum zeroed (so a seal can derive it before the checksum is
        known), so it binds salt, namespace, chunk, span, length, dtype
        and creation time; format 2 values (read only) over the salt alone."""
        if header.format_version == FORMAT_SALTED:
            return hashlib.blake2b(header.mac_salt, key=self._keyg, digest_size=32,
                                   person=b"kvtier-gmac-key").digest()
        return self._gmac_key_bound(covered[:CHECKSUM_AT] + bytes(8) + covered[CHECKSUM_AT + 8:])

    def _gmac_key_bound(self, covered: bytes) -> bytes:
        """A format 3 key: `covered` has its checksum zeroed already."""
        return hashlib.blake2b(covered, key=self._keyg, digest_size=32, person=b"kvtier-gmac-k3").digest()

    def _hasher(self, header: ChunkHeader, kind: int) -> _Digest | _Gmac:
        """The keyed hash of `kind`, fed the header (its MAC fields zeroed, its salt kept) already."""
        head = _covered(header)
        if kind == MAC_GMAC:
            return _gmac(self._gmac_key(header, head), head)
        if kind == MAC_BLAKE3:
            return _Digest(_blake3.blake3(head, key=self._key3, max_threads=1), True)  # one core
        h = hashlib.blake2b(key=self._key2, digest_size=MAC_BYTES, person=_MAC_PERSON)
        h.update(head)
        return _Digest(h, False)

    def unverifiable(self, header: ChunkHeader) -> str | None:
        """Why this secret can never verify `header`'s payload (no MAC, a MAC kind this build
        cannot compute, or a legacy one it refuses), or None: then `stream` / `copy_check` decide."""
        if not header.mac:
            return NO_MAC
        if not self.accept_legacy_macs and (header.mac_kind != MAC_GMAC or header.format_version != FORMAT_BOUND):
            return LEGACY_MAC
        if header.mac_kind == MAC_BLAKE3 and _blake3 is None:
            return NO_BLAKE3
        if header.mac_kind == MAC_GMAC and _Cipher is None:
            return NO_GMAC
        return None

    def stream(self, header: ChunkHeader) -> MacStream:
        """A MAC check fed piece by piece (`update`, then `verdict`), for readers that land a
        payload in pieces (the disk tier's cold reads). `header` must pass `unverifiable`."""
        return MacStream(self._hasher(header, header.mac_kind), header.mac)

    def copy_check(self, header: ChunkHeader, src: object, dst: memoryview) -> str | None:
        """Copy the payload `src` into `dst` and check its MAC in the same pass: each MAC_PIECE is
        copied, then hashed from `dst` while it is still in the core's L2, so the bytes come from
        memory once. None when the MAC verifies; else why not, and `dst` then holds bytes that
        must not be used (the caller reports a miss). The MAC covers header and bytes, so no
        checksum pass is needed besides it (module docstring)."""
        why = self.unverifiable(header)
        if why is not None:
            return why
        view = as_bytes_view(src)
        n = header.payload_bytes
        if len(view) != n or len(dst) < n:
            return f"payload truncated: {len(view)} of {n} bytes"
        h = self._hasher(header, header.mac_kind)
        # the hash's own update, bound once, and numpy views made once: per 256 KiB piece this
        # loop is two slices and two calls (a keyed load of 61 MiB is ~250 pieces)
        update = h._g.authenticate_additional_data if isinstance(h, _Gmac) else h._h.update
        if _np is None:
            for a in range(0, n, MAC_PIECE):
                b = min(a + MAC_PIECE, n)
                dst[a:b] = view[a:b]
                update(dst[a:b])
        else:
            d, s, copyto = _np.frombuffer(dst, _np.uint8, n), _np.frombuffer(view, _np.uint8), _np.copyto
            for a in range(0, n, MAC_PIECE):
                piece = d[a:a + MAC_PIECE]
                copyto(piece, s[a:a + MAC_PIECE])  # without the GIL (a memoryview slice assignment holds it)
                update(piece)  # hashed from the caller's buffer, what the caller will use
        return MacStream(h, header.mac).verdict()

    def sign(self, header: ChunkHeader, data: object) -> ChunkHeader:
        """`header` (sealed: checksum and creation time set) with the MAC of it and `data` (and,
        for MAC_GMAC, a fresh random salt, which the MAC covers)."""
        if self.kind == MAC_GMAC:
            header = _with_mac(header, b"", 0, os.urandom(MAC_SALT_BYTES))
        return _with_mac(header, self.mac(header, data), self.kind, header.mac_salt)

    def seal(self, header: ChunkHeader, data: object) -> bytes | None:
        """The encoded header of `data` under `header` (unsealed): its checksum, creation time, salt
        and MAC; what `encode_header(sign(seal(header, data), data))` gives, without building the
        two ChunkHeaders in between (a keyed save seals every value of a batch). Two passes over
        the bytes: the xxh3 checksum, then the GMAC of the header carrying it and the bytes (GCM
        takes the header first, so its MAC cannot start before the checksum is known). None for
        another MAC kind, a header sealed already, or bytes not of the header's length: the
        caller seals, then signs."""
        view = as_bytes_view(data)
        if (self.kind != MAC_GMAC or header.checksum_kind != CHECKSUM_NONE or DEFAULT_CHECKSUM != CHECKSUM_XXH3
                or len(view) != header.payload_bytes):
            return None
        covered = sealing_body(header, time.time_ns(), os.urandom(MAC_SALT_BYTES))
        key = self._gmac_key_bound(covered)  # the checksum is zero in `covered`
        value = checksum(view, CHECKSUM_XXH3)
        g = _gmac(key, covered[:CHECKSUM_AT] + value.to_bytes(8, "little") + covered[CHECKSUM_AT + 8:])
        g.update(view)
        return with_seal(covered, value, g.digest(), MAC_GMAC)

    def check(self, header: ChunkHeader, data: object) -> str | None:
        """Why `data` under `header` is not this secret's writing, or None when the MAC verifies."""
        why = self.unverifiable(header)
        if why is not None:
            return why
        if not hmac.compare_digest(header.mac, self.mac(header, data, header.mac_kind)):
            return MAC_MISMATCH
        return None


# copy_check's piece: copied, then hashed while still in L2, on one thread (the MAC then reads
# each piece from this core's cache, not another's)
MAC_PIECE = 256 << 10


class _Digest:
    """A keyed BLAKE3 or BLAKE2b hash with one `digest()` of MAC_BYTES. Both `update`s release the
    GIL on large inputs."""

    __slots__ = ("_h", "_b3")

    def __init__(self, h: object, b3: bool) -> None:
        self._h, self._b3 = h, b3

    def update(self, data: object) -> None:
        self._h.update(data)  # type: ignore[attr-defined]

    def digest(self) -> bytes:
        return self._h.digest(MAC_BYTES) if self._b3 else self._h.digest()  # type: ignore[attr-defined,no-any-return]


def _gmac(key: bytes, head: bytes) -> _Gmac:
    """AES-256-GMAC under `key` (nonce zero: one key a value), fed `head` already."""
    g = _Cipher(_algorithms.AES(key), _GCM).encryptor()
    g.authenticate_additional_data(head)
    return _Gmac(g)


class _Gmac:
    """A GCM encryptor fed only associated data: its tag is the GMAC, cut to MAC_BYTES (all 16).
    `authenticate_additional_data` runs without the GIL, like the hashes' `update`."""

    __slots__ = ("_g",)

    def __init__(self, g: object) -> None:
        self._g = g

    def update(self, data: object) -> None:
        self._g.authenticate_additional_data(data)  # type: ignore[attr-defined]

    def digest(self) -> bytes:
        self._g.finalize()  # type: ignore[attr-defined]
        return self._g.tag[:MAC_BYTES]  # type: ignore[attr-defined,no-any-return]


class MacStream:
    """One payload's MAC fed piece by piece; `verdict()` is None when it matches the header's."""

    __slots__ = ("_h", "_want")

    def __init__(self, h: _Digest | _Gmac, want: bytes) -> None:
        self._h, self._want = h, want

    def update(self, data: object) -> None:
        self._h.update(data)

    def verdict(self) -> str | None:
        return None if hmac.compare_digest(self._h.digest(), self._want) else MAC_MISMATCH


def default_kind() -> int:
    """The MAC a new `Keyed` writes here: the fastest this build can compute."""
    if _Cipher is not None:
        return MAC_GMAC
    return MAC_BLAKE3 if _blake3 is not None else MAC_BLAKE2B


def mac_name() -> str:
    """Which MAC a new `Keyed` computes here (what the benches report)."""
    return {MAC_GMAC: "AES-256-GMAC (a key per value)", MAC_BLAKE3: "keyed BLAKE3-128 (cryptography not installed)",
            MAC_BLAKE2B: "keyed BLAKE2b-128 (cryptography and blake3 not installed)"}[default_kind()]


def _covered(h: ChunkHeader) -> bytes:
    """The header bytes a MAC covers, before the payload: the encoded header with MAC and MAC kind
    zeroed and the salt kept (`_without_mac`)."""
    return encode_header(_without_mac(h))[:HEADER_BODY_BYTES]


def _without_mac(h: ChunkHeader) -> ChunkHeader:
    """What a MAC covers: the header with MAC and MAC kind zeroed; the salt stays (it is part of
    what the writer signed: a changed salt is another key, so a MAC mismatch)."""
    return _with_mac(h, b"", 0, h.mac_salt) if h.mac or h.mac_kind else h


def _with_mac(h: ChunkHeader, mac: bytes, kind: int, salt: bytes = b"") -> ChunkHeader:
    return ChunkHeader(h.namespace_id, h.chunk_hash, h.group, h.token_start, h.token_end,
                       h.payload_bytes, h.dtype, h.checksum, h.checksum_kind, h.created_ns,
                       h.format_version, mac, kind, salt)


def integrity(keyed: Keyed | None, header: ChunkHeader, data: object) -> str | None:
    """After the payload checksum verified: None when `data` may be restored, else why not.
    Without a secret, an unMACed payload passes (every writer of the tier is trusted) and a MACed
    one is NO_SECRET_FOR_MAC (a plain miss: the reader cannot check it, the slot is kept)."""
    if keyed is None:
        return NO_SECRET_FOR_MAC if header.mac else None
    return keyed.check(header, data)


def mac_only(why: str | None) -> bool:
    """Whether `why` (from `integrity`) says only that the MAC is not this reader's: the value is
    intact, written by another tenant sharing the namespace or by a writer without a secret. A
    shared tier (Redis) keeps such a value, a counted miss: deleting it would let tenants evict
    each other. A forgery also lands here; it cannot be told from another tenant's value, and
    deleting it would not stop a writer who can write it again."""
    return why in MAC_ONLY


def read_private_file(path: str, what: str, max_bytes: int = SECRET_FILE_MAX_BYTES) -> bytes:
    """The bytes of a secret's file (a tenant secret, a Redis password), refused with one line
    naming `what` and the fix unless it is a regular file of this user, mode 0600 or 0400, of at
    most `max_bytes`.

    The file is opened once (O_NOFOLLOW: a symlink is refused, it could name another user's
    file; O_NONBLOCK: a FIFO cannot hang the open) and every check is made on that descriptor,
    before a byte is read, so nothing can swap the file between the checks and the read (nor
    can a character device such as /dev/zero be read until memory runs out)."""
    import errno
    import os
    import stat

    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{what}={path!r} is a symbolic link; name the file itself "
                              "(a regular file of this user, mode 0600)") from None
        raise ConfigError(f"{what}={path!r} cannot be read ({exc.strerror}); create it (mode 0600)") from None
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}={path!r} is not a regular file ({_file_kind(st.st_mode)}); "
                              "put the secret in a file of this user with mode 0600")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{what}={path!r} is owned by uid {st.st_uid}, not by this user "
                              f"(uid {os.geteuid()}); run `chown {os.geteuid()} {path}` or use a file of your own")
        if mode & 0o077:
            raise ConfigError(f"{what}={path!r} is readable by others (mode {mode:o}); run `chmod 600 {path}`")
        if mode not in (0o600, 0o400):
            raise ConfigError(f"{what}={path!r} has mode {mode:o}, not 600 or 400; run `chmod 600 {path}`")
        if st.st_size > max_bytes:
            raise ConfigError(f"{what}={path!r} is {st.st_size} bytes; a secret file holds at most "
                              f"{max_bytes} bytes (e.g. `head -c 32 /dev/urandom > {path}`)")
        chunks: list[bytes] = []
        got = 0
        while got <= max_bytes:  # the size can change under us: never read past the limit
            part = os.read(fd, max_bytes + 1 - got)
            if not part:
                break
            chunks.append(part)
            got += len(part)
    except OSError as exc:
        raise ConfigError(f"{what}={path!r} cannot be read ({exc.strerror}); create it (mode 0600)") from None
    finally:
        os.close(fd)
    if got > max_bytes:
        raise ConfigError(f"{what}={path!r} grew past {max_bytes} bytes while being read; "
                          "a secret file holds at most that")
    return b"".join(chunks).rstrip(b"\r\n")


def _file_kind(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def keyed_from_file(path: str, what: str, *, accept_legacy_macs: bool = True) -> Keyed:
    """The tenant secret kept in the private file `path` (`read_private_file`)."""
    return Keyed(read_private_file(path, what), accept_legacy_macs=accept_legacy_macs)


SECRET_FILE_ENV = "KVTIER_SECRET_FILE"
SECRET_ENV = "KVTIER_SECRET"


def load_secret(secret: bytes | None = None, secret_file: str | None = None, *, what: str = "kvtier.secret_file",
                accept_legacy_macs: bool = True, missing: str | None = None) -> Keyed | None:
    """The tenant secret, resolved in the documented order (docs/store.md, "Threat model"): the
    caller's own `secret` bytes (`Store(secret=...)`), else the private file `secret_file` (vLLM's
    `kvtier.secret_file`; `what` names it in errors), else the file named by `KVTIER_SECRET_FILE`,
    else `KVTIER_SECRET`; None when none is set. The one loader the Store and the vLLM config call,
    once, at start; what it returns is handed to the tiers (never kept in a config value an engine
    logs: `Keyed` has no repr of its secret). `accept_legacy_macs=False` needs a secret: without
    one, ConfigError(`missing`, or a generic line)."""
    if secret is not None:
        keyed: Keyed | None = Keyed(secret, accept_legacy_macs=accept_legacy_macs)
    elif secret_file is not None:
        keyed = keyed_from_file(secret_file, what, accept_legacy_macs=accept_legacy_macs)
    else:
        keyed = keyed_from_env(accept_legacy_macs=accept_legacy_macs)
    if keyed is None and accept_legacy_macs is not True:
        raise ConfigError(missing or f"accept_legacy_macs={accept_legacy_macs!r} needs a secret: give one, or set "
                                     f"{SECRET_FILE_ENV} / {SECRET_ENV}")
    return keyed


def keyed_from_env(*, accept_legacy_macs: bool = True) -> Keyed | None:
    """The secret from `KVTIER_SECRET_FILE` (a file of this user, mode 0600) or `KVTIER_SECRET`;
    None when neither is set."""
    import os

    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return keyed_from_file(path, SECRET_FILE_ENV, accept_legacy_macs=accept_legacy_macs)
    value = os.environ.get(SECRET_ENV)
    return Keyed(value.encode(), accept_legacy_macs=accept_legacy_macs) if value else None
