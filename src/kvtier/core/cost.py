"""Prefill compute per geometry: the FLOPs a hit of T tokens saves, layer kind by layer kind.

A hit of T tokens saves exactly the prefill of the prompt's first T tokens: with causal
attention, prefilling P tokens after a hit of T costs F(P) - F(T), where F(n) is the cost of
prefilling n tokens from nothing. So `ComputeModel.flops(T)` is both "compute saved by a hit of
T" and "compute of a prompt of T tokens". Per layer, for n tokens:

- linear term (every kind): 2 x active parameters x n (the projections, the MLP or the MoE's
  routed + shared experts, the router; a multiply-add is 2 FLOPs);
- `full` / `mla`: + pair_flops x n(n+1)/2 (QK^T and AV over the causal pairs; pair_flops =
  2 x query heads x (qk head dim + v head dim): 4 x heads x head_dim for plain attention);
- `sliding` (W): the pairs capped at W per query: sum over t of min(t, W);
- `chunked` (A): each query attends within its A-token chunk: sum over t of ((t-1) mod A) + 1;
- `state` (linear attention, SSM): + state_flops x n, linear in n (3 multiply-adds per element of
  the recurrent state per token: decay, write, read-out).
Embeddings (a lookup) and the LM head (one token in prefill) are left out.

`compute_from_hf_config` reads these from a config.json (the families of `hf_families`, per
layer, so MoE layers, dense layers and each layer's mixer are counted where they are);
`compute_from_geometry` estimates them from a geometry alone (a geometry JSON has no parameter
counts): the linear term from a given active-parameter count, and attention with as many query
heads as KV heads (a lower bound on the quadratic term).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtier.core.geometry import Geometry, dtype_bytes
from kvtier.core.hf_config import text_config
from kvtier.core.hf_families import FAMILIES, Cfg
from kvtier.errors import ConfigError

STATE_MACS_PER_ELEMENT = 3  # decay, write (outer product), read-out, per recurrent-state element


def causal_pairs(tokens: int, window: int | None = None, attention_chunk: int | None = None) -> int:
    """(query, key) pairs causal attention over `tokens` tokens computes; a sliding window caps
    each query at `window` keys, chunked attention at its own chunk's tokens so far."""
    n = tokens
    if n <= 0:
        return 0
    if attention_chunk is not None:
        a = attention_chunk
        whole, rest = divmod(n, a)
        return whole * a * (a + 1) // 2 + rest * (rest + 1) // 2
    if window is not None and n > window:
        return window * (window + 1) // 2 + (n - window) * window
    return n * (n + 1) // 2


@dataclass(frozen=True, slots=True)
class Term:
    """The prefill compute of `num_layers` alike layers (one group's, or uncached ones)."""

    name: str  # the geometry group the layers belong to ("" for layers no group holds)
    kind: str  # full, mla, sliding, chunked, state, or "mlp" (no mixer term: parameters only)
    num_layers: int
    linear_flops_per_token: float  # per layer: 2 x active parameters, + the state recurrence
    pair_flops: float = 0.0  # per layer and (query, key) pair; 0 for state / mlp terms
    window: int | None = None
    attention_chunk: int | None = None

    def flops(self, tokens: int) -> float:
        """FLOPs of these layers to prefill `tokens` tokens from nothing."""
        pairs = causal_pairs(tokens, self.window, self.attention_chunk) if self.pair_flops else 0
        return self.num_layers * (self.linear_flops_per_token * tokens + self.pair_flops * pairs)


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """A model's prefill compute as a sum of terms; `flops(T)` is what a hit of T saves."""

    terms: tuple[Term, ...]
    source: str = ""

    def flops(self, tokens: int) -> float:
        return sum(t.flops(tokens) for t in self.terms)

    def by_group(self, tokens: int) -> dict[str, float]:
        """FLOPs per geometry group name ("" = layers of no group, "mlp" terms under their group)."""
        out: dict[str, float] = {}
        for t in self.terms:
            out[t.name] = out.get(t.name, 0.0) + t.flops(tokens)
        return out

    @property
    def linear_flops_per_token(self) -> float:
        """FLOPs per token of the terms that grow linearly (what "2 x active params" estimated)."""
        return sum(t.num_layers * t.linear_flops_per_token for t in self.terms)


def compute_from_geometry(geometry: Geometry, active_params: float) -> ComputeModel:
    """An estimate from a geometry alone: 2 x `active_params` FLOPs per token, plus attention's
    quadratic term with query heads = KV heads (a geometry knows only the KV bytes)."""
    if not active_params > 0:
        raise ConfigError(f"active parameters {active_params!r} must be positive")
    terms = [Term("", "mlp", 1, 2.0 * active_params)]
    for g in geometry.groups:
        if g.is_state:
            continue
        # K and V: bytes_per_token_per_layer / dtype = 2 x kv heads x head dim elements per token;
        # 2 FLOPs per element per pair (QK^T on K, AV on V). A compressed entry covers `ratio` tokens.
        elements = g.bytes_per_token_per_layer / dtype_bytes(g.dtype)
        terms.append(Term(g.name, g.kind, g.num_layers, 0.0, 2.0 * elements / g.compress_ratio,
                          g.window, g.attention_chunk))
    return ComputeModel(tuple(terms), f"estimate from the geometry and {active_params:g} active params")


# ---------------------------------------------------------------------------------------------
# config.json


def compute_from_hf_config(config: Mapping[str, object], geometry: Geometry) -> ComputeModel | None:
    """Per-layer compute read from a config.json, laid over `geometry` (read from the same file:
    its groups' `layers` say which mixer each layer runs). None for a family not modelled here or
    a config without a field the count needs (the caller falls back to `compute_from_geometry`)."""
    text, model_type = text_config(config)
    family = FAMILIES.get(str(model_type))
    if model_type not in _MIXERS or family is None:
        return None
    cfg = Cfg(text, str(model_type), family[1])
    n = cfg.layers()
    attention: dict[int, tuple[str, str, int | None, int | None]] = {}
    state: dict[int, str] = {}
    for g in geometry.groups:
        for i in g.layers:
            if g.is_state:
                state[i] = g.name
            else:
                attention.setdefault(i, (g.name, g.kind, g.window, g.attention_chunk))
    if not attention and not state:
        return None  # a geometry without layer indices cannot be laid over the config
    try:
        return _read(cfg, n, attention, state, str(model_type))
    except ConfigError:
        return None  # a field the compute needs is missing (a sketch of a config): estimate


def _read(cfg: Cfg, n: int, attention: dict[int, tuple[str, str, int | None, int | None]],
          state: dict[int, str], model_type: str) -> ComputeModel:
    hidden = cfg.int("hidden_size")
    mixers = _MIXERS[model_type]
    acc: dict[tuple[str, str, float, float, int | None, int | None], int] = {}
    for i in range(n):
        parts: list[tuple[str, str, float, float, int | None, int | None]] = []
        mlp = _mlp_params(cfg, i, hidden)
        if i in state:
            params, recurrent = mixers.state(cfg, hidden)
            parts.append((state[i], "state", 2.0 * params + 2.0 * STATE_MACS_PER_ELEMENT * recurrent,
                          0.0, None, None))
        if i in attention:
            name, kind, window, chunk = attention[i]
            params, pair = mixers.attention(cfg, hidden, kind, i)
            parts.append((name, kind, 2.0 * params, float(pair), window, chunk))
        if not parts:  # a layer no group caches (Gemma 4's KV-sharing layers) still computes
            params, pair = mixers.attention(cfg, hidden, "full", i)
            parts.append(("", "full", 2.0 * params, float(pair), None, None))
        name = parts[0][0]
        parts.append((name, "mlp", 2.0 * mlp, 0.0, None, None))
        for p in parts:
            acc[p] = acc.get(p, 0) + 1
    terms = tuple(Term(name, kind, count, lin, pair, w, a)
                  for (name, kind, lin, pair, w, a), count in acc.items())
    return ComputeModel(terms, f"hf config.json, model_type {model_type!r}")


def _get(cfg: Cfg, *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return cfg.int(k)
    return None


def _gqa(cfg: Cfg, hidden: int, kind: str, layer: int) -> tuple[int, int]:
    """Projections q, k, v, o and pair FLOPs of a multi-head / grouped-query attention layer."""
    heads = cfg.int("num_attention_heads")
    kv = _get(cfg, "num_key_value_heads") or heads
    d = _get(cfg, "head_dim") or hidden // heads
    if cfg.model_type == "gemma4_text" and kind == "full":
        d = cfg.int("global_head_dim", fallback=512)
    q_out = heads * d
    if cfg.model_type.startswith(("qwen3_next", "qwen3_5")):
        q_out *= 2  # the attention output gate comes out of q_proj
    params = hidden * q_out + 2 * hidden * kv * d + heads * d * hidden
    return params, 4 * heads * d


def _mla(cfg: Cfg, hidden: int, kind: str, layer: int) -> tuple[int, int]:
    """DeepSeek V2/V3 MLA: q (through q_lora_rank when set), the compressed kv and its up-projection."""
    heads = cfg.int("num_attention_heads")
    nope = cfg.int("qk_nope_head_dim", fallback=128)
    rope = cfg.int("qk_rope_head_dim", fallback=64)
    v = cfg.int("v_head_dim", fallback=128)
    kv_rank = cfg.int("kv_lora_rank")
    q_rank = _get(cfg, "q_lora_rank")
    q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
    params = q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * hidden
    return params, 2 * heads * (nope + rope + v)


def _gated_deltanet(cfg: Cfg, hidden: int) -> tuple[int, int]:
    """(parameters, recurrent-state elements) of a GatedDeltaNet layer (Qwen3-Next / Qwen3.5)."""
    nk, dk = cfg.int("linear_num_key_heads"), cfg.int("linear_key_head_dim")
    nv, dv = cfg.int("linear_num_value_heads"), cfg.int("linear_value_head_dim")
    conv = (2 * nk * dk + nv * dv) * cfg.int("linear_conv_kernel_dim")
    params = hidden * (2 * nk * dk + 2 * nv * dv) + hidden * 2 * nv + conv + nv * dv * hidden
    return params, nv * dk * dv


def _mamba2(cfg: Cfg, hidden: int) -> tuple[int, int]:
    inter = _get(cfg, "mamba_d_ssm") if cfg.model_type == "falcon_h1" else None
    inter = inter or cfg.int("mamba_expand") * hidden
    heads, d_state = cfg.int("mamba_n_heads"), cfg.int("mamba_d_state")
    head_dim = cfg.get("mamba_d_head")
    head_dim = inter // heads if head_dim in (None, "auto") else cfg.int("mamba_d_head")
    groups = cfg.int("mamba_n_groups")
    conv_dim = inter + 2 * groups * d_state
    params = hidden * (2 * inter + 2 * groups * d_state + heads) + conv_dim * cfg.int("mamba_d_conv") \
        + inter * hidden
    return params, heads * head_dim * d_state


def _mamba1(cfg: Cfg, hidden: int) -> tuple[int, int]:
    inter, d_state = cfg.int("mamba_expand") * hidden, cfg.int("mamba_d_state")
    dt_rank = _get(cfg, "mamba_dt_rank") or math.ceil(hidden / 16)
    params = (hidden * 2 * inter + inter * cfg.int("mamba_d_conv") + inter * (dt_rank + 2 * d_state)
              + dt_rank * inter + inter * hidden)
    return params, inter * d_state


def _mlp_params(cfg: Cfg, layer: int, hidden: int) -> int:
    """Active MLP parameters of one layer: gated (3 matrices); an MoE layer counts its routed
    experts per token, its shared expert(s) and its router."""
    experts = _get(cfg, "num_experts", "n_routed_experts", "num_local_experts")
    if experts and _is_moe_layer(cfg, layer):
        k = _get(cfg, "num_experts_per_tok", "experts_per_token") or 1
        size = _get(cfg, "moe_intermediate_size") or cfg.int("intermediate_size")
        shared = _get(cfg, "shared_expert_intermediate_size") or 0
        if cfg.get("n_shared_experts"):
            shared = cfg.int("n_shared_experts") * size
        if cfg.model_type == "llama4_text":
            shared = cfg.int("intermediate_size")
        return 3 * hidden * size * k + 3 * hidden * shared + hidden * experts
    size = _get(cfg, "intermediate_size_mlp") if cfg.model_type == "llama4_text" else None
    return 3 * hidden * (size or cfg.int("intermediate_size"))


def _is_moe_layer(cfg: Cfg, i: int) -> bool:
    if cfg.get("first_k_dense_replace") is not None and i < cfg.int("first_k_dense_replace"):
        return False
    only = cfg.get("mlp_only_layers")
    if isinstance(only, list) and i in only:
        return False
    if cfg.get("decoder_sparse_step") is not None and (i + 1) % cfg.int("decoder_sparse_step"):
        return False
    if cfg.get("expert_layer_period") is not None:
        offset = cfg.get("expert_layer_offset") or 0
        return i % cfg.int("expert_layer_period") == offset
    if cfg.model_type == "llama4_text":
        return (i + 1) % cfg.int("interleave_moe_layer_step", fallback=1) == 0
    return True


@dataclass(frozen=True, slots=True)
class _Mixers:
    attention: Callable[[Cfg, int, str, int], tuple[int, int]]  # -> (parameters, pair FLOPs)
    state: Callable[[Cfg, int], tuple[int, int]]  # -> (parameters, recurrent-state elements)


def _no_state(cfg: Cfg, hidden: int) -> tuple[int, int]:
    raise ConfigError(f"model_type {cfg.model_type!r} has no state layers")


_GQA, _MLA = _Mixers(_gqa, _no_state), _Mixers(_mla, _no_state)
_MIXERS: dict[str, _Mixers] = {
    **{t: _GQA for t in ("llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mistral", "mixtral",
                         "gemma2", "gemma3_text", "gemma4_text", "gpt_oss", "llama4_text")},
    **{t: _MLA for t in ("deepseek_v2", "deepseek_v3", "kimi_k2")},
    **{t: _Mixers(_gqa, _gated_deltanet) for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "bamba": _Mixers(_gqa, _mamba2),
    "falcon_h1": _Mixers(_gqa, _mamba2),
    "jamba": _Mixers(_gqa, _mamba1),
}


def compute_model(config: Mapping[str, object] | None, geometry: Geometry,
                  active_params: float = 8e9) -> ComputeModel:
    """The model's compute from its config.json when given and modelled, else the geometry
    estimate with `active_params`."""
    if config is not None and "groups" not in config:
        model = compute_from_hf_config(config, geometry)
        if model is not None:
            return model
    return compute_from_geometry(geometry, active_params)
