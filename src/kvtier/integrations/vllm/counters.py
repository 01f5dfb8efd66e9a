"""kvtier's counter files: each side's counts (scheduler, every worker), written as JSON under
`<kvtier.directory>/metrics` so a test or an operator can read what happened inside an engine
whose workers live in other processes, and handed to vLLM's stats path (stats.py).

`Metrics` counts; `read_metrics` / `read_info` sum what every process wrote. Every name counted
is declared once in kvtier.core.counters (VLLM), which stats.py exports on vLLM's stats path.

The files stay because commands a user runs read them: `kvtier bench serve` (the per-tier
restored tokens of the `vllm serve` processes it starts, from `read_metrics`, and their plans'
groups from `read_info`) and `kvtier bench vllm` (`loaded_blocks`); the e2e drivers under
tests/e2e/vllm read them the same way. They also carry what /metrics cannot: `info` (sizes,
not counters) and `loaded_chunks_group<g>` flat by name.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
import weakref
from dataclasses import dataclass, field

from kvtier.core.counters import VLLM

log = logging.getLogger("kvtier.vllm")

_COUNT_LOCK = threading.Lock()
_FLUSH_LOCK = threading.Lock()
FLUSH_INTERVAL_S = 1.0  # the counter file is rewritten at most this often (and at most this late)


@dataclass(eq=False)  # identity, not value: kept in a WeakSet for the exit flush
class Metrics:
    """Counters of one side (scheduler or worker), written as JSON into
    `<kvtier.directory>/metrics/<role>-<pid>.json` so a test or an operator can read what
    happened inside an engine whose workers live in other processes, and handed to vLLM's own
    stats path (`take_delta`, stats.py) so `vllm serve`'s /metrics shows them. The directory and
    its files follow the disk tier's rules (`_open_metrics_dir`, below): never through a link,
    never into a directory another user could write.

    The file is rewritten at most every `interval_s`, on a timer thread, never by the engine
    thread that counts: the first count after a write arms one timer, which writes everything
    counted until it fires (so the file is at most `interval_s` behind, and an idle engine's last
    counts still land). Forced writes (`flush(force=True)`) happen at start, when the workers'
    layout arrives, at shutdown, and at process exit for anything unwritten. Never per call: that
    would be a JSON dump and a rename per engine step."""

    role: str
    directory: str | None
    counts: dict[str, int] = field(default_factory=dict)
    info: dict[str, int] = field(default_factory=dict)  # sizes, not summed across processes
    interval_s: float = FLUSH_INTERVAL_S
    _dirty: bool = False
    _pruned: bool = False
    _warned: bool = False  # the counter directory was refused and that was logged
    # counts since the last take_delta(), by (counter name, group label): vLLM's stats path
    _delta: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)
    _timer: threading.Timer | None = field(default=None, repr=False)
    _last_write: float = float("-inf")  # time.monotonic() of the last write (or timer firing)

    def __post_init__(self) -> None:
        if self.directory is not None:
            _LIVE.add(self)

    def add(self, name: str, n: int = 1, group: int | None = None) -> None:
        """Count `n` under `name` (the file's key), a counter declared in kvtier.core.counters
        (VLLM; an undeclared name raises UndeclaredCounter); `group` (kvtier's plan group index)
        labels it on vLLM's stats path where the caller knows it."""
        VLLM.check(name)
        with _COUNT_LOCK:  # the worker's background I/O thread counts too
            self.counts[name] = self.counts.get(name, 0) + n
            if n:
                key = (name, "" if group is None else str(group))
                self._delta[key] = self._delta.get(key, 0) + n
            self._dirty = True
            timer = self._arm()
        if timer is not None:
            _start(self, timer)

    def take_delta(self) -> dict[tuple[str, str], int]:
        """What was counted since the last call, by (counter name, group label or "")."""
        with _COUNT_LOCK:
            delta, self._delta = self._delta, {}
        return delta

    def flush(self, force: bool = False) -> None:
        """force: write the file now. Otherwise only make sure a write is due within
        `interval_s` (counting already does that)."""
        if self.directory is None:
            return
        if not force:
            with _COUNT_LOCK:
                timer = self._arm() if self._dirty else None
            if timer is not None:
                _start(self, timer)
            return
        with _FLUSH_LOCK:  # the engine thread, the timer and the exit flush may all write
            self._write(force=True)

    def _arm(self) -> threading.Timer | None:
        """Under _COUNT_LOCK: a timer to start (outside the lock) unless one is pending."""
        if self.directory is None or self._timer is not None:
            return None
        delay = max(0.0, self._last_write + self.interval_s - time.monotonic())
        self._timer = threading.Timer(delay, self._on_timer)
        self._timer.daemon = True  # never holds a process open; the exit flush writes instead
        return self._timer

    def _on_timer(self) -> None:
        with _COUNT_LOCK:
            self._timer = None  # a count from now on arms the next write, interval_s from now
            self._last_write = time.monotonic()
        with _FLUSH_LOCK:
            self._write(force=False)

    def _write(self, force: bool) -> None:
        if self.directory is None or not (self._dirty or force):
            return
        try:  # never create kvtier.directory itself, never fail the engine over a counter file
            dfd = _open_metrics_dir(self.directory)
        except _Refused as exc:
            self._dirty = True
            if not self._warned:  # once, not at every write (the timer retries after each count)
                self._warned = True
                log.warning("kvtier: %s; counters are not written to files (vLLM's /metrics still "
                            "has them)", exc)
            return
        except OSError:  # kvtier.directory missing, read-only, full: written next time
            self._dirty = True
            return
        try:
            if not self._pruned:  # one file per process id forever was the old behaviour
                self._pruned = True
                _prune_dead(dfd)
            with _COUNT_LOCK:
                counts = dict(self.counts)
                self._dirty = False  # an add() after this copy marks it dirty again
                if force:
                    self._last_write = time.monotonic()
            data = json.dumps({"role": self.role, "pid": os.getpid(), "time": time.time(),
                               "counts": counts, "info": self.info}).encode()
            _replace_file(dfd, f"{self.role}-{os.getpid()}", data)
            self._warned = False
        except OSError:
            self._dirty = True  # written next time
        finally:
            os.close(dfd)


def _start(metrics: Metrics, timer: threading.Timer) -> None:
    try:
        timer.start()
    except RuntimeError:  # no new threads at interpreter shutdown: the exit flush writes it
        with _COUNT_LOCK:
            if metrics._timer is timer:
                metrics._timer = None


# Every Metrics with a directory, for the exit flush and for a forked child (whose copy of a
# pending timer never fires). Weak: a Metrics a test dropped is not kept alive.
_LIVE: weakref.WeakSet[Metrics] = weakref.WeakSet()


def _flush_all_at_exit() -> None:
    """Registered when this module is imported, so it runs after the worker's I/O lane has
    landed its queued writes (atexit runs handlers last registered first)."""
    for m in list(_LIVE):
        with _FLUSH_LOCK:
            m._write(force=False)


def _forget_in_child() -> None:
    """A forked child's copies are the parent's counters: their pending timers never fire there,
    and the child must not write them again at its exit under its own pid."""
    for m in list(_LIVE):
        m._timer = None
    _LIVE.clear()


atexit.register(_flush_all_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)


# The counter directory and its files follow the disk tier's rules (store/tiers/disk_files.py):
# `metrics/` is created 0700 and opened without following a link, and used only when it is a real
# directory of this user that nobody else may write; every file in it is opened relative to its
# fd, without following a link. A file is written under a random temporary name (created
# O_EXCL, 0600) and renamed over its final name: a link planted at the final name is replaced,
# never written through, and no temporary name can be planted in advance (the old one was
# `<role>-<pid>.tmp`, written with write_text: through a planted link it overwrote a root-owned
# 0600 file). An unsafe directory is not written at all, with one warning: rejected, raising
# (the engine would stop over a diagnostics file whose counts vLLM's /metrics carries anyway)
# and tightening it with chmod (an operator's 0777 may be meant, and a directory another user
# could write may already hold what they planted).
METRICS_DIR = "metrics"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
# the names kvtier writes in metrics/: `<role>-<pid>.json` and its temporary `<role>-<pid>.<hex>.tmp`
COUNTER_FILE_RE = re.compile(r"^(?:scheduler|worker\d+)-(\d{1,10})(?:\.json|\.[0-9a-f]{16}\.tmp)$")
READ_LIMIT_BYTES = 1 << 20  # a counter file is a few KiB; a larger one is not kvtier's


class _Refused(Exception):
    """The counter directory is not one kvtier may write (the message says why and the fix)."""


def _open_metrics_dir(directory: str) -> int:
    """`<directory>/metrics`, created 0700 when missing (never `directory` itself), opened
    without following a link and checked: its fd. Raises _Refused, or OSError."""
    path = os.path.join(directory, METRICS_DIR)
    try:
        os.mkdir(path, 0o700)  # does not follow a link at `path` (FileExistsError)
    except FileExistsError:
        pass
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _Refused(f"counter directory {path!r} is a symlink or not a directory; remove it "
                           "(kvtier creates it 0700)") from None
        raise
    st = os.fstat(dfd)
    why = None
    if st.st_uid != os.geteuid():
        why = (f"counter directory {path!r} is owned by uid {st.st_uid}, not by this user (uid "
               f"{os.geteuid()}); kvtier writes only into a directory it owns: remove it")
    elif st.st_mode & 0o022:
        why = (f"counter directory {path!r} is writable by group or others (mode "
               f"{stat.S_IMODE(st.st_mode):o}); run `chmod 700 {path!r}`")
    if why is not None:
        os.close(dfd)
        raise _Refused(why)
    return dfd


def _replace_file(dfd: int, stem: str, data: bytes) -> None:
    """Write `<stem>.json` in directory `dfd` atomically (readers never see half a file)."""
    tmp = f"{stem}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=dfd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, f"{stem}.json", src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise


def _alive(pid: int) -> bool:
    """Whether `pid` may be a live process (True when unsure: its file is kept)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # alive but not ours (EPERM), or no pid at all: kept
        return True
    return True


def _prune_dead(dfd: int) -> None:
    """Remove the counter files of processes that have exited (their pid is gone), so the
    directory holds the live processes' files and the last engine's until a new one starts.
    Only names kvtier writes (COUNTER_FILE_RE) that are regular files of this user: another
    program's file, another user's, a link, a FIFO are left alone."""
    me, uid = os.getpid(), os.geteuid()
    for name in os.listdir(dfd):
        m = COUNTER_FILE_RE.match(name)
        if m is None or int(m.group(1)) in (0, me) or _alive(int(m.group(1))):
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                os.unlink(name, dir_fd=dfd)  # never follows a link (one swapped in meanwhile goes)
        except OSError:
            continue


def _counter_files(directory: str | os.PathLike[str]) -> list[dict]:
    """Every side's counter file under `<directory>/metrics`, by name: regular files only, never
    through a link (directory or file), a FIFO opened O_NONBLOCK and skipped, never waited on."""
    try:
        dfd = os.open(os.path.join(directory, METRICS_DIR), os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError:
        return []
    out: list[dict] = []
    try:
        for name in sorted(os.listdir(dfd)):
            if not name.endswith(".json"):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dfd)
            except OSError:  # a link (ELOOP), or gone meanwhile
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size > READ_LIMIT_BYTES:
                    continue
                chunks = []
                while data := os.read(fd, READ_LIMIT_BYTES):
                    chunks.append(data)
            finally:
                os.close(fd)
            out.append(json.loads(b"".join(chunks)))
    finally:
        os.close(dfd)
    return out


def read_metrics(directory: str | os.PathLike[str]) -> dict[str, int]:
    """Sum every side's counters found under `<directory>/metrics` (all processes so far)."""
    total: dict[str, int] = {}
    for data in _counter_files(directory):
        for k, v in data.get("counts", {}).items():
            total[k] = total.get(k, 0) + int(v)
    return total


def read_info(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The size facts the sides recorded (vLLM's row bytes, kvtier's chunk bytes per group)."""
    out: dict[str, int] = {}
    for data in _counter_files(directory):
        out.update(data.get("info", {}))
    return out
