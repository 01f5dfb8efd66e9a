"""`kvtier bench store --json` runs end to end and reports every ratio the issue names."""

from __future__ import annotations

import json

from pytest import approx

from kvtier.cli import main


def test_bench_store_json_has_the_ratios(capsys, tmp_path) -> None:
    code = main(["bench", "store", "--json", "--rounds", "1", "--chunks", "1", "--dir", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in ("cpu_save_ratio", "cpu_load_ratio", "disk_save_ratio", "disk_load_ratio"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["lookup_prompt_chunks"] == 131072 // 256
    assert out["lookup_chunks_per_s"] > 0
    # one chunk of 256 tokens of each of the 4 groups: full/local 16 layers x 2 KiB x 256,
    # mla 8 x 1152 x 256, state 4 x 1 MiB
    assert out["save_bytes_per_round"] == 2 * 16 * 2048 * 256 + 8 * 1152 * 256 + 4 * 2**20
    assert list(tmp_path.iterdir()) == []  # the temporary files are gone
    # unkeyed: a load's limit adds the xxh3 pass, no MAC is timed
    pl = out["disk_plain_load_ms"]
    assert out["disk_load_limit_ratio"] == approx(pl / (pl + out["disk_load_xxh3_ms"]), abs=2e-3)
    assert out["disk_save_mac_ms"] is None and out["disk_load_mac_ms"] is None


def test_bench_store_disk_pipeline_always_uses_the_helper_for_this_run_only(capsys, tmp_path) -> None:
    import kvtier.store.tiers.disk as disk

    before = disk.PIPELINE, disk.MAPPED_READS
    code = main(["bench", "store", "--json", "--rounds", "1", "--chunks", "1", "--dir", str(tmp_path),
                 "--disk-pipeline", "always", "--disk-reads", "preadv"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["disk_pipeline"] == "always" and out["disk_reads"] == "preadv"
    # 2 rounds (warm-up + 1); each saves and loads one chunk of each group, all >= 2 pieces of
    # 1 MiB (full, local: 8 MiB; mla: 8 x 1152 x 256 = 2.25 MiB; state checkpoint: 4 MiB). A save
    # is one batch on two lanes split by file (full + state | local + mla): the helper writes
    # 2 payloads; every load is a cold preadv read the helper takes part in: 2 x (2 + 4)
    assert out["disk_helper_ios"] == 12 and out["disk_mapped_reads"] == 0
    assert (disk.PIPELINE, disk.MAPPED_READS) == before


def test_bench_store_loads_resident_slots_through_the_mapping(capsys, tmp_path) -> None:
    code = main(["bench", "store", "--json", "--rounds", "1", "--chunks", "1", "--dir", str(tmp_path),
                 "--disk-pipeline", "always"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["disk_reads"] == "mapped"
    # the same 2 rounds x 4 payloads: every load just written (resident) goes through the
    # mapping; the helper thread only writes its lane (2 payloads a save)
    assert out["disk_mapped_reads"] == 8 and out["disk_helper_ios"] == 4
    assert out["checksum_path"].startswith("fused copy + xxh3_64")  # the C extension ran
    assert 0 < out["two_pass_load_ratio_bound"] < 1


def test_bench_store_secret_keys_the_disk_tier(capsys, tmp_path) -> None:
    """`--secret`: the disk tier MACs every payload and verifies it on load (the bench fails on
    any corrupt payload or failed save, so a MAC that did not verify would show here)."""
    code = main(["bench", "store", "--json", "--rounds", "1", "--chunks", "1", "--dir", str(tmp_path),
                 "--secret"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["disk_keyed"] is True
    assert out["disk_save_ratio"] > 0 and out["disk_load_ratio"] > 0


def test_the_disk_limit_adds_the_passes_each_path_makes() -> None:
    """Medians in seconds: a save adds xxh3 (and, keyed, the MAC) to plain I/O; an unkeyed load
    adds xxh3; a keyed load the MAC alone (it checks no checksum). `*_of_limit` = ratio / limit."""
    from kvtier.commands.bench_store import _limits

    med = {"plain_save": 10e-3, "save_xxh3": 2e-3, "save_mac": 3e-3,
           "plain_load": 8e-3, "load_xxh3": 2e-3, "load_mac": 4e-3, "load_mac_hot": 1e-3}
    keyed = _limits(med, {"save": 0.8, "load": 0.75}, True)
    assert keyed["disk_save_limit_ratio"] == approx(10 / 15, abs=1e-3)
    assert keyed["disk_save_of_limit"] == approx(0.8 * 15 / 10, abs=1e-3)
    assert keyed["disk_load_limit_ratio"] == approx(8 / 12, abs=1e-3)  # the MAC, not xxh3
    assert keyed["disk_load_of_limit"] == approx(0.75 * 12 / 8, abs=1e-3)
    assert keyed["disk_load_limit_hot_ratio"] == approx(8 / 9, abs=1e-3)
    assert keyed["disk_load_of_limit_hot"] == approx(0.75 * 9 / 8, abs=1e-3)
    assert (keyed["disk_plain_save_ms"], keyed["disk_save_xxh3_ms"], keyed["disk_save_mac_ms"]) == (10, 2, 3)
    assert (keyed["disk_plain_load_ms"], keyed["disk_load_xxh3_ms"], keyed["disk_load_mac_ms"]) == (8, 2, 4)
    plain = _limits({k: v for k, v in med.items() if "mac" not in k}, {"save": 0.8, "load": 0.75}, False)
    assert plain["disk_save_limit_ratio"] == approx(10 / 12, abs=1e-3)
    assert plain["disk_load_limit_ratio"] == approx(8 / 10, abs=1e-3)
    assert plain["disk_load_of_limit"] == approx(0.75 * 10 / 8, abs=1e-3)
    assert plain["disk_save_mac_ms"] is None and plain["disk_load_mac_ms"] is None
    assert "disk_load_limit_hot_ratio" not in plain


def test_bench_store_secret_reports_the_measured_limit(capsys, tmp_path) -> None:
    """`--secret`: the plain path, xxh3 and OpenSSL's MAC of the same bytes, timed in the same
    rounds, and each limit computed from them as `_limits` says."""
    code = main(["bench", "store", "--json", "--rounds", "3", "--chunks", "1", "--dir", str(tmp_path),
                 "--secret"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    ms = {k: out[k] for k in out if k.endswith("_ms") and k.startswith("disk_")}
    assert set(ms) == {f"disk_{p}_{op}_ms" for op in ("save", "load") for p in ("plain",)} | {
        f"disk_{op}_{p}_ms" for op in ("save", "load") for p in ("xxh3", "mac")} | {"disk_load_mac_hot_ms"}
    assert all(v > 0 for v in ms.values()), ms
    # within the rounding of the reported milliseconds (3 decimals)
    ps, pl = out["disk_plain_save_ms"], out["disk_plain_load_ms"]
    assert out["disk_save_limit_ratio"] == approx(
        ps / (ps + out["disk_save_xxh3_ms"] + out["disk_save_mac_ms"]), abs=2e-3)
    assert out["disk_load_limit_ratio"] == approx(pl / (pl + out["disk_load_mac_ms"]), abs=2e-3)
    assert out["disk_load_limit_hot_ratio"] == approx(pl / (pl + out["disk_load_mac_hot_ms"]), abs=2e-3)
    for op in ("save", "load"):
        assert out[f"disk_{op}_of_limit"] == approx(out[f"disk_{op}_ratio"] / out[f"disk_{op}_limit_ratio"],
                                                    rel=1e-2)
    # the plain side's ms and GB/s are the same median
    assert out["disk_plain_load_gbps"] == approx(out["load_bytes_per_round"] / (pl * 1e-3) / 1e9, abs=0.011)
