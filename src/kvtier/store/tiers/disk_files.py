"""The disk tier's slab files: names, strides, the namespace directory and its writer lock,
opening and sizing slab files, read-only mappings and page residency.

Files: `ROOT/<namespace id>/g<group>-<slot bytes>.kvslab`. Slot s of a file starts at
`s * stride` (stride = one 4 KiB page for the 128-byte payload header, then the slot bytes
rounded up to 4 KiB) and holds the header, zero padding, and the payload from `DATA_OFFSET`
on. The slot size is in the file name, so a restart with another plan never reads a slab with
the wrong stride, and `kvtier inspect`/`check` (`disk_scan`) read a directory without a plan.

One writer per namespace directory: `open_namespace_dir` takes an exclusive `flock` on the
directory itself and raises `TierError` naming the holder (from `.lock`) when another process (or
another tier in this process) has it. The kernel drops the lock when its process dies, even by
SIGKILL. A directory that cannot be written (read-only file system) opens read-only.

Private by default: namespace directories are created 0700 and files 0600; every open is
`O_NOFOLLOW | O_CLOEXEC`, relative to the directory's fd, and `O_NONBLOCK` wherever the file may
already exist (a FIFO named like a slab never blocks an open; it is refused after `lstat`/`fstat`
says it is not a regular file); an existing namespace directory that is not a real directory, not
this user's, or writable by group or others is refused with one line; a slab that is not a
private regular file with one link is refused. A directory of this user that is only readable
by others (kvtier before the private-by-default change left 0755 directories and 0644 slabs, so
another user could read the KV, and prompts can be reconstructed from KV) is made private on
open when it is kvtier's (it holds `.lock` or slab files): 0700, and its slabs 0600, with one
warning line; one that holds nothing of kvtier's is refused with the `chmod` to run (kvtier never
changes the mode of a directory that is not its own, and never writes into a readable one).

Split out of `disk.py` (which keeps the read and write paths) because managing files is its own
job; `disk_scan.py` is the third (directory scans for the tools).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from kvtier.errors import TierError
from kvtier.store.payload import HEADER_BYTES, ChunkHeader, Rejected, decode_header
from kvtier.store.tiers.base import TierLayout, log

ALIGN_BYTES = 4096
DATA_OFFSET = ALIGN_BYTES  # a slot's payload starts one page in: page-aligned in file and page cache
ZERO_HEADER = bytes(HEADER_BYTES)
PAD = bytearray(DATA_OFFSET - HEADER_BYTES)  # preadv's sink for the padding (contents unused)
SLAB_RE = re.compile(r"^g(\d+)-(\d+)\.kvslab$")


def _load_mincore():  # type: ignore[no-untyped-def]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):  # pragma: no cover - not Linux/BSD
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _load_mincore()
_PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(b & 1 for b in range(256))

Mapping = tuple[mmap.mmap, memoryview, int]  # the map, a view of it, its base address


def slot_stride(slot_bytes: int) -> int:
    return DATA_OFFSET + -(-slot_bytes // ALIGN_BYTES) * ALIGN_BYTES


def slab_name(group: int, slot_bytes: int) -> str:
    return f"g{group:03d}-{slot_bytes}.kvslab"


OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC  # every open: never through a symlink, never inherited
# slab files of the layout before payloads were page-aligned: never read, but they hold KV too
OLD_SLAB_RE = re.compile(r"^g(\d+)-(\d+)\.slab$")


def kind_of(mode: int) -> str:
    """What a directory entry that should be a regular file is, for a one-line message."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_unsafe(path: Path, st: os.stat_result) -> None:
    """A namespace directory must be a real directory this user owns that nobody else may write:
    anyone who can write it can swap a slab for a symlink or plant a forged one."""
    if not stat.S_ISDIR(st.st_mode):
        raise TierError(f"disk tier path {str(path)!r} is not a directory; remove it or choose another directory")
    if st.st_uid != os.geteuid():
        raise TierError(
            f"disk tier directory {str(path)!r} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); kvtier uses only directories it owns: choose another directory")
    if st.st_mode & 0o022:
        raise TierError(
            f"disk tier directory {str(path)!r} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}); run `chmod 700 {str(path)!r}` or choose another directory")


def _make_private(dfd: int, path: Path, st: os.stat_result) -> None:
    """Tighten a namespace directory that `_refuse_unsafe` accepted (a real directory of this user
    that nobody else may write) to 0700 and its slab files to 0600, where kvtier before the
    private-by-default change left them readable by everyone (0755 / 0644). Only kvtier's own: the
    directory must hold `.lock` or slab files, else it is refused with the `chmod` to run
    (rejected: tightening any directory of ours, which could be one the user shares on purpose);
    only regular slab files of this user with one link are changed, through an fd opened without
    following a link. One warning line when anything was changed. Raises TierError."""
    names = os.listdir(dfd)
    kvtiers = [n for n in names if n == ".lock" or SLAB_RE.match(n) or OLD_SLAB_RE.match(n)]
    loose = []
    for name in kvtiers:
        if name == ".lock":  # holds a pid only
            continue
        try:
            est = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        if (stat.S_ISREG(est.st_mode) and est.st_uid == os.geteuid() and est.st_nlink == 1
                and est.st_mode & 0o077):
            loose.append((name, est))
    dir_mode = stat.S_IMODE(st.st_mode)
    if not dir_mode & 0o077 and not loose:
        return
    if dir_mode & 0o077 and not kvtiers:
        raise TierError(
            f"disk tier directory {str(path)!r} is readable by group or others (mode {dir_mode:o}) and "
            f"holds nothing of kvtier's; run `chmod 700 {str(path)!r}` or choose another directory")
    try:
        if dir_mode & 0o077:
            os.fchmod(dfd, 0o700)
        for name, est in loose:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS, dir_fd=dfd)
            try:
                now = os.fstat(fd)
                if (now.st_dev, now.st_ino) == (est.st_dev, est.st_ino) and stat.S_ISREG(now.st_mode):
                    os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
    except OSError as exc:
        raise TierError(
            f"disk tier directory {str(path)!r} (mode {dir_mode:o}) and its slabs are readable by other "
            f"users and cannot be made private ({exc.strerror}); run `chmod -R go= {str(path)!r}`") from None
    log.warning("tier disk: tightened %s to mode 700 (was %o) and %d slab file(s) to 600: an earlier "
                "kvtier left them readable by other users, who could read the KV", path, dir_mode, len(loose))


def _checked_dir(path: Path) -> int:
    """The namespace directory's fd, opened without following a link, refused when unsafe and
    made private when it is kvtier's (`_refuse_unsafe`, `_make_private`). Raises TierError."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | OPEN_FLAGS)
    except OSError as exc:
        raise TierError(f"disk tier cannot open directory {str(path)!r} ({exc.strerror}); "
                        "it must be a real directory, not a symlink") from None
    try:
        st = os.fstat(dfd)
        _refuse_unsafe(path, st)
        _make_private(dfd, path, st)
    except BaseException:
        os.close(dfd)
        raise
    return dfd


def open_reader_dir(path: Path) -> int:
    """Open an existing namespace directory to read beside its writer (another process): no
    lock, nothing created; checked (and made private) as `open_namespace_dir` does it. Raises
    TierError."""
    return _checked_dir(path)


def open_namespace_dir(path: Path) -> tuple[int, str | None]:
    """Open (create 0700 if missing) a namespace directory and take its writer lock.

    Returns (directory fd, None) when locked, or (directory fd, why it is read-only) when it could
    not be written (then unlocked). The directory is opened without following a symlink, checked
    and made private (`_checked_dir`); every file in it is opened relative to its fd, so a directory
    renamed or replaced after the check is never written through. The writer
    lock is an `flock` on the directory itself, which no cleaner can delete out from under a
    writer (a `.lock` file could be); `.lock` only tells the next writer who holds it.
    Raises `TierError` when another writer holds the lock, or the directory is unsafe or can be
    neither created nor read."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise TierError(f"disk tier cannot use {str(path)!r}: {exc.strerror}") from None
        if not path.is_dir():
            raise TierError(f"disk tier directory {str(path)!r} does not exist and cannot be created: {exc.strerror}") from None
    dfd = _checked_dir(path)
    try:
        lock_fd = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | OPEN_FLAGS, 0o600, dir_fd=dfd)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            os.close(dfd)
            raise TierError(f"disk tier cannot use {str(path / '.lock')!r}: {exc.strerror}") from None
        return dfd, f"{path} is read-only ({exc.strerror}); saves will fail"
    lock_mode = os.fstat(lock_fd).st_mode
    if not stat.S_ISREG(lock_mode):
        os.close(lock_fd)
        os.close(dfd)
        raise TierError(f"disk tier lock file {str(path / '.lock')!r} is {kind_of(lock_mode)}, not a regular "
                        "file; remove it and restart")
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(dfd)
            raise TierError(
                f"disk tier directory {str(path)!r} is in use by another writer (pid {holder}); "
                "kvtier allows one writer per namespace directory: give each process its own "
                "directory, or stop the other one"
            ) from None
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
    finally:
        os.close(lock_fd)
    return dfd, None


def lock_for_tools(dfd: int) -> bool:
    """Take a namespace directory's writer lock for `kvtier check --fix` on its fd (the one the
    tool then scans and drops through, `disk_scan.open_namespace_fds`); False when another
    process holds it (never blocks). Closing the fd releases it."""
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_holder(path: Path) -> str | None:
    """The pid holding a namespace directory's writer lock ("?" when unknown), or None."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | OPEN_FLAGS)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                fd = os.open(".lock", os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS, dir_fd=dfd)
            except OSError:
                return "?"
            try:
                return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            except OSError:  # not a regular file (a FIFO cannot pread)
                return "?"
            finally:
                os.close(fd)
        fcntl.flock(dfd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(dfd)


def open_slab(dfd: int, name: str, flags: int) -> int:
    """Open one slab file inside the namespace directory `dfd`: created 0600, never through a
    symlink, and refused unless it is a regular file of this user with one link (a hard link to
    another file would write into that file) that nobody else may read. `lstat` first and
    `O_NONBLOCK`: a FIFO named like a slab is refused, never opened in a way that blocks (a
    read-only open of one waited for a writer forever: the vLLM scheduler's start-up hung)."""
    try:
        st: os.stat_result | None = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        st = None  # created below, or FileNotFoundError from the open where it may not be
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise TierError(f"disk tier slab {name!r} is {kind_of(st.st_mode)}, not a private regular file; "
                        "remove it and restart")
    fd = os.open(name, flags | os.O_NONBLOCK | OPEN_FLAGS, 0o600, dir_fd=dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        what = kind_of(st.st_mode) if not stat.S_ISREG(st.st_mode) else "a link, or another user's file"
        raise TierError(f"disk tier slab {name!r} is not a private regular file ({what}); remove it and restart")
    if st.st_mode & 0o077:  # `_make_private` tightened every slab it could: never write a readable one
        os.close(fd)
        raise TierError(f"disk tier slab {name!r} is readable by group or others (mode "
                        f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600` on it or remove it")
    return fd


def open_slabs(dfd: int, path: Path, layout: TierLayout, strides: list[int], read_only: bool) -> list[int | None]:
    """One fd per group (None: no slots, or absent in a read-only directory), each file sized to
    its capacity (sparse), so every slot lies inside the file and inside its mapping."""
    flags = os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT
    old = sorted(p.name for p in path.glob("g*-*.slab")) if path.is_dir() else []
    if old:  # the layout before payloads were page-aligned: never read, only in the way
        log.warning("tier disk: %s holds %d slab file(s) of an older kvtier layout (%s%s), which this "
                    "version ignores; delete them to free the space", path, len(old),
                    ", ".join(old[:3]), ", ..." if len(old) > 3 else "")
    fds: list[int | None] = []
    try:
        for g, (b, n) in enumerate(zip(layout.slot_bytes, layout.num_slots)):
            name = slab_name(g, b)
            if n == 0:
                fds.append(None)
                continue
            try:
                fd = open_slab(dfd, name, flags)
            except FileNotFoundError:
                if not read_only:
                    raise
                fds.append(None)
                continue
            size = os.fstat(fd).st_size
            if not read_only and size > n * strides[g]:
                os.ftruncate(fd, n * strides[g])  # capacity shrank: slots past it are gone
            elif not read_only and size < n * strides[g]:
                # new or grown: a sparse tail (no blocks used). Where the file may not grow (a file
                # size limit), it grows as slots are written and slots past its size are read with
                # preadv.
                try:
                    os.ftruncate(fd, n * strides[g])
                except OSError as exc:
                    log.warning("tier disk: cannot size %s to %d bytes (%s); slots past %d bytes are "
                                "read without the mapping", path / name, n * strides[g], exc.strerror, size)
            fds.append(fd)
    except BaseException:
        for fd in fds:
            if fd is not None:
                os.close(fd)
        raise
    return fds


def map_file(fd: int) -> Mapping | None:
    """A read-only shared mapping of the whole file, or None (no mincore, empty file, no mmap)."""
    if _MINCORE is None:
        return None
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    try:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError):  # a file system without mmap: the preadv path only
        return None
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch
        mm.close()
        return None
    view = memoryview(mm)
    return mm, view, int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def unmap(m: Mapping) -> None:
    m[1].release()
    try:
        m[0].close()
    except BufferError:  # pragma: no cover - a view still exported: freed with it
        pass


def resident(base: int, off: int, length: int) -> bool:
    """Whether every page of [off, off + length) of the mapping at `base` is in the page cache."""
    start = (base + off) // _PAGE * _PAGE
    end = base + off + length
    pages = -(-(end - start) // _PAGE)
    vec = ctypes.create_string_buffer(pages)
    if _MINCORE(start, end - start, vec) != 0:
        return False
    # bit 0 of each byte: page resident; the other bits are reserved
    return b"\0" not in vec.raw[:pages].translate(_LOW_BIT)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    total = len(view)
    while done < total:
        wrote = os.pwrite(fd, view[done:], offset + done)
        if wrote <= 0:
            raise OSError(errno.EIO, "short write")
        done += wrote


def scan_fd(fd: int, stride: int, max_slots: int | None) -> Iterator[tuple[int, ChunkHeader | Rejected]]:
    """(slot, decoded header) of every slot of a slab file whose header is not all zeros."""
    size = os.fstat(fd).st_size
    count = -(-size // stride)
    if max_slots is not None:
        count = min(count, max_slots)
    for s in range(count):
        raw = os.pread(fd, HEADER_BYTES, s * stride)
        h = decode_header(raw)
        if isinstance(h, Rejected) and h.reason.startswith("empty slot"):
            continue
        yield s, h
