"""Which replica a prompt should go to: what kvtier's router says each replica restores, in
prefill tokens saved after paying each tier's load cost, against the requests already queued
there. No Ray here: the Ray Serve router (router.py) asks this with its replicas' queue lengths."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.router import Restorable

# Loading one token's KV from a tier, in units of recomputing it. Defaults for a GPU engine whose
# cpu tier crosses PCIe and whose disk/Redis reads were promoted ahead (docs/vllm.md, "Ray Serve"):
# set them from `kvtier bench ttft` on the real hardware. An unnamed tier costs 1: it saves nothing.
DEFAULT_TIER_COSTS: Mapping[str, float] = {"cpu": 0.1, "disk": 0.3, "redis": 0.5}
# One request already queued on a replica, in prompt tokens of prefill it makes this one wait for.
DEFAULT_QUEUE_COST_TOKENS = 512.0
REQUEST_TOKEN_IDS_KWARG = "request_token_ids"  # Ray's KV-aware routers read prompt token ids here


@dataclass(frozen=True, slots=True)
class Choice:
    """One replica's score for one prompt."""
    engine: str
    restored_tokens: int  # the prefix kvtier restores there in every group (0: nothing)
    saved_tokens: float  # restored_tokens less what loading it costs, in recomputed tokens
    queue_len: int
    score: float  # saved_tokens - queue_len x queue_cost_tokens


def saved_tokens(hit: Restorable, tier_costs: Mapping[str, float] = DEFAULT_TIER_COSTS) -> float:
    """The prefill a hit saves: its tokens less each group's loads weighted by their tier's cost,
    averaged over the groups (each group holds a share of a token's KV; a sliding group loads only
    its window, so a hybrid model's long hit costs less than a full-attention one's)."""
    if hit.tokens <= 0:
        return 0.0
    groups = {g for g, _, _ in hit.loads}
    if not groups:  # an index without the per-group loads: every token at the slowest tier's cost
        return hit.tokens * (1.0 - max((tier_costs.get(t, 1.0) for t in hit.tiers), default=0.0))
    cost = sum(n * tier_costs.get(tier, 1.0) for _, tier, n in hit.loads) / len(groups)
    return max(0.0, hit.tokens - cost)


def rank(hits: Mapping[str, Restorable], queue_lens: Mapping[str, int],
         tier_costs: Mapping[str, float] = DEFAULT_TIER_COSTS,
         queue_cost_tokens: float = DEFAULT_QUEUE_COST_TOKENS, rng: random.Random | None = None) -> list[Choice]:
    """The engines of `queue_lens` scored by their hit in `hits`, best first; [] when none saves
    anything (the caller routes by load alone). Equal scores: the shorter queue, then at random."""
    choices = []
    for engine, queue_len in queue_lens.items():
        hit = hits.get(engine)
        saved = 0.0 if hit is None else saved_tokens(hit, tier_costs)
        choices.append(Choice(engine, 0 if hit is None else hit.tokens, saved, queue_len,
                              saved - queue_len * queue_cost_tokens))
    if not choices or max(c.saved_tokens for c in choices) <= 0:
        return []
    (rng or random).shuffle(choices)
    return sorted(choices, key=lambda c: (-c.score, c.queue_len))


def worth(hits: Mapping[str, Restorable], tier_costs: Mapping[str, float] = DEFAULT_TIER_COSTS) -> bool:
    """Whether some engine saves anything for this prompt (else its queues need not be asked)."""
    return any(saved_tokens(h, tier_costs) > 0 for h in hits.values())


def prompt_tokens(args: Sequence[object], kwargs: Mapping[object, object], tokenizer=None) -> list[int] | None:  # noqa: ANN001 - a transformers tokenizer
    """The prompt's token ids from a Ray Serve request: Ray's `request_token_ids` keyword, else
    the first argument with `prompt_token_ids` (a vLLM TokensPrompt) or a `prompt` of token ids
    (attribute or key), else a text `prompt` / chat `messages` through `tokenizer` (vLLM's own
    tokenization: special tokens added, the chat template with the generation prompt). None when
    there is none: the request is routed by load."""
    ids = kwargs.get(REQUEST_TOKEN_IDS_KWARG)
    if _token_ids(ids):
        return list(ids)  # type: ignore[arg-type]
    for arg in args:
        for field in ("prompt_token_ids", "prompt", "messages"):
            value = arg.get(field) if isinstance(arg, Mapping) else getattr(arg, field, None)
            if value is None:
                continue
            if _token_ids(value):
                return list(value)  # type: ignore[arg-type]
            if tokenizer is None:
                return None
            if field == "prompt" and isinstance(value, str):
                return list(tokenizer(value)["input_ids"])
            if field == "messages" and isinstance(value, list):
                out = tokenizer.apply_chat_template(value, tokenize=True, add_generation_prompt=True)
                return list(out["input_ids"] if isinstance(out, Mapping) else out)  # a dict in transformers 5
            return None
    return None


def _token_ids(value: object) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(type(t) is int for t in value)
