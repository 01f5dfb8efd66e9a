"""The worth tuner's process runner (`kvtier.index.tuning`): one child process, one daemon thread.

Not multiprocessing: vLLM's engine core may run in a daemonic multiprocessing process, which may
have no multiprocessing children. The child is `python -P -m kvtier.index.tuning PARENT_PID`
(which runs `serve` with the tuning's scorer: this module imports nothing of it) with a trimmed
environment (the path, home, locale and temp settings, and the parent's kvtier on PYTHONPATH: no
secrets of the parent travel). It sends `MAGIC` on its answer pipe first (its own
stdout already points at stderr, so a stray print never lands in the answers), lowers its CPU
priority to idle (serving comes first), and exits when its parent is gone (a watchdog thread,
a job in flight included) or closes its pipe.

One daemon thread of the parent starts the child, writes the job and reads the answer: a job is a
length-prefixed pickle (the window as one blob of packed requests), an answer at most
`MAX_ANSWER` bytes, decoded with struct (one double per weight). Both ends are this module: no
foreign data is unpickled, and the parent unpickles nothing. A tuning due while one is in flight
is skipped by the caller; a finished one is taken at the next `take`. A child that dies, answers
garbage (before its hello too) or takes longer than `timeout_s` is a failed tuning: the next one
starts a new child. `close` never waits: the thread stops and reaps the child. A forked copy of
the parent forgets the parent's child and thread (at fork) and starts its own at its next tuning.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import site
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import IO

# a job: the shadow, the grid and the window (kvtier.index.tuning's; this module only carries it)
Job = tuple[object, tuple[float, ...], tuple[object, ...]]
Scorer = Callable[[object, tuple[float, ...], tuple[object, ...]], "list[float] | None"]

log = logging.getLogger("kvtier.index.tuning")

MAGIC = b"kvtier worth tuner 1\n"  # the child's hello, before any answer
MAX_JOB = 1 << 31  # a job's length prefix above this is garbage
MAX_ANSWER = 1 << 16  # an answer's: a few doubles or one error line
IDLE = True  # the child at idle CPU priority; tests that wait for busy children's answers say False
# and LC_*, and PYTHONPATH as computed; the loader's and Python's own paths, without which some
# installs (a shared libpython, a relocated prefix) cannot start the child at all
ENV_KEPT = ("PATH", "HOME", "LANG", "LANGUAGE", "TMPDIR", "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "PYTHONHOME")
_CHILDREN: weakref.WeakSet[Child] = weakref.WeakSet()  # every runner of this process, for fork


def command(parent: int) -> list[str]:
    """The child's argv (a test hook: tests put a fake child here)."""
    return [sys.executable, "-P", "-m", "kvtier.index.tuning", str(parent), *([] if IDLE else ["--normal"])]


class Child:
    """One child process, fed by one daemon thread (module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._closed = False
        self._fresh()
        _CHILDREN.add(self)

    def _fresh(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._since: float | None = None  # when the job in flight was handed over
        self._done: tuple[bool, list[float] | None] | None = None

    def _after_fork(self) -> None:
        """In a forked copy: the thread is gone and the child is the parent's; close the inherited
        pipe ends (unbuffered: nothing is flushed into the parent's child), never signal or wait."""
        proc = self._proc
        self._fresh()
        if proc is not None:
            proc.returncode = 0  # not this copy's child: nothing here may wait for or kill it
            for stream in (proc.stdin, proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass

    @property
    def busy(self) -> bool:
        return self._since is not None

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def submit(self, job: Job) -> bool:
        with self._lock:
            if self._since is not None or self._closed:
                return False
            self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvtier-worth-tuner", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        return True

    def take(self) -> tuple[bool, list[float] | None] | None:
        """The finished job's (ok, scores or None: skipped), once; kills a child past its time
        (read as a failure)."""
        with self._lock:
            if self._closed:
                return None
            done, self._done = self._done, None
            now = time.monotonic()
            late = done is None and self._since is not None and now - self._since > self.timeout_s
            proc = self._proc if late else None
            if late:
                self._since = now  # killed once; the thread reads the end of its pipe
        if proc is not None:
            log.warning("worth tuner: the shadow process took over %gs; stopped", self.timeout_s)
            proc.kill()
        return done

    def close(self) -> bool:
        """Stop without waiting: the thread closes the child's pipe and reaps it (a job in flight:
        the child is killed first). Returns whether a tuning was in flight."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            proc, busy = self._proc, self._since is not None
            self._since = None
        self._jobs.put(None)
        if busy and proc is not None:
            proc.kill()  # the thread's read of its answer ends; it reaps
        return busy

    def _loop(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                done = self._run(job)
                with self._lock:
                    self._done, self._since = done, None
        finally:
            self._stop()

    def _run(self, job: Job) -> tuple[bool, list[float] | None]:
        try:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            _send(proc.stdin, encode_job(job))
            answer = _recv(proc.stdout, MAX_ANSWER)
            if answer is None:
                raise EOFError(f"the shadow process exited ({proc.poll()})")
            return True, decode_answer(answer, len(job[1]))
        except Exception as exc:  # any failure of the child or its pipes: a failed tuning, w kept
            log.warning("worth tuner: tuning failed, w kept: %s", exc)
            self._stop(kill=True)
            return False, None

    def _start(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        self._stop()
        proc = subprocess.Popen(command(os.getpid()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=child_env(), bufsize=0)
        with self._lock:
            closed = self._closed
            self._proc = proc  # _stop reaps it, whatever happens next
        if closed:
            raise RuntimeError("the tuner is closed")
        assert proc.stdout is not None
        hello = _read(proc.stdout, len(MAGIC))
        if hello != MAGIC:
            raise RuntimeError(f"the shadow process did not start: it wrote {hello[:40]!r}")
        return proc

    def _stop(self, kill: bool = False) -> None:
        """Close the child's pipe (it exits at the end of its input), wait briefly, then kill
        (at once where it failed); on this thread, never the caller's."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            if not kill:
                proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        try:
            if proc.stdout is not None:
                proc.stdout.close()
        except OSError:
            pass


def _after_fork_in_child() -> None:
    for child in list(_CHILDREN):
        child._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def child_env() -> dict[str, str]:
    """What the child needs of the parent's environment (ENV_KEPT, LC_*), with the parent's
    kvtier first on PYTHONPATH unless it was installed into site-packages: the child runs the code
    its parent runs, and sees none of the parent's other settings (passwords, tokens)."""
    env = {k: v for k, v in os.environ.items() if k in ENV_KEPT or k.startswith("LC_")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds kvtier/
    sites = {os.path.abspath(p) for p in [*getattr(site, "getsitepackages", list)(),
                                           getattr(site, "getusersitepackages", str)()] if p}
    path = os.environ.get("PYTHONPATH")
    if root not in sites:
        path = os.pathsep.join(filter(None, (root, path)))
    if path:
        env["PYTHONPATH"] = path
    return env


def encode_job(job: Job) -> bytes:
    """A job's message: the shadow, the grid and the window, its packed requests as two blobs
    (their lengths, their bytes) rather than one pickled object each."""
    shadow, grid, window = job
    if all(type(r) is bytes for r in window):
        parts: tuple[object, ...] = ("packed", struct.pack(f"<{len(window)}I", *map(len, window)),
                                     b"".join(window))
    else:
        parts = ("kept", window)
    return pickle.dumps((shadow, grid, parts), protocol=pickle.HIGHEST_PROTOCOL)


def _window(parts: tuple[object, ...]) -> tuple[object, ...]:
    if parts[0] == "kept":
        return parts[1]  # type: ignore[return-value]
    _, lens, data = parts
    sizes = struct.unpack(f"<{len(lens) // 4}I", lens)  # type: ignore[arg-type]
    out, o = [], 0
    for n in sizes:
        out.append(data[o:o + n])  # type: ignore[index]
        o += n
    return tuple(out)


def decode_job(msg: bytes) -> Job:
    shadow, grid, parts = pickle.loads(msg)  # noqa: S301 - written by this module's parent end
    return shadow, tuple(grid), _window(parts)


def decode_answer(answer: bytes, k: int) -> list[float] | None:
    """b"S" + k doubles: the scores; b"N": skipped (nothing evicted); b"E" + text: a failure."""
    kind, body = answer[:1], answer[1:]
    if kind == b"S" and len(body) == 8 * k:
        scores = list(struct.unpack(f"<{k}d", body))
        if all(s == s and abs(s) != float("inf") for s in scores):
            return scores
    elif kind == b"N" and not body:
        return None
    elif kind == b"E":
        raise RuntimeError(f"the shadow failed: {body.decode(errors='replace')}")
    raise ValueError(f"the shadow process answered {answer[:40]!r}, not scores")


def _read(stream: IO[bytes], n: int) -> bytes:
    """Up to n bytes: fewer only at the end of the stream."""
    buf = b""
    while len(buf) < n:
        got = stream.read(n - len(buf))
        if not got:
            break
        buf += got
    return buf


def _send(stream: IO[bytes], data: bytes) -> None:
    view = memoryview(len(data).to_bytes(8, "big") + data)
    while view:
        view = view[stream.write(view) or 0:]
    stream.flush()


def _recv(stream: IO[bytes], limit: int) -> bytes | None:
    """One length-prefixed message; None at a clean end of stream."""
    head = _read(stream, 8)
    if not head:
        return None
    if len(head) < 8:
        raise EOFError("the stream ended inside a length prefix")
    n = int.from_bytes(head, "big")
    if n > limit:
        raise ValueError(f"a message of {n} bytes: not one of ours")
    data = _read(stream, n)
    if len(data) < n:
        raise EOFError("the stream ended inside a message")
    return data


def _lower_priority() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


def _watch(parent: int) -> None:
    """Exit once the parent is gone (its pipes may outlive it in a grandchild)."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def serve(parent: int, score: Scorer, idle: bool = True) -> None:
    """The child's loop: hello, then read a job and answer its scores until the pipe closes."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a stray print goes to stderr, never into the answers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's; its closed pipe ends us
    if idle:
        _lower_priority()
    threading.Thread(target=_watch, args=(parent,), name="kvtier-parent-watch", daemon=True).start()
    out.write(MAGIC)
    inp = sys.stdin.buffer
    while True:
        msg = _recv(inp, MAX_JOB)
        if msg is None:
            return
        try:
            scores = score(*decode_job(msg))
            answer = b"N" if scores is None else b"S" + struct.pack(f"<{len(scores)}d", *scores)
        except Exception as exc:  # the parent counts it failed and keeps w
            answer = b"E" + f"{type(exc).__name__}: {exc}".encode()[:MAX_ANSWER - 1]
        _send(out, answer)

