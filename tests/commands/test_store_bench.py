"""`kvtier bench store --json` runs end to end and reports every ratio the issue names."""

from __future__ import annotations

import json

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
