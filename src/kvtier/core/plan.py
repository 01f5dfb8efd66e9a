"""The chunk planner: a geometry becomes a chunk plan, or a clear error.

Rules (DESIGN.md, "The rules of a hybrid prefix hit"), with C = `chunk_tokens`:

- L = lcm(`tokens_per_hash`, `tokens_per_block` of every cacheable group, state groups too).
  `chunk_tokens` is a positive multiple of L, so every cacheable group tiles a chunk with whole
  blocks and every chunk boundary is a hash boundary. Default: the smallest multiple of L >= 256.
- Chunk i of every group covers tokens [i*C, (i+1)*C). A state group's chunk i is the state
  checkpoint taken after exactly (i+1)*C tokens (one per chunk: `blocks_per_chunk` = 1).
- A hit of T tokens (a multiple of C) needs, per cacheable group:
  `full`/`mla`: chunks 0 .. T/C-1; `sliding` (W): the chunks holding the last W-1 tokens
  before T; `chunked` (A): the chunks holding tokens [floor(T/A)*A, T); `state`: chunk T/C-1.
  Groups that are not cacheable need nothing and do not constrain the hit.
- A chunk is worth storing only if some hit reads it (`store_chunks`).

Blocks per chunk are per group: one factor for all groups (vLLM's original rule) assumes every
group has the same tokens per block and mis-chunks hybrid models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group

DEFAULT_MIN_CHUNK_TOKENS = 256


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """The plan of one group. `blocks_per_chunk` is None when the group is not cacheable."""

    index: int
    group: Group
    blocks_per_chunk: int | None
    chunk_bytes: int
    cacheable: bool
    reason: str

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def kind(self) -> str:
        return self.group.kind


@dataclass(frozen=True, slots=True)
class Plan:
    geometry: Geometry
    chunk_tokens: int
    groups: tuple[GroupPlan, ...]

    @property
    def cacheable_groups(self) -> tuple[GroupPlan, ...]:
        return tuple(g for g in self.groups if g.cacheable)

    @property
    def chunk_bytes_all_groups(self) -> int:
        """Bytes of one chunk of every cacheable group (state checkpoints included)."""
        return sum(g.chunk_bytes for g in self.cacheable_groups)

    @property
    def bytes_per_cached_token(self) -> float:
        """Bytes a tier spends per cached prefix token, all cacheable groups, naive storing."""
        return self.chunk_bytes_all_groups / self.chunk_tokens

    def round_hit(self, hit_tokens: int) -> int:
        if isinstance(hit_tokens, bool) or not isinstance(hit_tokens, int) or hit_tokens < 0:
            raise ConfigError(f"hit tokens {hit_tokens!r} must be an integer >= 0")
        return hit_tokens - hit_tokens % self.chunk_tokens

    def chunks_for_hit(self, group_index: int, hit_tokens: int) -> range:
        """Chunk indices group `group_index` must restore for a hit of `hit_tokens` (rounded down)."""
        gp = self.groups[group_index]
        t = self.round_hit(hit_tokens)
        n = t // self.chunk_tokens
        if not gp.cacheable or n == 0:
            return range(0)
        g = gp.group
        c = self.chunk_tokens
        if g.kind in ("full", "mla"):
            return range(0, n)
        if g.kind == "sliding":
            assert g.window is not None
            need = g.window - 1  # tokens before T the next token attends to
            if need == 0:
                return range(0)
            first_token = max(0, t - need)
            return range(first_token // c, n)
        if g.kind == "chunked":
            assert g.attention_chunk is not None
            first_token = (t // g.attention_chunk) * g.attention_chunk
            if first_token >= t:
                return range(0)
            return range(first_token // c, n)
        # state: the checkpoint taken at exactly T
        return range(n - 1, n)

    def restore_bytes(self, hit_tokens: int) -> int:
        return sum(
            len(self.chunks_for_hit(gp.index, hit_tokens)) * gp.chunk_bytes for gp in self.groups
        )

    def naive_restore_bytes(self, hit_tokens: int) -> int:
        """What a layout-blind offloader restores: T/C chunks of every cacheable group."""
        n = self.round_hit(hit_tokens) // self.chunk_tokens
        return sum(n * gp.chunk_bytes for gp in self.cacheable_groups)

    def store_chunks(self, group_index: int, num_tokens: int) -> list[int]:
        """Chunk indices of group `group_index` worth storing for a prefix of `num_tokens` tokens.

        Only full chunks are stored (chunk i needs (i+1)*C <= num_tokens), and only those some
        hit T <= num_tokens (T a multiple of C) would read: a `chunked` chunk ending exactly on
        an attention-chunk boundary is read by no hit, so it is not stored.
        """
        gp = self.groups[group_index]
        if not gp.cacheable:
            return []
        n = num_tokens // self.chunk_tokens
        g = gp.group
        if g.kind == "sliding" and g.window == 1:
            return []
        if g.kind != "chunked":
            return list(range(n))
        wanted: set[int] = set()
        for k in range(1, n + 1):
            wanted.update(self.chunks_for_hit(group_index, k * self.chunk_tokens))
        return sorted(wanted)

    def max_hit_tokens(self, prompt_tokens: int) -> int:
        """The largest T a prompt of `prompt_tokens` tokens may hit: a multiple of C, <= P-1.

        At least one token must be computed so the engine has logits for the next token.
        """
        if prompt_tokens <= 1:
            return 0
        return self.round_hit(prompt_tokens - 1)

    def best_hit(self, prompt_tokens: int, has_chunk: Callable[[int, int], bool]) -> int:
        """The largest T (multiple of C, <= prompt_tokens-1) every cacheable group can restore.

        `has_chunk(group_index, chunk_index)` says whether that chunk is available. Cost:
        one pass over the full/mla groups' prefix, then per candidate T only the few chunks a
        sliding/chunked/state group needs, so a 128k-token prompt stays cheap.
        """
        c = self.chunk_tokens
        n_max = self.max_hit_tokens(prompt_tokens) // c
        cacheable = self.cacheable_groups
        if not cacheable:
            return 0
        for gp in cacheable:
            if gp.kind in ("full", "mla"):
                k = 0
                while k < n_max and has_chunk(gp.index, k):
                    k += 1
                n_max = k
        others = [gp for gp in cacheable if gp.kind not in ("full", "mla")]
        for n in range(n_max, 0, -1):
            t = n * c
            if all(
                all(has_chunk(gp.index, i) for i in self.chunks_for_hit(gp.index, t)) for gp in others
            ):
                return t
        return 0


def hit_unit(geometry: Geometry) -> int:
    """L: the lcm of the hash unit and every cacheable group's tokens per block."""
    unit = geometry.tokens_per_hash
    for g in geometry.cacheable_groups:
        unit = math.lcm(unit, g.tokens_per_block)
    return unit


def make_plan(
    geometry: Geometry,
    *,
    chunk_tokens: int | None = None,
    blocks_per_chunk: int | Mapping[str, int] | None = None,
) -> Plan:
    """Plan `geometry`. Give at most one of `chunk_tokens` and `blocks_per_chunk`."""
    if chunk_tokens is not None and blocks_per_chunk is not None:
        raise ConfigError("give either chunk_tokens or blocks_per_chunk, not both")
    unit = hit_unit(geometry)
    given = ""
    if blocks_per_chunk is not None:
        chunk_tokens = _chunk_tokens_from_blocks(geometry, blocks_per_chunk)
        given = f" (the span blocks_per_chunk={_show(blocks_per_chunk)} gives)"
    if chunk_tokens is None:
        chunk_tokens = unit * max(1, -(-DEFAULT_MIN_CHUNK_TOKENS // unit))
    _check_chunk_tokens(geometry, chunk_tokens, unit, given)
    groups = []
    for i, g in enumerate(geometry.groups):
        if g.is_state:
            groups.append(group_plan(i, g, g.state_bytes, 1))
        else:
            groups.append(group_plan(i, g, g.bytes_for_tokens(chunk_tokens), chunk_tokens // g.tokens_per_block))
    return Plan(geometry=geometry, chunk_tokens=chunk_tokens, groups=tuple(groups))


def group_plan(index: int, group: Group, chunk_bytes: int, blocks_per_chunk: int) -> GroupPlan:
    """The plan of one group whose chunk is `blocks_per_chunk` blocks of `chunk_bytes` bytes (an
    engine's own chunking builds its plans with it too: integrations/vllm/engine_plan.py)."""
    reason = group.reason
    if group.cacheable and group.kind == "sliding" and group.window == 1:
        reason = "window 1: no hit reads earlier tokens"
    return GroupPlan(index=index, group=group,
                     blocks_per_chunk=blocks_per_chunk if group.cacheable else None,
                     chunk_bytes=chunk_bytes, cacheable=group.cacheable, reason=reason)


def _show(blocks_per_chunk: int | Mapping[str, int]) -> str:
    if isinstance(blocks_per_chunk, Mapping):
        return ",".join(f"{k}={v}" for k, v in blocks_per_chunk.items())
    return str(blocks_per_chunk)


def _check_chunk_tokens(geometry: Geometry, chunk_tokens: object, unit: int, given: str = "") -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ConfigError(
            f"chunk_tokens={chunk_tokens!r} must be a positive multiple of {unit}; "
            f"valid chunk sizes: {unit}, {2 * unit}, {3 * unit}, ..."
        )
    if chunk_tokens % unit == 0:
        return
    if chunk_tokens % geometry.tokens_per_hash:
        culprit = f"the hash unit ({geometry.tokens_per_hash} tokens per hash)"
    else:
        bad = next(g for g in geometry.cacheable_groups if chunk_tokens % g.tokens_per_block)
        culprit = f"group {bad.name!r} has {bad.tokens_per_block} tokens per block, which"
    raise ConfigError(
        f"{culprit} does not divide chunk_tokens={chunk_tokens}{given}; "
        f"valid chunk sizes: {_nearby(chunk_tokens, unit)}"
    )


def _nearby(value: int, unit: int) -> str:
    below = (value // unit) * unit
    sizes = [s for s in (below - unit, below, below + unit, below + 2 * unit) if s > 0]
    return ", ".join(str(s) for s in sizes[:3]) + ", ... (multiples of " + str(unit) + ")"


def _chunk_tokens_from_blocks(geometry: Geometry, blocks_per_chunk: int | Mapping[str, int]) -> int:
    """Chunk size implied by blocks_per_chunk; every cacheable attention group must agree.

    State groups take one checkpoint per chunk whatever the count, so they are not part of the
    span check; an entry for one must be 1.
    """
    names = {g.name for g in geometry.groups}
    if isinstance(blocks_per_chunk, Mapping):
        for name, count in blocks_per_chunk.items():
            if name not in names:
                raise ConfigError(
                    f"blocks_per_chunk names group {name!r}, which the geometry does not have; "
                    f"groups are: {', '.join(g.name for g in geometry.groups)}"
                )
            _check_count(count, f"blocks_per_chunk for group {name!r}")
        counts = dict(blocks_per_chunk)
    else:
        _check_count(blocks_per_chunk, "blocks_per_chunk")
        counts = {g.name: blocks_per_chunk for g in geometry.groups if not g.is_state}
    spans: list[tuple[str, int]] = []
    for g in geometry.cacheable_groups:
        if g.is_state:
            if g.name in counts and counts[g.name] != 1:
                raise ConfigError(
                    f"group {g.name!r} is a state group: it keeps one checkpoint per chunk, so its "
                    f"blocks_per_chunk must be 1, not {counts[g.name]}"
                )
            continue
        if g.name in counts:
            spans.append((g.name, counts[g.name] * g.tokens_per_block))
    if not spans:
        raise ConfigError(
            "blocks_per_chunk names no cacheable attention group, so it sets no chunk size; "
            "name at least one, or give chunk_tokens"
        )
    first_name, first_span = spans[0]
    for name, span in spans[1:]:
        if span != first_span:
            raise ConfigError(
                f"blocks_per_chunk gives group {first_name!r} a span of {first_span} tokens and group "
                f"{name!r} a span of {span} tokens; every cacheable group must span the same tokens "
                "per chunk"
            )
    return first_span


def _check_count(count: object, what: str) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise ConfigError(f"{what} is {count!r}; it must be a positive integer")
