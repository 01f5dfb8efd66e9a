"""Geometry from a Hugging Face `config.json` (no weights) or a loaded `PretrainedConfig`.

Each family reader turns the config into one cache spec per model layer (a layer may have two:
Falcon-H1 runs attention and Mamba side by side), mirroring what transformers 5.19 allocates
in its cache for that family. Layers with equal specs form one group.

Group order (part of every key, so it is fixed and documented): groups appear in the order of
the first layer that uses them, walking layers 0..N-1 and, within one layer, the attention cache
before the state. Group names are the kind (`full`, `sliding`, `chunked`, `mla`) or the state
family (`linear_attention`, `mamba`); a second group of the same name gets `_2`, and so on.
Each group records its model layer indices in `Group.layers`.

Sizes, per layer (d = bytes of the KV dtype):
- attention: `2 * num_key_value_heads * head_dim * d` per token (K and V);
- MLA (DeepSeek-V3): `(kv_lora_rank + qk_rope_head_dim) * d` per token (transformers caches
  the compressed latent and the rope key, not per-head K/V);
- state groups: conv state `conv_dim * conv_kernel * d` plus the recurrent / SSM state, which
  transformers keeps in float32 (4 bytes) whatever the model dtype (measured, see
  tests/core/test_hf_config_measured.py).

Options: `dtype` (default: the config's `dtype`/`torch_dtype`, else bfloat16) and `block_size`
(the engine's tokens per block, default 16). Every group, state groups too, gets
`tokens_per_block = block_size`, and `tokens_per_hash = block_size`; an engine with other
block sizes (vLLM pads state pages into larger blocks) reads its own geometry instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvtier.errors import ConfigError, UnsupportedModelError
from kvtier.core.geometry import DTYPE_BYTES, Geometry, Group, dtype_bytes
from kvtier.core.hf_families import FAMILIES, Cfg, Reader, Spec, read_llama

DEFAULT_BLOCK_SIZE = 16
DEFAULT_DTYPE = "bfloat16"

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
    "float8_e4m3": "float8_e4m3fn",
}

# multimodal wrappers whose decoder lives in `text_config`, and the text model_type it has
_WRAPPERS = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "llama4": "llama4_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}

# KV formats that are not an element dtype: each row is packed by the model's own kernels, and
# the family reader sizes it (DeepSeek V4: fp8 no-rope part + bf16 rope part + scales)
PACKED_FORMATS = {"fp8_ds_mla": ("deepseek_v4",)}

SUPPORTED_MODEL_TYPES = tuple(sorted({*FAMILIES, *_WRAPPERS}))

# keys that mean a layer is not plain full attention: a generic reading would be wrong
_HYBRID_HINTS = ("kv_lora_rank", "attention_chunk_size", "layers_block_type", "attn_layer_indices",
                 "attn_layer_period", "block_types", "full_attention_interval")
_HYBRID_PREFIXES = ("mamba_", "ssm_", "linear_", "rwkv", "conv_")


def geometry_from_hf_config(
    config: Mapping[str, object], dtype: str | None = None, block_size: int | None = None
) -> Geometry:
    """Read a config.json dict (or `PretrainedConfig.to_dict()`) into a Geometry."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"a Hugging Face config must be a JSON object, got {type(config).__name__}")
    text, model_type = text_config(config)
    block = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ConfigError(f"block_size {block_size!r} must be a positive integer (tokens per block)")
    kv_dtype = _normalise_dtype(dtype) if dtype is not None else _config_dtype(text, config)
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError("config.json has no 'model_type'; give a geometry JSON instead")
    if kv_dtype in PACKED_FORMATS and model_type not in PACKED_FORMATS[kv_dtype]:
        raise ConfigError(
            f"dtype {kv_dtype!r} is a packed KV format of {', '.join(PACKED_FORMATS[kv_dtype])} only; "
            f"model_type {model_type!r} takes one of: {', '.join(DTYPE_BYTES)}"
        )
    d = 1 if kv_dtype in PACKED_FORMATS else dtype_bytes(kv_dtype)
    family = FAMILIES.get(model_type)
    if family is None:
        reader, defaults, source = _generic(text, model_type), {}, f"generic reading of model_type {model_type!r}"
    else:
        (reader, defaults), source = family, f"hf config.json, model_type {model_type!r}"
    try:
        layers = reader(Cfg(text, model_type, defaults, kv_format=kv_dtype), d)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
        # A field of the wrong shape (a string where a list belongs, a list too short) is the
        # caller's file, not a kvtier bug: one line naming it beats a traceback. The readers
        # check the fields that matter one by one; this is the net for the rest.
        raise ConfigError(
            f"config.json of model_type {model_type!r} has a malformed field ({type(exc).__name__}: "
            f"{exc}); check it against the model's published config.json"
        ) from None
    groups = _group(layers, block, kv_dtype)
    name = str(config.get("_name_or_path") or model_type)
    return Geometry(groups=groups, tokens_per_hash=block, name=name,
                    source=f"{source}, dtype {kv_dtype}, block_size {block}")


def text_config(config: Mapping[str, object]) -> tuple[Mapping[str, object], object]:
    """The decoder's config (a multimodal wrapper's `text_config`) and its family's model_type."""
    model_type = config.get("model_type")
    text = config
    if isinstance(config.get("text_config"), Mapping):
        text = config["text_config"]  # type: ignore[assignment]
        model_type = text.get("model_type") or _WRAPPERS.get(str(model_type), model_type)
    if model_type == "gemma3" and "num_hidden_layers" in text:  # older 1B-style text-only configs
        model_type = "gemma3_text"
    if model_type == "gemma4":
        model_type = "gemma4_text"
    return text, model_type


def geometry_from_pretrained_config(
    config_obj: object, dtype: str | None = None, block_size: int | None = None
) -> Geometry:
    """The same reading for a loaded transformers `PretrainedConfig` (a model in memory).

    Uses `config_obj.to_dict()`, which holds what `__post_init__` derived (e.g. `layer_types`),
    and the config's torch dtype when `dtype` is not given.
    """
    to_dict = getattr(config_obj, "to_dict", None)
    if not callable(to_dict):
        raise ConfigError(f"expected a transformers PretrainedConfig, got {type(config_obj).__name__}")
    data = to_dict()
    if dtype is None:
        text = config_obj.get_text_config() if hasattr(config_obj, "get_text_config") else config_obj
        for obj in (text, config_obj):
            value = getattr(obj, "dtype", None) or getattr(obj, "torch_dtype", None)
            if value is not None:
                dtype = _normalise_dtype(str(value))
                break
    return geometry_from_hf_config(data, dtype=dtype, block_size=block_size)


def _generic(text: Mapping[str, object], model_type: str) -> Reader:
    types = text.get("layer_types")
    hybrid = [k for k in text if k in _HYBRID_HINTS or k.startswith(_HYBRID_PREFIXES)]
    if text.get("sliding_window") is not None:
        hybrid.append("sliding_window")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        hybrid.append("layer_types")
    if hybrid or "num_hidden_layers" not in text or "num_attention_heads" not in text:
        why = f"it has {hybrid[0]!r}" if hybrid else "it lacks num_hidden_layers/num_attention_heads"
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported and cannot be read as a standard decoder "
            f"({why}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}; or write a geometry JSON "
            "(docs/geometry.md)"
        )
    return read_llama


def _group(layers: list[tuple[int, Spec]], block: int, dtype: str) -> tuple[Group, ...]:
    order: list[Spec] = []
    members: dict[Spec, list[int]] = {}
    for i, spec in layers:
        if spec not in members:
            order.append(spec)
            members[spec] = []
        members[spec].append(i)
    names: dict[str, int] = {}
    out = []
    for spec in order:
        names[spec.label] = names.get(spec.label, 0) + 1
        name = spec.label if names[spec.label] == 1 else f"{spec.label}_{names[spec.label]}"
        out.append(Group(
            name=name, kind=spec.kind, num_layers=len(members[spec]),
            # a block holds whole entries of a compressed cache
            tokens_per_block=math.lcm(block, spec.compress_ratio),
            bytes_per_token_per_layer=spec.bytes_per_token_per_layer,
            state_bytes_per_layer=spec.state_bytes_per_layer, window=spec.window,
            attention_chunk=spec.attention_chunk, dtype=spec.dtype or dtype, layers=tuple(members[spec]),
            compress_ratio=spec.compress_ratio, cacheable=spec.cacheable, reason=spec.reason,
        ))
    return tuple(out)


def _normalise_dtype(value: str) -> str:
    name = str(value).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def _config_dtype(text: Mapping[str, object], top: Mapping[str, object]) -> str:
    for cfg in (text, top):
        for key in ("dtype", "torch_dtype"):
            value = cfg.get(key)
            if isinstance(value, str) and value != "auto":
                return _normalise_dtype(value)
    return DEFAULT_DTYPE
