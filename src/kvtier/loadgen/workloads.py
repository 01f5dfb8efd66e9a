"""Prompts for a serving benchmark: multi-turn conversations from a Mooncake trace, fresh prompts.

Mooncake's `hash_ids` name 512-token blocks by their whole prefix: equal ids, equal prefix. A
serving benchmark needs token ids, so each id becomes a deterministic block of `block_tokens`
pseudo-random token ids (seeded by a salt and the id, so every request that names an id gets the
same tokens, in every process and every run). `block_tokens` scales the trace down to a small
model: with 128, a 6,758-token request of 14 blocks becomes 1,690 tokens. The last block keeps
its share: a request's prompt is ceil(input_length * block_tokens / 512) tokens of its blocks.

The trace has no conversation ids. A conversation is the requests whose first two ids agree (the
first id is the system prompt every request shares; the second is the first block of the user's
own context), in trace order; each later turn extends or branches the earlier ones.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError

TRACE_BLOCK_TOKENS = 512  # Mooncake's block
TOKEN_LOW = 100  # below: special and control tokens in most vocabularies
TOKEN_HIGH = 32000  # at most this, so the ids are real tokens of any vocabulary of 32k or more


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: int  # position among the chosen conversations
    turn: int  # 0-based within the conversation
    hash_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...]


def block_token_ids(hash_id: int, block_tokens: int, salt: str, high: int = TOKEN_HIGH) -> list[int]:
    """The token ids standing for trace block `hash_id` (the same for every caller with `salt`).

    Seeded from a blake2b digest, not Python's `hash()`, which differs between processes."""
    seed = int.from_bytes(hashlib.blake2b(f"{salt}:{hash_id}".encode(), digest_size=8).digest(), "big")
    rng = random.Random(seed)
    return [rng.randrange(TOKEN_LOW, high) for _ in range(block_tokens)]


def prompt_length(input_length: int, blocks: int, block_tokens: int) -> int:
    """Tokens of a request of `input_length` trace tokens in `blocks` blocks, scaled to
    `block_tokens` per block: its share of the last block kept, never more than its blocks."""
    scaled = -(-input_length * block_tokens // TRACE_BLOCK_TOKENS)
    return max(1, min(blocks * block_tokens, scaled))


def prompt_ids(hash_ids: Sequence[int], input_length: int, block_tokens: int, salt: str,
               high: int = TOKEN_HIGH) -> tuple[int, ...]:
    n = prompt_length(input_length, len(hash_ids), block_tokens)
    out: list[int] = []
    for h in hash_ids:
        if len(out) >= n:
            break
        out += block_token_ids(h, block_tokens, salt, high)
    return tuple(out[:n])


def read_trace(path: str | Path) -> list[dict[str, object]]:
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"--trace {str(path)!r} does not exist; pass the path of Mooncake's "
                          "conversation_trace.jsonl (see docs/vllm.md)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--trace {str(path)!r} cannot be read: {exc}") from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ids = rec["hash_ids"]
            length = int(rec["input_length"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"--trace {str(path)!r} line {no} is not a Mooncake request "
                              "({\"input_length\": N, \"hash_ids\": [...]})") from None
        if not isinstance(ids, list) or not ids or length <= 0:
            raise ConfigError(f"--trace {str(path)!r} line {no}: a request needs input_length > 0 "
                              "and at least one hash id")
        out.append({"hash_ids": [int(h) for h in ids], "input_length": length})
    return out


def conversations(records: Iterable[dict[str, object]], count: int, turns: int, block_tokens: int,
                  max_prompt_tokens: int, salt: str, high: int = TOKEN_HIGH) -> list[list[Turn]]:
    """The first `count` conversations (in trace order) with at least `turns` requests whose
    first `turns` prompts all fit in `max_prompt_tokens`, each cut to those `turns`."""
    groups: dict[tuple[int, ...], list[dict[str, object]]] = {}
    for rec in records:
        ids = rec["hash_ids"]
        groups.setdefault(tuple(ids[:2]), []).append(rec)  # type: ignore[index]
    chosen: list[list[Turn]] = []
    for reqs in groups.values():
        if len(reqs) < turns:
            continue
        reqs = reqs[:turns]
        lengths = [prompt_length(int(r["input_length"]), len(r["hash_ids"]), block_tokens)  # type: ignore[arg-type]
                   for r in reqs]
        if max(lengths) > max_prompt_tokens:
            continue
        c = len(chosen)
        chosen.append([Turn(c, t, tuple(r["hash_ids"]),  # type: ignore[arg-type]
                            prompt_ids(r["hash_ids"], int(r["input_length"]), block_tokens, salt, high))  # type: ignore[arg-type]
                       for t, r in enumerate(reqs)])
        if len(chosen) == count:
            return chosen
    raise ConfigError(
        f"the trace has {len(chosen)} conversations of at least {turns} turns whose prompts fit "
        f"--max-prompt-tokens {max_prompt_tokens} at --block-tokens {block_tokens}, fewer than "
        f"--conversations {count}; lower --conversations or --turns, or raise --max-prompt-tokens")


def interleave(convs: Sequence[Sequence[Turn]]) -> list[Turn]:
    """Turn 1 of every conversation, then turn 2 of every one, ...: between two turns of one
    conversation come the other conversations' turns, which push it out of a small engine cache."""
    depth = max((len(c) for c in convs), default=0)
    return [c[t] for t in range(depth) for c in convs if t < len(c)]


def working_set_tokens(convs: Sequence[Sequence[Turn]], block_tokens: int) -> int:
    """Tokens of the distinct trace blocks the conversations name (what a cache must hold)."""
    return len({h for c in convs for t in c for h in t.hash_ids}) * block_tokens


def fresh_prompts(count: int, tokens: int, salt: str, high: int = TOKEN_HIGH) -> list[tuple[int, ...]]:
    """`count` prompts of `tokens` random ids that share no prefix with each other or with the
    trace's prompts (negative ids, which no trace block has, and their own salt)."""
    return [tuple(block_token_ids(-1 - i, tokens, salt, high)) for i in range(count)]


def reusable_tokens(turns: Sequence[Turn], block_tokens: int, engine_block_tokens: int) -> int:
    """What any prefix cache could skip, sent in this order: for each prompt, its leading blocks
    that an earlier prompt held in full, cut to whole engine blocks and to the prompt's length - 1
    (an engine computes at least the last token). An upper bound for restored + engine-cache hits."""
    seen: set[int] = set()
    total = 0
    for t in turns:
        n = len(t.prompt_ids)
        k = 0
        for h in t.hash_ids:
            if h not in seen or (k + 1) * block_tokens > n:
                break
            k += 1
        total += min(k * block_tokens, n - 1) // engine_block_tokens * engine_block_tokens
        seen.update(t.hash_ids[: n // block_tokens])
    return total
