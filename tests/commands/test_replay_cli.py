"""`kvtier replay` end to end on small traces: JSON shape, table, sweep plot, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier.cli import main

GEOM = {"name": "toy", "tokens_per_hash": 16, "groups": [
    {"name": "full", "kind": "full", "num_layers": 1, "tokens_per_block": 16,
     "bytes_per_token_per_layer": 2},
    {"name": "swa", "kind": "sliding", "window": 128, "num_layers": 1, "tokens_per_block": 16,
     "bytes_per_token_per_layer": 2}]}


@pytest.fixture
def files(tmp_path):
    geom = tmp_path / "g.json"
    geom.write_text(json.dumps(GEOM))
    trace = tmp_path / "t.jsonl"
    rows = [[1, 2], [1, 2, 3], [1, 4], [1, 2]]
    trace.write_text("\n".join(json.dumps({"timestamp": i, "input_length": 512 * len(h),
                                           "output_length": 9, "hash_ids": h})
                               for i, h in enumerate(rows)))
    return str(trace), str(geom)


def test_json_rows_with_min(files, capsys):
    trace, geom = files
    # 2 chunks of both groups = 2 * 2048 bytes: the hand-derived run of test_replay (LRU 3/9),
    # every chunk warm in the proportional share (the rule before issue 39)
    rc = main(["replay", trace, "--geometry", geom, "--tier", "cpu=4096", "--policy", "lru",
               "--policy", "fifo", "--placement", "every", "--share", "proportional", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in doc["policies"]}
    assert list(rows) == ["lru", "fifo", "min"]
    assert (rows["lru"]["hit_chunks"], rows["lru"]["total_chunks"]) == (3, 9)
    assert rows["lru"]["hit_rate"] == pytest.approx(3 / 9)
    assert rows["min"]["hit_chunks"] == 5
    assert doc["chunk_tokens"] == 512 and doc["unique_chunks"] == 4
    assert rows["lru"]["tiers"] == {"cpu": 4096}


def test_table_and_compare_accounting(files, capsys):
    trace, geom = files
    rc = main(["replay", trace, "--geometry", geom, "--tier", "cpu=50%", "--compare-accounting"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "MIN" in out and "row-per-key" in out and "learned" in out  # the default share
    # 50% of 4 unique chunks of both groups = 2 rows: per-group gets 2 slots per group (the
    # learned share starts proportional), row-per-key 1 slot per group. The default evicts by
    # worth (a sliding group placed where hits land); the layout-blind row-per-key row by recency
    lines = [ln for ln in out.splitlines() if " lru " in f" {ln} "]
    assert len(lines) == 1 and "row-per-key" in lines[0]
    worth = [ln for ln in out.splitlines() if "worth(w=0, tuned)" in ln]
    assert len(worth) == 1 and "learned" in worth[0]


def test_sweep_plot_writes_png(files, tmp_path, capsys):
    trace, geom = files
    png = tmp_path / "curve.png"
    rc = main(["replay", trace, "--geometry", geom, "--sweep", "25%,50%,100%", "--plot", str(png),
               "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["policies"]) == 6  # 3 capacities x (lru + min)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    full = [r for r in doc["policies"] if r["tiers"]["cpu"] == doc["footprint_bytes"]]
    assert {r["hit_chunks"] for r in full} == {5}  # everything fits: every reuse hits


@pytest.mark.parametrize("argv,msg", [
    (["--policy", "mru"], "unknown eviction policy 'mru'"),
    (["--tier", "cpu"], "--tier 'cpu' is not NAME=VALUE"),
    (["--tier", "cpu=1"], "less than one chunk"),
    (["--tier", "cpu=1XB"], "unknown unit"),
    (["--chunk-tokens", "768"], "do not nest"),
    (["--tier", "nvme=1G"], "no bandwidth for tier 'nvme'"),
])
def test_errors_are_one_line_exit_2(files, capsys, argv, msg):
    trace, geom = files
    rc = main(["replay", trace, "--geometry", geom, *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and msg in err and err.count("\n") == 1


def test_console_script_and_shipped_geometry(files):
    trace, _ = files
    out = subprocess.run([sys.executable, "-m", "kvtier", "replay", trace, "--geometry",
                          "gpt-oss-120b-fp8kv", "--tier", "cpu=50%", "--json"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["groups"] == {"sliding": 18 * 1024 * 512, "full": 18 * 1024 * 512}
    bad = subprocess.run([sys.executable, "-m", "kvtier", "replay", trace, "--geometry", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: geometry 'nope'")


def test_share_fractions(files, capsys):
    trace, geom = files
    # 8192 bytes, 1024-byte chunks per group: full 0.75 -> 6 slots, swa 0.25 -> 2 slots
    rc = main(["replay", trace, "--geometry", geom, "--tier", "cpu=8192", "--share",
               "full=0.75,swa=0.25", "--json"])
    assert rc == 0
    row = json.loads(capsys.readouterr().out)["policies"][0]
    assert row["share"] == "full=0.75,swa=0.25"
    rc = main(["replay", trace, "--geometry", geom, "--share", "full=x"])
    assert rc == 2 and "not a number" in capsys.readouterr().err


def test_help_states_the_conventions():
    out = subprocess.run([sys.executable, "-m", "kvtier", "replay", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    for phrase in ("timestamp order", "Hit rate = hit chunks / all chunks", "512-token block",
                   "MIN", "1%,2%,5%"):
        assert phrase in out.stdout


def test_compute_saved_from_a_config_json(files, capsys):
    trace, _ = files
    from pathlib import Path

    import kvtier

    config = Path(kvtier.__file__).parent / "data" / "configs" / "llama-3-8b.json"
    rc = main(["replay", trace, "--geometry", str(config), "--tier", "cpu=100%", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert "model_type 'llama'" in doc["cost_model"]["compute"]
    lru = doc["policies"][0]
    # attention's quadratic term: a prefix's tokens attend to fewer keys than the tail's, so
    # the FLOPs share is below the token share (the old 2 x params estimate made them equal)
    assert 0 < lru["compute_saved"] < lru["token_hit_rate"] < 1
    rc = main(["replay", trace, "--geometry", str(config), "--tier", "cpu=100%"])
    out = capsys.readouterr().out
    assert "compute saved" in out


def test_placement_hits_stores_sliding_chunks_cold_away_from_endpoints(files, capsys):
    trace, geom = files
    rc = main(["replay", trace, "--geometry", geom, "--tier", "cpu=100%", "--placement", "hits", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["policies"]
    # everything fits: the same hits as every-chunk storing (cold entries still serve)
    assert rows[0]["hit_chunks"] == 5


def test_default_is_hits_land_with_the_learned_share(files, capsys):
    trace, geom = files
    rc = main(["replay", trace, "--geometry", geom, "--tier", "cpu=100%", "--json"])
    assert rc == 0
    default = json.loads(capsys.readouterr().out)["policies"][0]
    assert default["share"] == "learned" and default["share_final"] == {"cpu": {"full": 0.5, "swa": 0.5}}
    rc = main(["replay", trace, "--geometry", geom, "--tier", "cpu=100%", "--placement", "hits",
               "--share", "learned", "--json"])
    assert rc == 0
    explicit = json.loads(capsys.readouterr().out)["policies"][0]
    # the same writes as the explicit flags; every chunk warm writes as much here (window 128:
    # a hit reads one swa chunk, and both rows store every chunk once, warm or cold)
    assert {k: default[k] for k in ("hit_chunks", "written_bytes")} == \
        {k: explicit[k] for k in ("hit_chunks", "written_bytes")}
    rc = main(["replay", trace, "--geometry", geom, "--tier", "cpu=100%", "--placement", "every",
               "--share", "proportional", "--json"])
    old = json.loads(capsys.readouterr().out)["policies"][0]
    assert old["share"] == "proportional" and old["share_final"] is None
    assert old["hit_chunks"] == default["hit_chunks"] == 5



def _rows(argv, capsys):
    assert main(["replay", *argv, "--json"]) == 0
    return [r for r in json.loads(capsys.readouterr().out)["policies"] if r["policy"] != "min"]


def test_the_default_policy_is_tuned_worth_on_a_hybrid_and_lru_on_one_group(tmp_path, capsys):
    """No --policy: `kvtier.index.tuning.default_policy`, the Store's and vLLM's "auto": on a
    hybrid geometry under placement hits the same row as --policy worth (tuned), with
    --placement every or one full-attention group the same row as --policy lru."""
    trace = tmp_path / "conv.jsonl"
    head = (Path(kvtier.__file__).parent / "data" / "mooncake_conversation_head.jsonl").read_text()
    trace.write_text("".join(head.splitlines(keepends=True)[:400]))
    same = ("hit_chunks", "hit_tokens", "written_bytes", "evictions", "flops_saved", "share_final")
    for geom, placement, policy, label in (("gemma-3-27b", [], "worth", "worth(w=0, tuned)"),
                                           ("gemma-3-27b", ["--placement", "every"], "lru", "lru"),
                                           ("llama-3-8b", [], "lru", "lru")):
        base = [str(trace), "--geometry", geom, "--tier", "cpu=5%", *placement]
        default, explicit = _rows(base, capsys), _rows([*base, "--policy", policy], capsys)
        assert len(default) == len(explicit) == 1
        assert default[0]["policy"] == explicit[0]["policy"] == label, (geom, placement)
        assert default[0]["hit_chunks"] > 0
        for k in same:
            assert default[0][k] == explicit[0][k], (geom, placement, k)


def test_the_default_tunes_w_on_a_hybrid_once_the_run_is_long_enough(tmp_path, capsys, monkeypatch):
    """No --policy on a hybrid: replay's tuner does tune (here every 256 chunks after the first
    eviction instead of 32768, so a short trace is long enough), scoring its shadows inline."""
    import kvtier.replay.run as run

    tuners = []
    real = run.worth_index

    def short_period(*args, **kw):
        kw["period"] = 256
        index, tuner = real(*args, **kw)
        tuners.append(tuner)
        return index, tuner

    monkeypatch.setattr(run, "worth_index", short_period)
    trace = tmp_path / "conv.jsonl"
    head = (Path(kvtier.__file__).parent / "data" / "mooncake_conversation_head.jsonl").read_text()
    trace.write_text("".join(head.splitlines(keepends=True)[:300]))
    rows = _rows([str(trace), "--geometry", "gemma-3-27b", "--tier", "cpu=5%"], capsys)
    assert len(rows) == 1 and rows[0]["policy"].endswith(", tuned)")
    assert len(tuners) == 1 and tuners[0].runner == "inline" and tuners[0].shadow.cold_in_first
    counts = tuners[0].counts()
    assert counts["worth_tunings"] >= 1 and counts["worth_tunings_failed"] == 0, counts
    assert len(tuners[0].tunings) == counts["worth_tunings"]
