"""The Redis tier inside vLLM: one engine process stores a prompt's chunks in a real
redis-server, a second engine process (empty vLLM cache, empty kvtier index, no cpu/disk tier)
finds them there, loads them and produces the same greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from redis_servers import have_redis, redis_server  # noqa: E402
from vllm_e2e import kv_transfer_config, prompts, run_engine, tiny_llama_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not have_redis(), reason="redis-server missing")]


def test_redis_tier_shared_by_two_engine_processes(tmp_path: Path) -> None:
    ps = prompts(1, 600, seed=6)
    with redis_server() as srv:
        def scenario(d: Path) -> dict:
            d.mkdir()
            kv = kv_transfer_config(d, tiers="redis", **{"kvtier.redis_bytes": "64MiB",
                                                         "kvtier.redis_url": srv.url})
            return {"model": str(tiny_llama_dir()), "dtype": "float32", "kv": kv, "prompts": ps,
                    "directory": str(d), "max_tokens": 6, "passes": 1}

        one = run_engine(scenario(tmp_path / "one"))
        assert one["metrics"][0]["stored_chunks_redis"] == 4  # 600 // 128
        two = run_engine(scenario(tmp_path / "two"))
    assert two["outputs"] == one["outputs"]
    m = two["metrics"][0]
    assert m["adopted_from_redis"] == 4
    assert m["loaded_chunks_redis"] == 4
    assert m["loaded_blocks"] == 4
