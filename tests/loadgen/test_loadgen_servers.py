"""Server processes: the whole process group is stopped, a stubborn one is killed, an exited one
is reported with its log, and a server dies with the benchmark that started it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.loadgen.servers import Process, ServerFailed, free_port, group_alive


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
