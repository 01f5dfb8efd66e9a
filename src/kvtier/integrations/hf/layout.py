"""Chunk payload layouts of a transformers model: what bytes one (group, chunk) holds.

A payload is flat uint8 bytes, no header (the tier adds its own). Layouts, batch dim dropped:

- attention group (`full`, `sliding`, `chunked`), chunk of C tokens: for each layer of the group,
  in `Group.layers` order, K as [kv_heads, C, head_dim] then V as [kv_heads, C, head_dim], in the
  cache dtype. As one typed tensor: [num_layers, 2, kv_heads, C, head_dim].
- state group (`state`: Mamba-2, GatedDeltaNet), the checkpoint after exactly (i+1)*C tokens:
  for each layer, the recurrent state (its own dtype, float32 in transformers 5.x) then the conv
  state [conv_dim, conv_kernel] (cache dtype). Recurrent first keeps every typed view aligned.

Shapes and dtypes are measured, not guessed: `probe_layouts` runs the model on two tokens with a
fresh cache and reads what transformers actually allocated. The byte count must equal the
planner's `chunk_bytes` for the group (the geometry reader's claim); a mismatch refuses the model
rather than writing payloads of one size into slots of another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import UnsupportedModelError
from kvtier.integrations.hf.cache_fill import cache_kwarg
from kvtier.core.plan import Plan


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    group: int
    kind: str
    layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int | None  # tokens the sliding cache keeps = window - 1

    def chunk_bytes(self, chunk_tokens: int) -> int:
        elt = torch.empty((), dtype=self.dtype).element_size()
        return len(self.layers) * 2 * self.kv_heads * chunk_tokens * self.head_dim * elt


@dataclass(frozen=True, slots=True)
class StateLayout:
    group: int
    layers: tuple[int, ...]
    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    rec_shape: tuple[int, ...]
    rec_dtype: torch.dtype

    @property
    def conv_bytes(self) -> int:
        return _numel(self.conv_shape) * torch.empty((), dtype=self.conv_dtype).element_size()

    @property
    def rec_bytes(self) -> int:
        return _numel(self.rec_shape) * torch.empty((), dtype=self.rec_dtype).element_size()

    def chunk_bytes(self, chunk_tokens: int) -> int:
        return len(self.layers) * (self.conv_bytes + self.rec_bytes)


Layout = AttentionLayout | StateLayout


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def probe_layouts(model: torch.nn.Module, plan: Plan, make_cache) -> dict[int, Layout]:  # type: ignore[no-untyped-def]
    """Per cacheable group: the payload layout, measured on a 2-token forward pass."""
    cache = make_cache()
    ids = torch.tensor([[1, 2]], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(input_ids=ids, position_ids=torch.arange(2, device=model.device)[None],
              use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    out: dict[int, Layout] = {}
    for gp in plan.cacheable_groups:
        g = gp.group
        if not g.layers:
            raise UnsupportedModelError(
                f"group {g.name!r} does not say which model layers it covers; the transformers "
                "integration needs a geometry read from the model's config (kvtier.core.hf_config)"
            )
        shapes = set()
        for li in g.layers:
            layer = cache.layers[li]
            if g.is_state:
                conv = getattr(layer, "conv_states", {}).get(0)
                rec = getattr(layer, "recurrent_states", {}).get(0)
                if conv is None or rec is None:
                    raise UnsupportedModelError(
                        f"layer {li} of group {g.name!r} keeps no conv + recurrent state in the "
                        f"transformers cache ({type(layer).__name__}); kvtier cannot checkpoint it"
                    )
                shapes.add((tuple(conv.shape[1:]), conv.dtype, tuple(rec.shape[1:]), rec.dtype))
            else:
                keys = getattr(layer, "keys", None)
                if keys is None or keys.dim() != 4:
                    raise UnsupportedModelError(
                        f"layer {li} of group {g.name!r} has no [batch, heads, tokens, dim] keys in "
                        f"the transformers cache ({type(layer).__name__})"
                    )
                shapes.add((keys.shape[1], keys.shape[3], keys.dtype))
                window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
                if window is not None and not isinstance(getattr(layer, "cumulative_length", None), int):
                    # a restore sets this count to the true prefix length (masks and positions read
                    # it); without it the restored window would be misplaced, so refuse up front
                    import transformers

                    raise UnsupportedModelError(
                        f"layer {li} of group {g.name!r}: the sliding cache layer "
                        f"{type(layer).__name__} of transformers {transformers.__version__} keeps no "
                        "integer cumulative_length; kvtier is tested with 5.19 and 5.24"
                    )
                if window != g.window:
                    raise UnsupportedModelError(
                        f"layer {li} of group {g.name!r}: the transformers cache keeps a window of "
                        f"{window} tokens, the geometry says {g.window}; kvtier refuses rather than "
                        "restore the wrong tokens"
                    )
        if len(shapes) != 1:
            raise UnsupportedModelError(f"layers of group {g.name!r} cache different shapes: {sorted(map(str, shapes))}")
        s = shapes.pop()
        if g.is_state:
            layout: Layout = StateLayout(gp.index, g.layers, s[0], s[1], s[2], s[3])
        else:
            layout = AttentionLayout(gp.index, g.kind, g.layers, s[0], s[1], s[2], g.window)
        got = layout.chunk_bytes(plan.chunk_tokens)
        if got != gp.chunk_bytes:
            raise UnsupportedModelError(
                f"group {g.name!r}: the model caches {got} bytes per chunk but the geometry says "
                f"{gp.chunk_bytes}; the config reader and this transformers version disagree, so "
                "kvtier refuses rather than restore mis-sized KV"
            )
        out[gp.index] = layout
    return out


# -- packing (save) -----------------------------------------------------------------------------
def pack_attention(lay: AttentionLayout, keys: list[torch.Tensor], values: list[torch.Tensor],
                   first_token: int, chunks: list[int], chunk_tokens: int) -> dict[int, torch.Tensor]:
    """Payloads of `chunks` from per-layer K/V [1, H, S, D] that start at token `first_token`."""
    if not chunks:
        return {}
    c = chunk_tokens
    lo, hi = chunks[0] * c - first_token, (chunks[-1] + 1) * c - first_token
    n = len(chunks)
    assert chunks == list(range(chunks[0], chunks[0] + n)), "chunks to pack must be consecutive"
    # [L, 2, H, n*C, D] -> [n, L, 2, H, C, D]: one gather copy into the payload memory
    kv = torch.stack([torch.stack([k[0, :, lo:hi], v[0, :, lo:hi]]) for k, v in zip(keys, values)])
    L, _, H, _, D = kv.shape
    blob = kv.view(L, 2, H, n, c, D).permute(3, 0, 1, 2, 4, 5).contiguous()
    flat = blob.view(n, -1).view(torch.uint8)
    return {i: flat[j] for j, i in enumerate(chunks)}


def pack_state(lay: StateLayout, snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One checkpoint payload from per-layer (conv [1, ...], recurrent [1, ...]) clones."""
    parts = []
    for conv, rec in snapshot:
        parts.append(rec[0].contiguous().view(-1).view(torch.uint8))
        parts.append(conv[0].contiguous().view(-1).view(torch.uint8))
    return torch.cat(parts)


# -- unpacking (restore) ------------------------------------------------------------------------
def unpack_attention(lay: AttentionLayout, payloads: list[torch.Tensor], chunk_tokens: int
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V [1, H, n*C, D] from n consecutive chunk payloads (uint8)."""
    n, c = len(payloads), chunk_tokens
    typed = [p.view(lay.dtype).view(len(lay.layers), 2, lay.kv_heads, c, lay.head_dim) for p in payloads]
    keys, values = [], []
    for li in range(len(lay.layers)):
        # one copy per layer and K/V: cat of the chunks' [H, C, D] slices along tokens
        keys.append(torch.cat([t[li, 0] for t in typed], dim=1).unsqueeze(0) if n > 1 else typed[0][li, 0].unsqueeze(0).clone())
        values.append(torch.cat([t[li, 1] for t in typed], dim=1).unsqueeze(0) if n > 1 else typed[0][li, 1].unsqueeze(0).clone())
    return keys, values


def unpack_state(lay: StateLayout, payload: torch.Tensor, device: torch.device
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (conv [1, ...], recurrent [1, ...]) from one checkpoint payload."""
    out = []
    off = 0
    for _ in lay.layers:
        rec = torch.empty((1, *lay.rec_shape), dtype=lay.rec_dtype, device=device)
        rec.view(-1).view(torch.uint8).copy_(payload[off:off + lay.rec_bytes])
        off += lay.rec_bytes
        conv = torch.empty((1, *lay.conv_shape), dtype=lay.conv_dtype, device=device)
        conv.view(-1).view(torch.uint8).copy_(payload[off:off + lay.conv_bytes])
        off += lay.conv_bytes
        out.append((conv, rec))
    return out
