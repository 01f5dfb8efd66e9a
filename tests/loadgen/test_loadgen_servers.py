"""Server processes: the whole process group is stopped, a stubborn one is killed, an exited one
is reported with its log, and a server dies with the benchmark that started it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.loadgen.servers import Process, ServerFailed, free_port, group_alive, group_cpu_s, machine_cpu_s


def test_stop_reaches_every_process_of_the_group(tmp_path: Path) -> None:
    p = Process("sh", ["sh", "-c", "sleep 300 & sleep 300 & wait"], dict(os.environ), tmp_path / "log")
    deadline = time.monotonic() + 5
    while len(group_alive(p.pgid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_alive(p.pgid)) == 3  # the shell and its two children
    t0 = time.monotonic()
    assert p.stop(grace_s=30) is True
    assert time.monotonic() - t0 < 10  # SIGTERM reached the children too (no SIGKILL needed)
    assert group_alive(p.pgid) == [] and p.stopped is True


def test_a_zombie_is_not_a_live_process() -> None:
    child = subprocess.Popen(["true"], start_new_session=True)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert group_alive(child.pid) == []  # exited, not yet reaped
    child.wait()


def test_a_process_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    p = Process("stubborn", ["sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done"],
                dict(os.environ), tmp_path / "log")
    deadline = time.monotonic() + 5
    while b"ready" not in (tmp_path / "log").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    assert p.stop(grace_s=0.5) is True
    assert 0.5 <= time.monotonic() - t0 < 10 and group_alive(p.pgid) == []


def test_an_exited_server_is_reported_with_its_log(tmp_path: Path) -> None:
    p = Process("broken", ["sh", "-c", "echo boom-in-the-log; exit 3"], dict(os.environ), tmp_path / "log")
    p.proc.wait(timeout=10)
    with pytest.raises(ServerFailed, match=r"(?s)broken exited with code 3.*boom-in-the-log"):
        p.check_running()
    p.stop()


@pytest.mark.skipif(sys.platform != "linux", reason="PDEATHSIG is Linux's")
def test_a_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    code = ("import os, sys; from pathlib import Path; from kvtier.loadgen.servers import Process\n"
            "p = Process('s', ['sleep', '300'], dict(os.environ), Path(sys.argv[1]))\n"
            "print(p.pgid, flush=True); import time; time.sleep(0.5); os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "log")], capture_output=True,
                         text=True, timeout=30, check=True)
    pgid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_alive(pgid) == []


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_ports_lie_outside_the_ephemeral_range_and_are_not_handed_out_twice() -> None:
    from kvtier.loadgen.servers import ephemeral_range

    lo, hi = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(not lo <= p <= hi and 1024 <= p < 65536 for p in ports), (lo, hi, ports)


def _raw_replies(port: int, commands: list[list[bytes]]) -> list[bytes]:
    """Send RESP commands on a fresh connection, as any local user can; one reply line each."""
    import socket

    wire = b"".join(b"*%d\r\n" % len(c) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in c)
                    for c in commands)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(wire)
        reply = b""
        while reply.count(b"\r\n") < len(commands) and (part := s.recv(4096)):
            reply += part
    return reply.split(b"\r\n")[:len(commands)]


def test_the_bench_serve_redis_takes_no_command_without_its_password(tmp_path: Path) -> None:
    """`kvtier bench serve` started redis-server with `--protected-mode no` and no password: any
    local user could SET, CONFIG GET dir or SHUTDOWN it, directly or through the delaying proxy.
    Now it requires a random password kept in 0600 files, never on a command line, and the
    bench's engines get it through `kvtier.redis_password_file`."""
    import stat

    import torch

    from kvtier.commands.bench_serve import kv_config
    from kvtier.integrations.vllm.config import parse_config, redis_password
    from kvtier.loadgen.proxy import DelayProxy
    from kvtier.loadgen.servers import redis_server, wait_redis_ready
    from kvtier.store.payload import make_header
    from kvtier.store.tiers.redis import RedisTier

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from redis_servers import have_redis

    if not have_redis():
        pytest.fail("redis-server is not installed; `make test` installs it (scripts/ensure-redis.sh)")
    d = tmp_path / "redis"
    d.mkdir(mode=0o700)
    port = free_port()
    proc, password_file = redis_server("redis-server", port, d, tmp_path / "redis.log")
    try:
        wait_redis_ready(proc, "127.0.0.1", port, time.monotonic() + 30, password_file)
        password = password_file.read_text()
        assert len(password) >= 32 and stat.S_IMODE(password_file.stat().st_mode) == 0o600
        held = sorted(f.name for f in d.iterdir() if password.encode() in f.read_bytes())
        assert held == ["password", "redis.conf"]
        assert all(stat.S_IMODE((d / n).stat().st_mode) == 0o600 for n in held)
        assert password not in " ".join(map(str, proc.proc.args))  # /proc/PID/cmdline is public
        assert password.encode() not in Path(f"/proc/{proc.proc.pid}/cmdline").read_bytes()
        with DelayProxy("127.0.0.1", port, 0.0) as proxy:
            assert proxy.host == "127.0.0.1"
            for p in (port, proxy.port):  # another local user, directly and through the proxy
                replies = _raw_replies(p, [[b"SET", b"k", b"v"], [b"CONFIG", b"GET", b"dir"],
                                           [b"SHUTDOWN", b"NOSAVE"]])
                assert all(r.startswith(b"-NOAUTH") for r in replies), (p, replies)
            proc.check_running()  # SHUTDOWN did not reach it
            # the bench's engines: their kv_transfer_config, read as vLLM's connector reads it
            (tmp_path / "kv").mkdir()
            cfg = parse_config(kv_config(tmp_path / "kv", {
                "kvtier.tiers": "redis", "kvtier.redis_bytes": "1GiB",
                "kvtier.redis_url": f"redis://127.0.0.1:{proxy.port}/0",
                "kvtier.redis_password_file": str(password_file)})["kv_connector_extra_config"])
            tier = RedisTier.from_url(cfg.redis_url, namespace_id="00112233aabbccdd",
                                      password=redis_password(cfg))
            try:
                h = make_header("00112233aabbccdd", b"\x07" * 16, 0, 0, 16, 64)
                data = torch.arange(64, dtype=torch.uint8)
                assert tier.write(0, 0, h, data)
                out = torch.zeros(64, dtype=torch.uint8)
                assert tier.read(0, 0, h, out) and torch.equal(out, data)
            finally:
                tier.close()
            assert proxy.stats().forwarded_bytes > 64  # the tier's traffic went through it
    finally:
        assert proc.stop(grace_s=10)


def test_a_groups_cpu_seconds_are_its_own_and_the_machines_only_grow(tmp_path: Path) -> None:
    """group_cpu_s counts the CPU a server's group burns (not the machine's, not an idle group's);
    machine_cpu_s's busy, idle and steal never go back."""
    m0 = machine_cpu_s()
    idle = Process("sleep", ["sleep", "30"], dict(os.environ), tmp_path / "idle.log")
    burn = Process("burn", [sys.executable, "-c", "import time\nt = time.process_time()\n"
                            "while time.process_time() - t < 0.6: pass\ntime.sleep(30)"],
                   dict(os.environ), tmp_path / "burn.log")
    try:
        deadline = time.monotonic() + 20
        while group_cpu_s(burn.pgid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.6 <= group_cpu_s(burn.pgid) < 5.0
        assert group_cpu_s(idle.pgid) < 0.2
    finally:
        burn.stop()
        idle.stop()
    m1 = machine_cpu_s()
    assert set(m0) == set(m1) == {"busy", "idle", "steal"}
    assert all(m1[k] >= m0[k] for k in m0) and m1["busy"] - m0["busy"] >= 0.5
    assert group_cpu_s(burn.pgid) == 0.0  # gone: nothing left to count
