"""`kvtier bench redis`: every ratio against the strongest raw redis-py client of this build
(hiredis' C parser or redis-py's own), each baseline reported beside it, and the save's measured
limit (raw SET plus the seal's passes over the same bytes) next to how close the tier runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.commands.bench_redis import _figures

sys.path.insert(0, str(Path(__file__).parents[1]))
from redis_servers import have_redis, redis_server  # noqa: E402


def test_each_ratio_is_against_the_strongest_raw_client_and_the_limit_adds_the_seal() -> None:
    """Medians in seconds: the stronger raw load is hiredis' (4 ms against 10), the stronger raw
    save redis-py's own parser's here (5 ms against 6); a keyed save's limit is raw / (raw + xxh3
    + MAC), and without the xxh3 pass raw / (raw + MAC)."""
    t = {"kv_save": [8.0e-3], "raw_save_hiredis": [6.0e-3], "raw_save_pure": [5.0e-3],
         "kv_load": [2.0e-3], "raw_load_hiredis": [4.0e-3], "raw_load_pure": [10.0e-3],
         "wire_save": [4.0e-3], "wire_load": [1.0e-3], "xxh3": [1.0e-3], "mac": [2.0e-3]}
    res = _figures(t, 1 << 20, 16, 1, True)
    assert res["raw_load_strongest"] == "hiredis" and res["load_ratio"] == pytest.approx(2.0)
    assert res["load_ratio_pure"] == pytest.approx(5.0)
    assert res["raw_save_strongest"] == "pure" and res["save_ratio"] == pytest.approx(5 / 8)
    assert res["save_ratio_hiredis"] == pytest.approx(6 / 8)
    assert res["raw_save_gb_s"] == pytest.approx(16 * (1 << 20) / 5e-3 / 1e9)
    assert res["save_limit_ratio"] == pytest.approx(5 / 8) and res["save_of_limit"] == pytest.approx(1.0)
    assert res["save_limit_mac_only_ratio"] == pytest.approx(5 / 7)
    assert res["wire_load_gb_s"] == pytest.approx(16 * (1 << 20) / 1e-3 / 1e9)
    del t["mac"]
    assert _figures(t, 1 << 20, 16, 1, False)["save_limit_ratio"] == pytest.approx(5 / 6)


def test_the_bench_reports_both_raw_clients_and_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("hiredis")
    if not have_redis():
        pytest.fail("redis-server is not installed; `make test` installs it (scripts/ensure-redis.sh)")
    with redis_server() as srv:
        rc = main(["bench", "redis", "--url", srv.url, "--chunks", "4", "--chunk-bytes", "65536",
                   "--rounds", "3", "--secret", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["hiredis"] is True and res["keyed"] is True
    for op in ("save", "load"):
        clients = {c: res[f"raw_{op}_{c}_gb_s"] for c in ("hiredis", "pure")}
        assert res[f"raw_{op}_strongest"] == max(clients, key=clients.get)  # type: ignore[arg-type]
        assert res[f"{op}_ratio"] == pytest.approx(res[f"kvtier_{op}_gb_s"] / max(clients.values()))
        assert res[f"wire_{op}_gb_s"] > 0
    assert 0 < res["save_limit_ratio"] < res["save_limit_mac_only_ratio"] < 1
    assert res["xxh3_ms"] > 0 and res["mac_ms"] > 0
