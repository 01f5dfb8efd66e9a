"""`kvtier plan`: the JSON shape, the human table, and one-line errors for every bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_has_exactly_the_issue_shape(capsys, geometry_path) -> None:
    rc, out, err = run(capsys, "plan", str(geometry_path("gemma-3-27b-example")), "--json",
                       "--hit-tokens", "3200")
    assert rc == 0
    doc = json.loads(out)  # exactly one object on stdout
    assert list(doc) == ["chunk_tokens", "tokens_per_hash", "hit_tokens", "restore_bytes",
                         "naive_restore_bytes", "groups", "compute"]
    # hand-derived in tests/core/test_plan.py: C = 1056, T = 3168
    assert (doc["chunk_tokens"], doc["tokens_per_hash"], doc["hit_tokens"]) == (1056, 16, 3168)
    assert doc["restore_bytes"] == 747110400
    assert doc["naive_restore_bytes"] == 3 * (86507520 + 449839104 + 37748736)
    for g in doc["groups"]:
        assert list(g) == ["name", "kind", "cacheable", "tokens_per_block", "blocks_per_chunk",
                           "chunk_bytes", "restore_chunks"]
    assert [(g["name"], g["blocks_per_chunk"], g["restore_chunks"]) for g in doc["groups"]] == [
        ("global", 66, 3), ("local", 66, 1), ("gdn", 1, 1), ("tail", None, None)]
    assert doc["groups"][3]["cacheable"] is False and doc["groups"][3]["chunk_bytes"] == 540672
    # the vLLM warning (4-token tail under a 16-token hash) goes to stderr, not into the JSON
    assert "warning:" in err and "'tail'" in err


def test_json_without_a_hit(capsys, config_path) -> None:
    rc, out, _ = run(capsys, "plan", str(config_path("gpt-oss-20b")), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["hit_tokens"] is None and doc["restore_bytes"] is None
    assert doc["naive_restore_bytes"] is None
    assert all(g["restore_chunks"] is None for g in doc["groups"])


def test_compute_saved_and_bytes_read_per_hit_length(capsys, config_path) -> None:
    from kvtier.core.cost import compute_model
    from kvtier.core.load import load_geometry
    from kvtier.core.plan import make_plan

    path = config_path("qwen3-next-80b-a3b")
    rc, out, _ = run(capsys, "plan", str(path), "--json", "--chunk-tokens", "512", "--hit-tokens", "5000")
    doc = json.loads(out)
    hits = doc["compute"]["hits"]
    assert rc == 0 and "qwen3_next" in doc["compute"]["source"]
    # one chunk doubling up to the hit (rounded down to 4608), the last four of them and the hit
    assert [h["hit_tokens"] for h in hits] == [512, 1024, 2048, 4096, 4608]
    geometry = load_geometry(path)
    model, plan = compute_model(json.loads(path.read_text()), geometry), make_plan(geometry, chunk_tokens=512)
    for h in hits:
        assert h["flops_saved"] == model.flops(h["hit_tokens"])
        assert h["restore_bytes"] == plan.restore_bytes(h["hit_tokens"])
        assert set(h["flops_by_group"]) == {"linear_attention", "full"}
    assert [h["flops_saved"] for h in hits] == sorted(h["flops_saved"] for h in hits)
    rc, out, _ = run(capsys, "plan", str(path), "--chunk-tokens", "512", "--hit-tokens", "1024")
    table = out[out.index("prefill compute a hit saves"):].splitlines()
    assert table[1].split()[:3] == ["hit", "tokens", "FLOPs"] and "bytes read" in table[1]
    assert [r.split()[0] for r in table[3:5]] == ["512", "1024"]


def test_human_table_deepseek_v4_like(capsys, geometry_path) -> None:
    rc, out, _ = run(capsys, "plan", str(geometry_path("deepseek-v4-like")), "--hit-tokens", "1024")
    assert rc == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("group"))
    for col in ("kind", "layers", "tok/block", "blocks/chunk", "chunk bytes", "restore@1024"):
        assert col in header
    rows = {line.split()[0]: line.split() for line in lines if line.split()
            and line.split()[0] in {"compressed", "swa", "indexer", "indexer_tail", "mtp"}}
    assert rows["swa"][1:5] == ["sliding(W=128)", "43", "64", "4"]
    assert rows["indexer_tail"][1:5] == ["full", "1", "4", "64"]
    assert "not cached: draft" in " ".join(rows["mtp"])
    assert "bytes per cached token" in out
    assert "12720128 B" in out and "32006144 B" in out  # restore vs naive, hand-derived
    # mixed tokens per block: vLLM takes one blocks_per_chunk (each group chunks its own blocks);
    # a token chunk size would be refused, so none is printed
    assert '"blocks_per_chunk": 1' in out and '"kvtier.chunk_tokens"' not in out
    # vLLM's native connector: 4/8-token groups under a 64-token hash, mixed tokens per block
    assert "'indexer' has 8 tokens per block, fewer than the hash unit (64)" in out
    assert "needs one tokens-per-block" in out


def test_extra_config_has_blocks_per_chunk_when_one_count_fits(capsys, config_path) -> None:
    rc, out, _ = run(capsys, "plan", str(config_path("gemma-3-270m")), "--chunk-tokens", "512",
                     "--block-size", "16")
    line = next(x for x in out.splitlines() if x.strip().startswith("{"))
    doc = json.loads(line)
    assert rc == 0 and doc["kv_connector"] == "KvtierConnector"
    assert doc["kv_load_failure_policy"] == "recompute"
    assert doc["kv_connector_extra_config"] == {
        "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm.spec",
        "blocks_per_chunk": 32, "kvtier.chunk_tokens": 512,  # 512 / 16-token blocks
        "kvtier.tiers": "cpu", "kvtier.cpu_bytes": "4GiB"}
    assert "warning" not in out


def test_extra_config_omits_blocks_per_chunk_when_the_block_size_was_defaulted(capsys, config_path) -> None:
    # a config.json says nothing of the engine's blocks: 16 is a default, wrong for vLLM on CPU
    rc, out, _ = run(capsys, "plan", str(config_path("gemma-3-270m")), "--chunk-tokens", "512")
    line = next(x for x in out.splitlines() if x.strip().startswith("{"))
    extra = json.loads(line)["kv_connector_extra_config"]
    assert rc == 0 and "blocks_per_chunk" not in extra and extra["kvtier.chunk_tokens"] == 512
    assert "give --block-size" in out


def test_dtype_and_block_size_for_a_config_json(capsys, config_path) -> None:
    rc, out, _ = run(capsys, "plan", str(config_path("llama-3-8b")), "--json", "--dtype", "float32",
                     "--block-size", "32")
    doc = json.loads(out)
    # 2 * 8 * 128 * 4 B * 32 layers = 262144 B per token; C = 256 (32 * 8)
    assert rc == 0 and doc["tokens_per_hash"] == 32
    assert doc["groups"][0]["blocks_per_chunk"] == 8
    assert doc["groups"][0]["chunk_bytes"] == 256 * 262144


def test_blocks_per_chunk_per_group(capsys, geometry_path) -> None:
    rc, out, _ = run(capsys, "plan", str(geometry_path("deepseek-v4-like")), "--json",
                     "--blocks-per-chunk", "compressed=2,swa=8,indexer=64,indexer_tail=128")
    assert rc == 0 and json.loads(out)["chunk_tokens"] == 512


BAD = [
    (["missing.json"], "does not exist"),
    (["@DIR"], "no config.json"),
    (["@BADJSON"], "not valid JSON"),
    (["@BINARY"], "UTF-8"),
    (["@LIST"], "neither"),
    (["@UNKNOWNFIELD"], "unknown field 'colour'"),
    (["@MISSINGFIELD"], "missing field 'tokens_per_block'"),
    (["@UNSUPPORTED"], "'mystery'"),
    (["@EXAMPLE", "--chunk-tokens", "500"], "valid chunk sizes"),
    (["@EXAMPLE", "--chunk-tokens", "0"], "positive multiple"),
    (["@EXAMPLE", "--chunk-tokens", "many"], "invalid int"),
    (["@EXAMPLE", "--blocks-per-chunk", "x"], "not a number"),
    (["@EXAMPLE", "--blocks-per-chunk", "global=a"], "NAME=N"),
    (["@EXAMPLE", "--blocks-per-chunk", "=3"], "NAME=N"),
    (["@EXAMPLE", "--blocks-per-chunk", "nope=3"], "'nope'"),
    (["@EXAMPLE", "--blocks-per-chunk", "global=16,local=8"], "span"),
    (["@EXAMPLE", "--blocks-per-chunk", "0"], "positive"),
    (["@EXAMPLE", "--chunk-tokens", "1056", "--blocks-per-chunk", "66"], "not allowed with"),
    (["@EXAMPLE", "--hit-tokens", "-1"], ">= 0"),
    (["@EXAMPLE", "--hit-tokens", "ten"], "invalid int"),
    (["@EXAMPLE", "--dtype", "float16"], "drop --dtype"),
    (["@CONFIG", "--dtype", "int3"], "'int3'"),
    (["@CONFIG", "--block-size", "0"], "block_size"),
    (["@CONFIG", "--block-size", "-16"], "block_size"),
    ([], "GEOMETRY"),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a) or "no-args" for a, _ in BAD])
def test_every_bad_input_is_one_error_line_and_exit_2(capsys, tmp_path: Path, geometry_path,
                                                      config_path, argv, words) -> None:
    example = json.loads(geometry_path("gemma-3-27b-example").read_text())
    files = {
        "@DIR": tmp_path,
        "@EXAMPLE": geometry_path("gemma-3-27b-example"),
        "@CONFIG": config_path("llama-3-8b"),
    }
    contents: dict[str, bytes] = {
        "@BADJSON": b'{"groups": [',
        "@BINARY": b"\x89PNG\r\n\x1a\n\xff\xfe",
        "@LIST": b"[1, 2, 3]",
        "@UNKNOWNFIELD": json.dumps({**example, "groups": [{**example["groups"][0], "colour": 1}]}).encode(),
        "@MISSINGFIELD": json.dumps({**example, "groups": [
            {k: v for k, v in example["groups"][0].items() if k != "tokens_per_block"}]}).encode(),
        "@UNSUPPORTED": json.dumps({"model_type": "mystery", "num_hidden_layers": 2,
                                    "mamba_d_state": 16}).encode(),
    }
    args = []
    for a in argv:
        if a in contents:
            p = tmp_path / f"{a[1:].lower()}.json"
            p.write_bytes(contents[a])
            a = str(p)
        elif a in files:
            a = str(files[a])
        elif a == "missing.json":
            a = str(tmp_path / a)
        args.append(a)
    rc, out, err = run(capsys, "plan", *args)
    assert rc == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert words in lines[0]


def test_console_script_error_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama", "num_hidden_layers": "many", "num_attention_heads": 4}')
    kvtier = Path(sys.executable).parent / "kvtier"
    cmd = [str(kvtier)] if kvtier.exists() else [sys.executable, "-m", "kvtier"]
    res = subprocess.run([*cmd, "plan", str(bad)], capture_output=True, text=True,
                         env={**os.environ, "KVTIER_DEBUG": ""})
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1
    assert "Traceback" not in res.stderr and "'num_hidden_layers'" in res.stderr
