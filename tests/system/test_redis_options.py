"""Caller mistakes in redis tier options raise ConfigError at construction, naming the fix;
and `kvtier bench redis` runs end to end (own server, given server, dead server, bad args)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.store.tiers.redis import RedisOptions, RedisTier
from kvtier.store.tiers.redis_conn import options_from_mapping, redact

sys.path.insert(0, str(Path(__file__).parents[1]))
from redis_servers import cli, free_port, redis_cluster, redis_server  # noqa: E402

KVTIER = str(Path(sys.executable).parent / "kvtier")


@pytest.mark.parametrize(("opts", "match"), [
    ({"url": "http://127.0.0.1:6379"}, "scheme 'http'"),
    ({"url": "unix:///tmp/r.sock", "cluster": True}, "cluster=True with a unix:"),
    ({"url": "redis+sentinel://h:1/svc", "cluster": True}, "reached with redis.cluster"),
    ({"budget_bytes": 1 << 20}, "budget_bytes needs ttl_s"),
    ({"budget_bytes": 0, "ttl_s": 5.0}, "budget_bytes=0"),
    ({"budget_bytes": 100, "ttl_s": 5.0, "touch_on_hit": True}, "outlive the budget"),
    ({"ttl_s": -1.0}, "ttl_s=-1.0"),
    ({"socket_timeout_s": 0}, "socket_timeout_s=0"),
    ({"key_prefix": "a:b"}, "key_prefix"),
    ({"max_connections": 0}, "max_connections=0"),
])
def test_bad_options_raise_with_the_fix(opts: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RedisOptions(**opts)  # type: ignore[arg-type]


def test_url_forms() -> None:
    assert RedisOptions(url="redis+cluster://10.0.0.1:7000").is_cluster
    assert RedisOptions(url="rediss+cluster://10.0.0.1:7000").is_cluster
    assert RedisOptions(url="redis://h:1/0", cluster=True).is_cluster
    assert not RedisOptions(url="rediss://h:1/0").is_cluster
    assert redact("redis://alice:s3cret@h:6379/0") == "redis://alice:***@h:6379/0"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
    assert redact("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("redis://alice@h:6379/0") == "redis://alice@h:6379/0"
    assert redact("redis+sentinel://u:pw@a:1,b:2/svc") == "redis+sentinel://u:***@a:1,b:2/svc"
    with pytest.raises(ConfigError, match="16 lowercase hex"):
        RedisTier(namespace_id="not-a-namespace")


def test_options_from_a_string_mapping() -> None:
    o = options_from_mapping({"url": "redis://h:1/0", "ttl_s": "30", "budget_bytes": "1000",
                              "cluster": "true", "socket_timeout_s": 2, "password": "pw"})
    assert (o.ttl_s, o.budget_bytes, o.cluster, o.socket_timeout_s) == (30.0, 1000, True, 2.0)
    assert "pw" not in repr(o)  # options get logged; the password must not be
    in_url = options_from_mapping({"url": "redis://alice:hunter2@h:1/0"})
    assert "hunter2" not in repr(in_url) and "alice:***@h:1" in repr(in_url)
    with pytest.raises(ConfigError, match="unknown redis option 'ttl'; valid: url"):
        options_from_mapping({"ttl": 1})
    with pytest.raises(ConfigError, match="ttl_s='x' is not a float"):
        options_from_mapping({"ttl_s": "x"})
    with pytest.raises(ConfigError, match="cluster='maybe' is not a bool"):
        options_from_mapping({"cluster": "maybe"})


def test_touch_default_follows_the_budget() -> None:
    assert RedisOptions(ttl_s=10.0).touch is True
    assert RedisOptions(ttl_s=10.0, budget_bytes=1000).touch is False


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVTIER, "bench", "redis", *args], capture_output=True, text=True,
                          timeout=120)


def _servers_in(prefix: str) -> list[int]:
    """redis-server processes whose working directory (their --dir) starts with `prefix`
    (redis-server rewrites its command line, so the directory is the way to find them)."""
    out = subprocess.run(["pgrep", "-x", "redis-server"], capture_output=True, text=True).stdout
    found = []
    for pid in map(int, out.split()):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if os.path.basename(cwd).startswith(prefix):
            found.append(pid)
    return found


def test_bench_starts_and_stops_its_own_server() -> None:
    proc = _bench("--json", "--chunks", "8", "--chunk-bytes", "65536", "--rounds", "3")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    # each ratio is the two medians measured side by side (kvtier's speed over raw SET/GET); its
    # size is the machine's to decide (one in five runs on a loaded machine gave 2.5), not a test's
    for way in ("save", "load"):
        ratio = res[f"{way}_ratio"]
        assert isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0
        assert ratio == pytest.approx(res[f"kvtier_{way}_gb_s"] / res[f"raw_{way}_gb_s"])
    assert res["chunks"] == 8 and res["chunk_bytes"] == 65536 and res["rounds"] == 3
    assert res["server"].startswith("own")
    assert not _servers_in("kvtier-bench-redis-")  # stopped


def test_bench_secret_keys_every_value(capsys: pytest.CaptureFixture[str]) -> None:
    """`--secret`: every value MACed and verified on load (the bench fails on any miss)."""
    with redis_server() as srv:
        rc = main(["bench", "redis", "--url", srv.url, "--chunks", "4", "--chunk-bytes", "4096",
                   "--rounds", "2", "--secret", "--json"])
        res = json.loads(capsys.readouterr().out)
        assert rc == 0 and res["keyed"] is True and res["load_ratio"] > 0


def test_bench_on_a_given_server_and_cluster_leaves_no_keys(
        capsys: pytest.CaptureFixture[str]) -> None:
    with redis_server() as srv:
        rc = main(["bench", "redis", "--url", srv.url, "--chunks", "4", "--chunk-bytes", "4096",
                   "--rounds", "2"])
        out = capsys.readouterr().out
        assert rc == 0 and "save" in out and "ratio" in out
        assert int(srv.cli("dbsize")) == 0
    with redis_cluster() as cl:
        rc = main(["bench", "redis", "--url", cl.url, "--json", "--chunks", "6",
                   "--chunk-bytes", "4096", "--rounds", "2"])
        assert rc == 0 and json.loads(capsys.readouterr().out)["save_ratio"] > 0
        assert sum(int(cli(p, "dbsize")) for p in cl.ports) == 0


def test_bench_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for url in (f"redis://127.0.0.1:{free_port()}/0", f"redis+cluster://127.0.0.1:{free_port()}"):
        assert main(["bench", "redis", "--url", url, "--rounds", "1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: cannot reach Redis") and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "redis", "--chunks", "x"])
    assert exc.value.code == 2 and "invalid int value" in capsys.readouterr().err
    assert main(["bench", "redis", "--chunks", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --chunks 0")


def test_importing_the_tier_loads_neither_torch_nor_redis_py() -> None:
    # the vLLM scheduler process builds a RedisTier for existence checks: it must stay light
    code = ("import sys, kvtier.store.tiers.redis as r; r.RedisTier.from_url('redis://h:1/0'); "
            "print('torch' in sys.modules, 'redis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_a_password_in_the_url_query_is_used_and_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    """redis-py takes `?password=` (and `?ssl_password=`) from the URL's query; the tier used it
    and printed it in its repr, its log lines and its errors (redaction looked at the userinfo
    only). Every credential-bearing part is redacted now, wherever the URL is shown."""
    import logging

    import torch

    from kvtier.store.payload import make_header

    assert redact("redis://h:1/0?password=s3cret") == "redis://h:1/0?password=***"
    assert redact("redis://h:1/0?db=2&ssl_password=s3cret&PassWord=x") == \
        "redis://h:1/0?db=2&ssl_password=***&PassWord=***"
    assert redact("redis://h:1/0?pass%77ord=s3cret") == "redis://h:1/0?pass%77ord=***"
    assert redact("redis://u:pw@h:1/0?password=s3cret#frag") == "redis://u:***@h:1/0?password=***#***"
    assert redact("app:s3cret@h:6379") == "***@h:6379"  # not a URL: still no password
    assert redact("redis://[::1/0?password=s3cret") == "redis://***"  # unparseable: nothing shown
    assert "s3cret" not in repr(RedisOptions(url="redis://h:1/0?password=s3cret"))
    for url in ("http://h:1/0?password=s3cret", "redis+sentinel://h/svc?password=s3cret"):
        with pytest.raises(ConfigError) as err:
            RedisOptions(url=url)
        assert "s3cret" not in str(err.value), err.value
    ns = "00112233aabbccdd"
    h = make_header(ns, b"\x07" * 16, 0, 0, 16, 64)
    data = torch.arange(64, dtype=torch.uint8)
    with redis_server(password="s3cret") as srv:
        good = RedisTier.from_url(f"{srv.url}?password=s3cret", namespace_id=ns)
        bad = RedisTier.from_url(f"{srv.url}?password=wrong-s3cret", namespace_id=ns,
                                 socket_timeout_s=5.0)
        try:
            assert good.write(0, 0, h, data)  # the query's password is used
            with caplog.at_level(logging.DEBUG, logger="kvtier"):
                assert bad.read(0, 0, h, torch.zeros(64, dtype=torch.uint8)) is False
            assert not bad.up and "AuthenticationError" in (bad.last_error or "")
            shown = [caplog.text, bad.last_error or "", repr(bad.options), repr(good.options)]
            assert "unreachable" in caplog.text and "password=***" in caplog.text
            assert not any("s3cret" in s for s in shown), shown
        finally:
            good.close()
            bad.close()


def test_bench_serve_refuses_a_redis_url_with_a_password_without_echoing_it() -> None:
    from kvtier.commands.bench_serve import redis_address

    assert redis_address("redis://10.0.0.5:6380/2") == ("10.0.0.5", 6380, 2)
    for url in ("redis://app:s3cret@10.0.0.5:6379/0", "redis://10.0.0.5:6379/0?password=s3cret"):
        with pytest.raises(ConfigError, match="without a password") as err:
            redis_address(url)
        assert "s3cret" not in str(err.value), err.value


def test_the_bench_own_server_takes_no_command_without_its_random_password() -> None:
    """`kvtier bench redis` without --url started redis-server with `--protected-mode no` and no
    password: any local user could read and write it during the run. Now it has a random
    password, set in a config file of a private directory (never on a command line)."""
    import socket
    import stat
    from urllib.parse import urlsplit

    import redis

    from kvtier.commands.bench_redis import own_server

    with own_server() as url:
        port = urlsplit(url).port
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # another local user
            s.sendall(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n")
            reply = b""
            while reply.count(b"\r\n") < 2:
                reply += s.recv(256)
        assert reply.startswith(b"-NOAUTH") and b"+OK" not in reply, reply
        password = urlsplit(url).password
        assert password is not None and len(password) >= 32
        r = redis.Redis.from_url(url)  # the bench's own clients get in
        assert r.ping() and r.set("k", "v")
        r.close()
        pids = [p for p in _servers_in("kvtier-bench-redis-")
                if f":{port}".encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(pids) == 1
        assert password.encode() not in Path(f"/proc/{pids[0]}/cmdline").read_bytes()
        d = Path(os.readlink(f"/proc/{pids[0]}/cwd"))
        assert stat.S_IMODE(d.stat().st_mode) == 0o700  # no other user reaches its files
        held = sorted(f for f in d.iterdir() if password.encode() in f.read_bytes())
        # the config file and the password file (kvtier.loadgen.servers.redis_server), both 0600
        assert [f.name for f in held] == ["password", "redis.conf"]
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in held)
    assert not [p for p in _servers_in("kvtier-bench-redis-")
                if f":{port}".encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
