"""Keyed integrity of stored payloads: a tenant secret MACs every disk and Redis payload.

The payload checksums (`payload`) catch torn writes and bit rot, not an attacker: a writer of a
shared tier can keep a tenant's header fields, put in its own bytes and recompute both checksums.
With a secret, every payload also carries a 128-bit keyed MAC (keyed BLAKE3 where the `blake3`
package is installed, else keyed BLAKE2b; the kind travels in the header) over its header and
bytes, stored in the header's MAC field, and a reader with the secret restores only payloads
whose MAC verifies. See docs/store.md, "Threat model". Split from `payload` (the format) because
the secret and its checks are their own job.
"""

from __future__ import annotations

import hashlib
import hmac

from kvtier.errors import ConfigError
from kvtier.store.payload import (HEADER_BODY_BYTES, MAC_BLAKE2B, MAC_BLAKE3, MAC_BYTES, ChunkHeader,
                                  as_bytes_view, encode_header)


SECRET_MIN_BYTES = 16
SECRET_FILE_MAX_BYTES = 64 << 10  # a secret or a password file is tiny; more is a mistake (or /dev/zero)
_MAC_PERSON = b"kvtier-mac-v1"
try:  # optional: keyed BLAKE3 is ~10x keyed BLAKE2b on this machine's cores
    import blake3 as _blake3
except ImportError:  # pragma: no cover - exercised where blake3 is absent
    _blake3 = None
NO_SECRET_FOR_MAC = "payload carries a MAC and this reader has no secret"
NO_MAC = "payload written without the secret (no MAC)"
MAC_MISMATCH = "payload MAC mismatch (forged, or written with another secret)"
NO_BLAKE3 = "payload MAC is keyed BLAKE3 and the blake3 package is not installed"
# What `integrity` says when the payload checksum verified and only the MAC did not: the value is
# intact, just not this reader's to restore (another tenant's, or an unkeyed writer's).
MAC_ONLY = (NO_SECRET_FOR_MAC, NO_MAC, MAC_MISMATCH, NO_BLAKE3)


class Keyed:
    """A tenant's secret: signs payloads on write and checks them on read (see the module
    docstring). The secret never leaves this object: no repr, never in a log line."""

    __slots__ = ("_key2", "_key3", "kind")

    def __init__(self, secret: bytes, kind: int | None = None) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < SECRET_MIN_BYTES:
            raise ConfigError(f"a kvtier secret must be at least {SECRET_MIN_BYTES} bytes "
                              "(e.g. `head -c 32 /dev/urandom > secret`); got a shorter or non-bytes value")
        # blake2b takes keys of up to 64 bytes, blake3 exactly 32: both derived from the secret
        self._key2 = bytes(secret) if len(secret) <= 64 else hashlib.blake2b(bytes(secret)).digest()
        self._key3 = hashlib.blake2b(bytes(secret), digest_size=32, person=b"kvtier-key3-v1").digest()
        self.kind = kind if kind is not None else (MAC_BLAKE3 if _blake3 is not None else MAC_BLAKE2B)
        if self.kind == MAC_BLAKE3 and _blake3 is None:
            raise ConfigError("MAC kind blake3 needs the blake3 package: `pip install blake3`")

    def __repr__(self) -> str:
        return "Keyed(<secret>)"

    def mac(self, header: ChunkHeader, data: object, kind: int | None = None) -> bytes:
        kind = self.kind if kind is None else kind
        head = encode_header(_without_mac(header))[:HEADER_BODY_BYTES]
        body = as_bytes_view(data)[:header.payload_bytes]
        if kind == MAC_BLAKE3:
            h3 = _blake3.blake3(head, key=self._key3, max_threads=1)  # one core: the engine's are busy
            h3.update(body)  # releases the GIL
            return h3.digest(MAC_BYTES)
        h = hashlib.blake2b(key=self._key2, digest_size=MAC_BYTES, person=_MAC_PERSON)
        h.update(head)
        h.update(body)  # update() releases the GIL
        return h.digest()

    def sign(self, header: ChunkHeader, data: object) -> ChunkHeader:
        """`header` (sealed: checksum and creation time set) with the MAC of it and `data`."""
        return _with_mac(header, self.mac(header, data), self.kind)

    def check(self, header: ChunkHeader, data: object) -> str | None:
        """Why `data` under `header` is not this secret's writing, or None when the MAC verifies."""
        if not header.mac:
            return NO_MAC
        if header.mac_kind == MAC_BLAKE3 and _blake3 is None:
            return NO_BLAKE3
        if not hmac.compare_digest(header.mac, self.mac(header, data, header.mac_kind)):
            return MAC_MISMATCH
        return None


def _without_mac(h: ChunkHeader) -> ChunkHeader:
    return _with_mac(h, b"", 0) if h.mac or h.mac_kind else h


def _with_mac(h: ChunkHeader, mac: bytes, kind: int) -> ChunkHeader:
    return ChunkHeader(h.namespace_id, h.chunk_hash, h.group, h.token_start, h.token_end,
                       h.payload_bytes, h.dtype, h.checksum, h.checksum_kind, h.created_ns,
                       h.format_version, mac, kind)


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
    before a byte is read, so nothing can swap the file between the checks and the read.
    Rejected: `stat(path)` then `open(path)` (the path can change in between, and a character
    device such as /dev/zero was read until memory ran out)."""
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


def keyed_from_file(path: str, what: str) -> Keyed:
    """The tenant secret kept in the private file `path` (`read_private_file`)."""
    return Keyed(read_private_file(path, what))


def keyed_from_env() -> Keyed | None:
    """The secret from `KVTIER_SECRET_FILE` (a file of this user, mode 0600) or `KVTIER_SECRET`;
    None when neither is set."""
    import os

    path = os.environ.get("KVTIER_SECRET_FILE")
    if path:
        return keyed_from_file(path, "KVTIER_SECRET_FILE")
    value = os.environ.get("KVTIER_SECRET")
    return Keyed(value.encode()) if value else None
