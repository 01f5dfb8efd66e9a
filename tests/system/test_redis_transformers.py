"""Two transformers processes share prompt prefixes through one Redis.

Each process loads the same tiny random Gemma 3 (sliding-window + full attention layers: a
hybrid geometry) and wraps it in `PrefixCache.for_model(..., shared=[RedisTier.from_url(url)])`.
The first computes the prompt and saves its chunks to Redis; the second, a separate OS process
with an empty cpu tier, restores the prefix from Redis and must generate the same greedy tokens
as the first one did from scratch. This file is also the child program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROMPT_TOKENS = 300
CHUNK_TOKENS = 32
# a hit is at most prompt - 1 = 299 tokens, rounded down to a chunk of 32: 288 (9 chunks)
EXPECTED_HIT = 288


def child(url: str) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM

    from kvtier.integrations.transformers import PrefixCache
    from kvtier.local_models import tiny_random_dir
    from kvtier.store.tiers.redis import RedisTier

    model = AutoModelForCausalLM.from_pretrained(tiny_random_dir("gemma3"), dtype=torch.float32)
    pc = PrefixCache.for_model(model.eval(), chunk_tokens=CHUNK_TOKENS, cpu_bytes=64 << 20,
                               shared=[RedisTier.from_url(url, socket_timeout_s=2.0)])
    ids = torch.tensor([[(13 * t + 5) % 4000 + 10 for t in range(PROMPT_TOKENS)]])
    out = pc.generate(ids, max_new_tokens=8, do_sample=False)
    pc.store.close()
    return {"new_tokens": out.sequences[0, PROMPT_TOKENS:].tolist(),
            "restored": out.stats.restored_tokens, "by_tier": out.stats.restored_tokens_by_tier}


@pytest.mark.slow
def test_a_second_transformers_process_restores_from_redis_and_answers_the_same() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from redis_servers import redis_server

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")

    def run() -> dict[str, object]:
        proc = subprocess.run([sys.executable, __file__, srv.url], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    with redis_server() as srv:
        first = run()
        assert first["restored"] == 0  # an empty Redis: computed from scratch
        assert int(srv.cli("dbsize")) > 0
        second = run()
    assert second["restored"] == EXPECTED_HIT and second["by_tier"] == {"redis": EXPECTED_HIT}
    assert len(first["new_tokens"]) == 8
    assert second["new_tokens"] == first["new_tokens"]


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1])))
