"""kvtier.router predicts exactly what vLLM's real Scheduler restores (vllm_engineless/
router_harness.py), on vLLM 0.32 and 0.33: a Gemma-3-like model (sliding + full, one chunk span)
and DeepSeek V4 (six groups of 64/64/64/256/4/8 tokens per block, hash unit 4, so the groups'
chunks span 64/64/64/256/4/8 tokens; with and without the MTP drafter's group). Per query the
router is asked before the request, from the events published so far; then the request runs.
Also: a prompt of exactly a whole number of chunks restores length - 1; after
reset_prefix_cache(reset_connector=True) the router holds nothing before any step; chunks stored
again after the reset are published with their token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_versions import VERSIONS, finish, start

HERE = Path(__file__).parent
DRIVER = HERE / "vllm_engineless" / "router_harness.py"

QUERIES = [["a+", 8], ["a", 1024], ["branch", 768, 300], ["branch", 700, 300], ["reset"], ["a+", 8], ["a+", 8]]
SCENARIOS = [
    {"name": "gemma3_like", "queries": [["a+", 8], ["a", 192], ["branch", 96, 60], ["reset"], ["a+", 8], ["a+", 8]]},
    {"name": "dsv4", "dsv4": "fp8_ds_mla", "mtp": False, "prompt_tokens": 1100,
     "extra": {"kvtier.cpu_bytes": "512MiB"}, "queries": QUERIES},
    {"name": "dsv4_mtp", "dsv4": "fp8_ds_mla", "prompt_tokens": 1100, "draft_groups": [1],
     "extra": {"kvtier.cpu_bytes": "512MiB"}, "queries": QUERIES},
]
_RESULTS: dict[str, dict] = {}


def _run_all() -> None:
    procs = {}
    for version in VERSIONS:
        procs[version] = start([str(DRIVER), json.dumps(SCENARIOS)], version)
    for version, driver in procs.items():
        _RESULTS[version] = finish(driver, version, timeout=600)


@pytest.fixture(params=VERSIONS, scope="module")
def results(request: pytest.FixtureRequest) -> dict:
    if not _RESULTS:
        _run_all()
    return _RESULTS[request.param]


def _ok(results: dict, name: str) -> dict:
    r = results[name]
    assert "error" not in r, f"{name}: {r.get('error')}\n{r.get('traceback', '')}"
    return r


@pytest.mark.parametrize("name", [sc["name"] for sc in SCENARIOS])
def test_the_router_predicts_what_vllms_scheduler_restores(results: dict, name: str) -> None:
    r = _ok(results, name)
    rows = [x for x in r["rows"] if "predicted" in x]
    table = "\n".join(f"{x['query']} {x['prompt_tokens']}: predicted {x['predicted']} restored {x['restored']}"
                      for x in rows)
    assert [x["predicted"] for x in rows] == [x["restored"] for x in rows], table
    assert sum(x["restored"] > 0 for x in rows) >= 2, table
    whole = rows[1]
    if name == "dsv4_mtp":  # the drafter's group needs a chunk past the hit, which 1,024 tokens lack
        assert whole["restored"] == 0, table
    else:  # a prompt of whole chunks restores all but its last token (the last chunk loaded, its
        assert whole["restored"] == whole["prompt_tokens"] - 1, table  # last token recomputed)


@pytest.mark.parametrize("name", ["dsv4", "dsv4_mtp"])
def test_deepseek_v4_groups_keep_their_own_chunk_spans(results: dict, name: str) -> None:
    groups = _ok(results, name)["summary"]["e"]["groups"]
    spans = sorted(g["chunk_tokens"] for g in groups.values())
    assert spans == sorted([64, 64, 256, 4, 8] + ([64] if name == "dsv4_mtp" else [])), groups
    assert _ok(results, name)["summary"]["e"]["counts"].get("reset_geometry", 0) == 0


@pytest.mark.parametrize("name", [sc["name"] for sc in SCENARIOS])
def test_a_connector_reset_is_published_at_once_and_stores_after_it_carry_their_tokens(results: dict,
                                                                                       name: str) -> None:
    r = _ok(results, name)
    (reset,) = [x for x in r["rows"] if x["query"] == ["reset"]]
    assert reset["held_after_reset"] == 0  # before any step: the router already holds nothing
    assert r["placeholders"] == 0  # every kvtier BlockStored carried its token ids
