"""Real redis-server processes for tests: a standalone server and a 3-master Redis Cluster.

Every server is started by kvtier's one redis-server starter (`kvtier.loadgen.servers.redis_server`:
its own process group, stopped if this process dies), runs on a free loopback port, in its own
temp directory, with persistence off, and is stopped (SIGTERM, then SIGKILL) by `stop()`, by the context managers, and at interpreter exit as
a last resort, so no test leaves a process behind. Faults are real: `kill()` is SIGKILL,
`pause()`/`resume()` are SIGSTOP/SIGCONT (a server that accepts connections but never answers),
and `restart()` starts a fresh process on the same port.

Usable from any test:

    from redis_servers import redis_server, redis_cluster    # tests/ is on sys.path (see below)
    with redis_server() as srv:        srv.url  -> "redis://127.0.0.1:PORT/0"
    with redis_server(tls=True, password="pw") as srv:   srv.url -> "rediss://...", srv.tls.ca
    with redis_cluster() as cl:        cl.url   -> "redis+cluster://127.0.0.1:PORT"
    with redis_sentinel() as st:       st.url   -> "redis+sentinel://127.0.0.1:PORT/kvtier"

Test files outside tests/ import it after `sys.path.insert(0, str(Path(__file__).parents[1]))`.

Who can reach them: servers listen on 127.0.0.1 only, protected mode on (a stray `--bind` never
exposes a server without a password beyond loopback), and take no password unless a test asks
for one. Another local user can connect to one for the seconds it lives and touch its throwaway
data, but not the machine: Redis 7 refuses CONFIG SET of `dir`/`dbfilename` (the classic
write-a-file-as-the-server's-user escalation), MODULE LOAD and DEBUG by default. Rejected: a
password on every server, which would change every test's URL (vLLM's config refuses one in the
URL), the cluster's and Sentinel's setup (masterauth, auth-pass), and the tests of the
unauthenticated paths; the benchmarks' own servers (`kvtier bench redis` / `bench serve`) do
require a random password.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.loadgen.servers import Process, ephemeral_range
from kvtier.loadgen.servers import redis_server as start_redis_server

# The binaries: Redis by default; KVTIER_REDIS_SERVER / KVTIER_REDIS_CLI run the same tests
# against another server speaking the protocol (valkey-server / valkey-cli).
SERVER = os.environ.get("KVTIER_REDIS_SERVER", "redis-server")
CLI = os.environ.get("KVTIER_REDIS_CLI", "redis-cli")

_LIVE: set[Process] = set()


def _reap_all() -> None:  # last resort: a test that crashed before its teardown
    for server in list(_LIVE):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.pgid, signal.SIGCONT)
            os.killpg(server.pgid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            server.stop(grace_s=5)
    _LIVE.clear()


atexit.register(_reap_all)


def have_redis() -> bool:
    return shutil.which(SERVER) is not None and shutil.which(CLI) is not None


_GIVEN: set[int] = set()  # ports this process handed out: never twice


def free_port() -> int:
    """A loopback TCP port nobody listens on (bound once and released; Redis binds it next).

    Chosen so that the port and its cluster bus port (port+10000, which cluster mode needs free
    too) lie below the kernel's ephemeral range: a client connecting to a killed server's port
    in that range can be given the same port as its source and connect to itself (TCP
    self-connect), reading its own commands back as replies. A port is handed out once per
    process, so servers set up together never draw the same one before any has bound it.
    """
    lo, _ = ephemeral_range()
    top = min(lo, 65536) - 10000  # the bus port too stays below the ephemeral range
    candidates = list(range(max(1024, top - 10000), top))
    random.shuffle(candidates)
    for port in candidates:
        if port in _GIVEN:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free loopback port pair found below the ephemeral range")


def _ping(port: int, timeout_s: float = 0.2, tls: TlsFiles | None = None) -> bool:
    """A raw RESP PING (over TLS when `tls`), so this module needs no redis-py. A server that
    demands AUTH answers -NOAUTH, which still means it is up."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as raw:
            s: socket.socket = raw
            if tls is not None:
                ctx = ssl.create_default_context(cafile=str(tls.ca))
                ctx.load_cert_chain(str(tls.client_cert), str(tls.client_key))
                s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = s.recv(64)
            return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
    except OSError:
        return False


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path  # signed by the same CA, for mutual TLS
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    cert, key, csr = directory / "server.crt", directory / "server.key", directory / "server.csr"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=kvtier-test-ca", "-keyout", str(ca_key), "-out", str(ca))
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", str(key), "-out", str(csr))
    ossl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))
    ccert, ckey, ccsr = directory / "client.crt", directory / "client.key", directory / "client.csr"
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kvtier-client",
         "-keyout", str(ckey), "-out", str(ccsr))
    ossl("x509", "-req", "-in", str(ccsr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-days", "2", "-out", str(ccert))
    return TlsFiles(ca=ca, cert=cert, key=key, client_cert=ccert, client_key=ckey)


def cli(port: int, *args: str, timeout_s: float = 10.0) -> str:
    """Run `redis-cli -p PORT ARGS...` and return its stdout (raises on a non-zero exit)."""
    out = subprocess.run(
        [CLI, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True, text=True, timeout=timeout_s, check=True,
    )
    return out.stdout


class RedisServer:
    """One redis-server process on a free loopback port, in its own directory."""

    def __init__(self, directory: Path, port: int | None = None,
                 extra_args: tuple[str, ...] = (), tls: TlsFiles | None = None,
                 password: str | None = None) -> None:
        self.directory = directory
        self.port = port if port is not None else free_port()
        self.extra_args = extra_args
        self.tls = tls  # TLS only (no plain port) when set
        self.password = password  # `requirepass` of the default user when set
        self.server: Process | None = None
        self.proc: subprocess.Popen[bytes] | None = None  # the server's process (self.server.proc)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """The server started by kvtier's one starter (kvtier.loadgen.servers.redis_server: its
        own process group, stopped if this process dies), answering PING within `timeout_s`."""
        if self.alive:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        extra = list(self.extra_args)
        if self.tls is not None and "--tls-auth-clients" not in extra:
            extra += ["--tls-auth-clients", "optional"]
        tls = (self.tls.cert, self.tls.key, self.tls.ca) if self.tls is not None else None
        self.server, _ = start_redis_server(
            SERVER, self.port, self.directory, self.directory / "redis.log",
            password=self.password if self.password is not None else False, tls=tls, extra_args=extra)
        self.proc = self.server.proc
        _LIVE.add(self.server)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.server.log_tail(400)
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} exited at start: {tail}")
            if _ping(self.port, tls=self.tls):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout_s}s")

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, in case it is paused), SIGKILL if it lingers; waits for exit."""
        server, self.server, self.proc = self.server, None, None
        if server is None:
            return
        server.stop(grace_s=5)
        _LIVE.discard(server)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, as in a crash."""
        server = self.server
        if server is None:
            return
        with contextlib.suppress(ProcessLookupError):
            server.proc.kill()
        server.proc.wait(timeout=5)
        self.stop()

    def pause(self) -> None:
        """SIGSTOP: the socket stays open but nothing answers (a slow or hung server)."""
        assert self.proc is not None and self.alive
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> RedisServer:
        """A fresh process on the same port (persistence is off: it comes back empty)."""
        self.kill()
        return self.start()

    def cli(self, *args: str) -> str:
        pre: list[str] = []
        if self.tls is not None:
            pre = ["--tls", "--cacert", str(self.tls.ca), "--cert", str(self.tls.client_cert),
                   "--key", str(self.tls.client_key)]
        if self.password is not None:
            pre += ["--pass", self.password, "--no-auth-warning"]
        return cli(self.port, *pre, *args)



class RedisClusterServers:
    """Three masters, no replicas, every slot assigned; `url` is a `redis+cluster://` seed."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.nodes = [RedisServer(
            directory / f"node{i}",
            extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", "2000"),
        ) for i in range(masters)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def start(self, timeout_s: float = 20.0) -> RedisClusterServers:
        try:
            for n in self.nodes:
                n.start()
            subprocess.run(
                [CLI, "--cluster", "create",
                 *[f"127.0.0.1:{p}" for p in self.ports],
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=timeout_s, check=True,
            )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if all("cluster_state:ok" in cli(p, "cluster", "info") for p in self.ports):
                    return self
                time.sleep(0.05)
            raise RuntimeError("redis cluster did not reach cluster_state:ok")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


class RedisSentinelServers:
    """A master, one replica, and one Sentinel watching them (quorum 1, down after 1 s), so a
    killed master fails over to the replica in a few seconds. `url` is a `redis+sentinel://`."""

    SERVICE = "kvtier"

    def __init__(self, directory: Path) -> None:
        self.master = RedisServer(directory / "master")
        self.replica = RedisServer(directory / "replica",
                                   extra_args=("--replicaof", "127.0.0.1", str(self.master.port)))
        self.sentinel_dir = directory / "sentinel"
        self.sentinel_port = free_port()
        self.sentinel: Process | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.SERVICE}"

    def master_port(self) -> int:
        """The port Sentinel currently names as the master."""
        out = cli(self.sentinel_port, "sentinel", "get-master-addr-by-name", self.SERVICE)
        return int(out.split()[1])

    def sentinel_masters(self) -> str:
        """What Sentinel says of the service (flags, address, failover state): for messages."""
        return " ".join(cli(self.sentinel_port, "sentinel", "master", self.SERVICE).split())

    def start(self, timeout_s: float = 20.0) -> RedisSentinelServers:
        try:
            self.master.start()
            self.replica.start()
            self.sentinel_dir.mkdir(parents=True, exist_ok=True)
            conf = self.sentinel_dir / "sentinel.conf"  # Sentinel rewrites its config file
            conf.write_text("\n".join([
                f"port {self.sentinel_port}", "bind 127.0.0.1", "protected-mode yes",
                "daemonize no", f"dir {self.sentinel_dir}",
                f"logfile {self.sentinel_dir / 'sentinel.log'}",
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master.port} 1",
                f"sentinel down-after-milliseconds {self.SERVICE} 1000",
                f"sentinel failover-timeout {self.SERVICE} 4000",
            ]) + "\n")
            self.sentinel = Process("redis-sentinel", [SERVER, str(conf), "--sentinel"], dict(os.environ),
                                    self.sentinel_dir / "stdout.log")
            _LIVE.add(self.sentinel)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if (_ping(self.sentinel_port) and "master_link_status:up"
                        in self.replica.cli("info", "replication") and self._sentinel_knows_replica()):
                    return self
                time.sleep(0.05)
            raise RuntimeError("sentinel or replica did not come up")
        except BaseException:
            self.stop()
            raise

    def _sentinel_knows_replica(self) -> bool:
        """Sentinel learns of replicas from the master's INFO, refreshed every 10 s: one that
        asked before the replica registered has nothing to fail over to until then."""
        try:
            out = cli(self.sentinel_port, "sentinel", "replicas", self.SERVICE, timeout_s=2.0)
        except (subprocess.SubprocessError, OSError):
            return False
        return str(self.replica.port) in out

    def stop(self) -> None:
        proc, self.sentinel = self.sentinel, None
        if proc is not None:
            proc.stop(grace_s=5)
            _LIVE.discard(proc)
        self.replica.stop()
        self.master.stop()


@contextlib.contextmanager
def redis_server(*extra_args: str, tls: bool = False, mutual_tls: bool = False,
                 password: str | None = None) -> Iterator[RedisServer]:
    """A running standalone server in a temp dir (TLS-only with a throwaway CA when `tls`,
    AUTH required when `password`); stopped and removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kvtier-redis-") as d:
        files = make_tls_files(Path(d) / "tls") if tls or mutual_tls else None
        if mutual_tls:  # clients must present a certificate signed by the test CA
            extra_args = (*extra_args, "--tls-auth-clients", "yes")
        srv = RedisServer(Path(d), extra_args=tuple(extra_args), tls=files,
                          password=password).start()
        try:
            yield srv
        finally:
            srv.stop()


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[RedisClusterServers]:
    """A running 3-master cluster in a temp dir; stopped and removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kvtier-rcluster-") as d:
        cl = RedisClusterServers(Path(d), masters=masters).start()
        try:
            yield cl
        finally:
            cl.stop()


@contextlib.contextmanager
def redis_sentinel() -> Iterator[RedisSentinelServers]:
    """A master + replica + Sentinel in a temp dir; all stopped and removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kvtier-rsentinel-") as d:
        st = RedisSentinelServers(Path(d)).start()
        try:
            yield st
        finally:
            st.stop()
