"""Plan a model from Python: geometry from a config.json, a chunk plan, what a hit restores.

    .venv/bin/python examples/plan_a_model.py src/kvtier/data/configs/gemma-3-27b.json 8192
"""

from __future__ import annotations

import sys

from kvtier import load_geometry, make_plan


def main(path: str, prompt_tokens: int) -> None:
    geometry = load_geometry(path)  # a geometry JSON or a Hugging Face config.json
    plan = make_plan(geometry)  # default chunk: the smallest multiple of L >= 256 tokens
    print(f"{geometry.name}: fingerprint {geometry.fingerprint()}, chunk_tokens {plan.chunk_tokens}")
    hit = plan.max_hit_tokens(prompt_tokens)  # at least one token is computed
    for gp in plan.groups:
        chunks = list(plan.chunks_for_hit(gp.index, hit))
        span = f"chunks {chunks[0]}..{chunks[-1]}" if chunks else "nothing"
        print(f"  group {gp.index} {gp.name:>16} ({gp.kind:>7}, layers {list(gp.group.layers)[:4]}...):"
              f" {gp.chunk_bytes:>11} B per chunk, a {hit}-token hit restores {span}")
    print(f"restore {plan.restore_bytes(hit)} B instead of {plan.naive_restore_bytes(hit)} B")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8192)
