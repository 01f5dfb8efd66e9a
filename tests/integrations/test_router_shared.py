"""A shared Redis tier (kvtier.router's `shared_tiers`): a chunk one engine announces in Redis
counts for every engine declared on that Redis, never for the others, and never in another tier."""

from __future__ import annotations

from kvtier.router import PrefixIndex

C = 4


def _chunks(p: list[int], base: int, n: int, tier: str) -> list[dict]:
    own, med = (None, "CPU") if tier == "cpu" else (f"kvtier-{tier}", "STORAGE")
    return [{"type": "BlockStored", "block_hashes": [base + j], "parent_block_hash": None if j == 0 else base + j - 1,
             "token_ids": p[j * C:(j + 1) * C], "block_size": C, "medium": med, "ownership": own, "group_idx": 0,
             "kv_cache_spec_kind": "full_attention"} for j in range(n)]


P = [(i * 7919) % 5000 for i in range(6 * C)]


def test_a_chunk_in_a_shared_redis_counts_for_every_engine_on_it() -> None:
    index = PrefixIndex(shared_tiers={"redis": ["e0", "e1"]})
    index.apply("e0", _chunks(P, 100, 5, "redis") + _chunks(P, 100, 2, "cpu"))
    got = {e: (r.tokens, r.tiers) for e in ("e0", "e1", "e2") for r in index.longest_prefix(P, e)}  # e2: not on it
    assert got == {"e0": (5 * C, ("cpu", "redis")), "e1": (5 * C, ("redis",)), "e2": (0, ())}
    index.apply("e0", [{"type": "BlockRemoved", "block_hashes": [102], "medium": "STORAGE", "group_idx": 0,
                        "ownership": "kvtier-redis"}])
    assert index.longest_prefix(P, "e1")[0].tokens == 2 * C  # gone from Redis: for every engine on it


def test_without_the_declaration_a_redis_chunk_counts_only_where_announced() -> None:
    index = PrefixIndex()
    index.apply("e0", _chunks(P, 100, 5, "redis"))
    assert [index.longest_prefix(P, e)[0].tokens for e in ("e0", "e1")] == [5 * C, 0]
