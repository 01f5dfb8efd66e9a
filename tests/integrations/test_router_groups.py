"""A group that never announced a chunk holds nothing: vLLM numbers its KV-cache groups 0..n-1,
so a group id below the highest one announced is a group the router knows exists. Seen in a real
engine (tests/e2e/test_vllm_router.py, the tiny Gemma 4): a 200-token prompt stores a 128-token
chunk of the full group (group 2) and nothing of the 256-token sliding groups 0 and 1."""

from __future__ import annotations

from kvtier.router import PrefixIndex

C = 128


def _stored(g: int, h: int, parent: int | None, tokens: list[int], kind: str, window: int | None,
            ownership: str | None = None) -> dict:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": len(tokens), "medium": "STORAGE" if ownership else "CPU", "ownership": ownership,
            "group_idx": g, "kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": window}


PROMPT = list(range(1000, 1000 + 3 * C))


def test_a_lower_group_that_announced_nothing_restores_nothing() -> None:
    index = PrefixIndex()
    index.apply("e0", [_stored(2, 7, None, PROMPT[:C], "full_attention", None)])
    assert index.longest_prefix(PROMPT, "e0")[0].tokens == 0  # predicted 128 before: groups 0, 1 unseen
    sliding = [_stored(g, 8, None, PROMPT[:2 * C], "sliding_window", 32) for g in (0, 1)]
    index.apply("e0", sliding + [_stored(2, 8, 7, PROMPT[C:2 * C], "full_attention", None)])
    assert index.longest_prefix(PROMPT, "e0")[0].tokens == 2 * C


def test_a_shared_tier_is_read_by_a_peers_groups_while_the_engine_lacks_some() -> None:
    index = PrefixIndex(shared_tiers={"redis": ["e0", "e1"]})
    redis = "kvtier-redis"
    index.apply("e0", [_stored(g, 8, None, PROMPT[:2 * C], "sliding_window", 32, redis) for g in (0, 1)]
                + [_stored(2, 7, None, PROMPT[:C], "full_attention", None, redis),
                   _stored(2, 8, 7, PROMPT[C:2 * C], "full_attention", None, redis)])
    index.apply("e1", [_stored(2, 99, None, list(range(5, 5 + C)), "full_attention", None)])  # its own, elsewhere
    (r,) = index.longest_prefix(PROMPT, "e1")
    assert (r.tokens, r.tiers) == (2 * C, ("redis",))
