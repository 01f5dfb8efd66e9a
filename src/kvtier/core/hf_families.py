"""Family readers for `kvtier.core.hf_config`: one cache spec per model layer, per model_type.

Each reader mirrors what transformers 5.19 allocates in its cache for that family (checked
against real tiny models in tests/core/test_hf_config_measured.py). `FAMILIES` maps a
model_type to its reader and the transformers class defaults it needs when config.json omits
a field (configs on the Hub leave out values equal to the class default).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtier.errors import ConfigError, UnsupportedModelError

STATE_FP32_BYTES = 4  # transformers keeps recurrent / SSM states in float32


@dataclass(frozen=True, slots=True)
class Spec:
    """What one layer caches; equal specs share a group."""

    label: str
    kind: str
    bytes_per_token_per_layer: int = 0
    state_bytes_per_layer: int = 0
    window: int | None = None
    attention_chunk: int | None = None
    compress_ratio: int = 1  # tokens per cache entry (DeepSeek V4's compressed caches)
    dtype: str | None = None  # None: the KV dtype; else this group's own (fp32 states, uint8 rows)
    cacheable: bool = True
    reason: str = ""


MAX_LAYERS = 100_000  # far above any published model; a typo of 10**9 must not build a 10**9-entry list


class Cfg:
    """A config dict with the family's transformers defaults and errors that name the field."""

    def __init__(self, data: Mapping[str, object], model_type: str, defaults: Mapping[str, object],
                 kv_format: str = ""):
        self.data, self.model_type, self.defaults = data, model_type, defaults
        self.kv_format = kv_format  # the KV dtype's name ("fp8_ds_mla" means DeepSeek's packed rows)

    def get(self, key: str) -> object:
        # The class default applies only when the key is absent, as in transformers: an explicit
        # null (Mistral v0.3's "sliding_window": null) means "none", not "the default".
        return self.data[key] if key in self.data else self.defaults.get(key)

    def int(self, key: str, fallback: int | None = None) -> int:
        value = self.get(key)
        if value is None and fallback is not None:
            return fallback
        if not _is_positive_int(value):
            what = "is missing field" if value is None else f"has {value!r} for field"
            raise ConfigError(
                f"config.json of model_type {self.model_type!r} {what} {key!r}; "
                "it must be a positive integer"
            )
        return value  # type: ignore[return-value]

    def layers(self) -> int:
        """num_hidden_layers, bounded: every family builds a list with one entry per layer."""
        n = self.int("num_hidden_layers")
        if n > MAX_LAYERS:
            raise ConfigError(
                f"config.json of model_type {self.model_type!r} has {n} for field 'num_hidden_layers'; "
                f"kvtier reads models of at most {MAX_LAYERS} layers"
            )
        return n

    def opt_int(self, key: str) -> int | None:
        return None if self.get(key) is None else self.int(key)


# ---------------------------------------------------------------------------------------------
# per-family readers: (cfg, d) -> [(layer index, spec)], d = bytes per element of the KV dtype


def _attn_bytes(cfg: Cfg, d: int) -> int:
    heads = cfg.get("num_key_value_heads")
    heads = cfg.int("num_key_value_heads") if heads is not None else cfg.int("num_attention_heads")
    return 2 * heads * _head_dim(cfg) * d


def _head_dim(cfg: Cfg) -> int:
    if cfg.get("head_dim") is not None:
        return cfg.int("head_dim")
    return cfg.int("hidden_size") // cfg.int("num_attention_heads")


def _layer_types(cfg: Cfg, default: Callable[[int], str]) -> list[str]:
    n = cfg.layers()
    types = cfg.data.get("layer_types")
    if types is None:
        return [default(i) for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(
            f"config.json field 'layer_types' must list one type per layer ({n} layers), got {types!r}"
        )
    return types


def _by_type(cfg: Cfg, types: list[str], specs: Mapping[str, Spec]) -> list[tuple[int, Spec]]:
    out = []
    for i, t in enumerate(types):
        if t not in specs:
            raise UnsupportedModelError(
                f"layer {i} of model_type {cfg.model_type!r} has layer type {t!r}; kvtier reads "
                f"{', '.join(sorted(specs))} for this family"
            )
        out.append((i, specs[t]))
    return out


def _sliding_or_full(cfg: Cfg, d: int, default: Callable[[int], str]) -> list[tuple[int, Spec]]:
    """Full + sliding-window attention with one head size (Llama, Qwen, Mistral, Gemma 2/3, gpt-oss)."""
    types = _layer_types(cfg, default)
    b = _attn_bytes(cfg, d)
    window = cfg.opt_int("sliding_window")
    full = Spec("full", "full", b)
    # no window: transformers runs "sliding_attention" layers as full attention
    sliding = Spec("sliding", "sliding", b, window=window) if window is not None else full
    specs = {"full_attention": full, "sliding_attention": sliding}
    return _by_type(cfg, types, specs)


def read_llama(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    return _sliding_or_full(cfg, d, lambda i: "full_attention")


def _all_sliding_if_window(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """Mistral / Mixtral / Qwen3-MoE: `sliding_window` (when set) applies to every layer."""
    if cfg.model_type == "qwen3_moe" and not cfg.get("use_sliding_window"):
        cfg = Cfg({**cfg.data, "sliding_window": None}, cfg.model_type, cfg.defaults)
    sliding = cfg.get("sliding_window") is not None
    return _sliding_or_full(cfg, d, lambda i: "sliding_attention" if sliding else "full_attention")


def _qwen2(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """Qwen2/Qwen3: sliding only with `use_sliding_window`, on layers >= `max_window_layers`."""
    if not cfg.get("use_sliding_window"):
        cfg = Cfg({**cfg.data, "sliding_window": None}, cfg.model_type, cfg.defaults)
    first = cfg.int("max_window_layers") if cfg.get("use_sliding_window") else 0
    sliding = cfg.get("sliding_window") is not None
    return _sliding_or_full(
        cfg, d, lambda i: "sliding_attention" if sliding and i >= first else "full_attention"
    )


def _every_nth_full(n_key: str, fallback: int) -> Callable[[Cfg, int], list[tuple[int, Spec]]]:
    """Gemma 2/3, gpt-oss: layer i is full when (i+1) % pattern == 0, else sliding."""

    def read(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
        _refuse_bidirectional(cfg)
        key = n_key if n_key in cfg.data else "_" + n_key
        pattern = cfg.int(key, fallback=fallback)
        return _sliding_or_full(
            cfg, d, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention"
        )

    return read


def _gemma4(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """Gemma 4: global (full) layers have their own head size and KV heads; the last
    `num_kv_shared_layers` layers reuse earlier layers' KV and cache nothing themselves."""
    _refuse_bidirectional(cfg)
    n = cfg.layers()
    types = _layer_types(cfg, lambda i: "full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
    types = [*types[:-1], "full_attention"]  # transformers forces the last layer to full
    window = cfg.int("sliding_window")
    kv, hd = cfg.int("num_key_value_heads"), _head_dim(cfg)
    # a config saved by transformers 5.x holds per-layer overrides instead of global_head_dim
    raw = cfg.data.get("per_layer_config")
    overrides = None
    if isinstance(raw, Mapping):
        overrides = {}
        for k, v in raw.items():
            if not (isinstance(k, str) and k.isdigit() or isinstance(k, int) and not isinstance(k, bool)):
                raise ConfigError(f"config.json of model_type {cfg.model_type!r} has per_layer_config key "
                                  f"{k!r}; keys must be layer numbers")
            if not isinstance(v, Mapping):
                raise ConfigError(f"config.json of model_type {cfg.model_type!r} has per_layer_config[{k!r}]"
                                  f"={v!r}; it must be an object")
            overrides[int(k)] = v
    global_kv = cfg.data.get("num_global_key_value_heads")
    if not cfg.get("attention_k_eq_v") or global_kv is None:
        global_kv = kv
    global_kv = _positive_field(cfg, "num_global_key_value_heads", global_kv)
    shared = cfg.data.get("num_kv_shared_layers") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < n:
        raise ConfigError(
            f"config.json of model_type {cfg.model_type!r} has num_kv_shared_layers={shared!r}; "
            f"it must be an integer from 0 to {n - 1}"
        )
    out = []
    for i, t in enumerate(types[: n - shared]):
        heads, dim = kv, hd
        if overrides is not None:
            o = overrides.get(i) or {}
            heads = _positive_field(cfg, f"per_layer_config[{i}].num_key_value_heads", o.get("num_key_value_heads", kv))
            dim = _positive_field(cfg, f"per_layer_config[{i}].head_dim", o.get("head_dim", hd))
        elif t == "full_attention":
            heads, dim = global_kv, cfg.int("global_head_dim", fallback=512)
        b = 2 * heads * dim * d
        if t == "sliding_attention":
            out.append((i, Spec("sliding", "sliding", b, window=window)))
        elif t == "full_attention":
            out.append((i, Spec("full", "full", b)))
        else:
            raise UnsupportedModelError(f"layer {i} of gemma4 has layer type {t!r}")
    return out


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_field(cfg: Cfg, what: str, value: object) -> int:
    if not _is_positive_int(value):
        raise ConfigError(f"config.json of model_type {cfg.model_type!r} has {what}={value!r}; "
                          "it must be a positive integer")
    return value


def _refuse_bidirectional(cfg: Cfg) -> None:
    mode = cfg.data.get("use_bidirectional_attention")
    if mode is True or mode == "all":
        raise UnsupportedModelError(
            f"model_type {cfg.model_type!r} with use_bidirectional_attention={mode!r}: later "
            "tokens change earlier tokens' KV, so no prefix cache is valid for it"
        )


def _mla(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """DeepSeek-V2/V3 MLA: the compressed latent plus the shared rope key, one head."""
    b = (cfg.int("kv_lora_rank") + cfg.int("qk_rope_head_dim")) * d
    return [(i, Spec("mla", "mla", b)) for i in range(cfg.layers())]


def _gated_deltanet(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """Qwen3-Next / Qwen3.5: GatedDeltaNet layers (conv + recurrent state) and full attention.

    conv state: (2 * k_heads * k_dim + v_heads * v_dim) channels x conv kernel, model dtype;
    recurrent state: v_heads x k_dim x v_dim, float32.
    """
    nk, dk = cfg.int("linear_num_key_heads"), cfg.int("linear_key_head_dim")
    nv, dv = cfg.int("linear_num_value_heads"), cfg.int("linear_value_head_dim")
    conv = (2 * nk * dk + nv * dv) * cfg.int("linear_conv_kernel_dim") * d
    state = conv + nv * dk * dv * STATE_FP32_BYTES
    every = cfg.int("full_attention_interval", fallback=4)
    types = _layer_types(cfg, lambda i: "full_attention" if (i + 1) % every == 0 else "linear_attention")
    specs = {
        "full_attention": Spec("full", "full", _attn_bytes(cfg, d)),
        "linear_attention": Spec("linear_attention", "state", state_bytes_per_layer=state),
    }
    return _by_type(cfg, types, specs)


def _mamba2_state(cfg: Cfg, d: int, intermediate: int) -> int:
    """Mamba-2: conv (intermediate + 2*groups*d_state) x d_conv, model dtype; SSM heads x
    head_dim x d_state, float32."""
    d_state, heads = cfg.int("mamba_d_state"), cfg.int("mamba_n_heads")
    head_dim = cfg.get("mamba_d_head")
    if head_dim in (None, "auto"):
        head_dim = intermediate // heads
    conv_dim = intermediate + 2 * cfg.int("mamba_n_groups") * d_state
    return conv_dim * cfg.int("mamba_d_conv") * d + heads * int(head_dim) * d_state * STATE_FP32_BYTES


def _bamba(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """Bamba: Mamba-2 layers, attention on `attn_layer_indices`."""
    attn = set(cfg.data.get("attn_layer_indices") or ())
    state = _mamba2_state(cfg, d, cfg.int("mamba_expand") * cfg.int("hidden_size"))
    full, mamba = Spec("full", "full", _attn_bytes(cfg, d)), Spec("mamba", "state", state_bytes_per_layer=state)
    return [(i, full if i in attn else mamba) for i in range(cfg.layers())]


def _falcon_h1(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """Falcon-H1: every layer runs attention and Mamba-2 in parallel: one spec of each."""
    inter = cfg.opt_int("mamba_d_ssm") or cfg.int("mamba_expand") * cfg.int("hidden_size")
    full = Spec("full", "full", _attn_bytes(cfg, d))
    mamba = Spec("mamba", "state", state_bytes_per_layer=_mamba2_state(cfg, d, inter))
    out = []
    for i in range(cfg.layers()):
        out += [(i, full), (i, mamba)]
    return out


def _jamba(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """Jamba: Mamba-1 layers (conv intermediate x d_conv, model dtype; SSM intermediate x
    d_state, float32), attention where i % attn_layer_period == attn_layer_offset."""
    inter = cfg.int("mamba_expand") * cfg.int("hidden_size")
    state = inter * cfg.int("mamba_d_conv") * d + inter * cfg.int("mamba_d_state") * STATE_FP32_BYTES
    period, offset = cfg.int("attn_layer_period"), cfg.get("attn_layer_offset")
    window = cfg.opt_int("sliding_window")
    b = _attn_bytes(cfg, d)
    attn = Spec("sliding", "sliding", b, window=window) if window else Spec("full", "full", b)
    mamba = Spec("mamba", "state", state_bytes_per_layer=state)
    return [(i, attn if i % period == offset else mamba) for i in range(cfg.layers())]


def _llama4(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """Llama 4: chunked local attention (RoPE layers), full attention on the NoPE layers."""
    every = cfg.int("no_rope_layer_interval", fallback=4)
    no_rope = cfg.data.get("no_rope_layers") or [
        int((i + 1) % every != 0) for i in range(cfg.layers())
    ]
    chunk = cfg.opt_int("attention_chunk_size")
    types = _layer_types(
        cfg, lambda i: "chunked_attention" if no_rope[i] and chunk else "full_attention"
    )
    b = _attn_bytes(cfg, d)
    specs = {"full_attention": Spec("full", "full", b)}
    if chunk:
        specs["chunked_attention"] = Spec("chunked", "chunked", b, attention_chunk=chunk)
    return _by_type(cfg, types, specs)


# DeepSeek V4 (as vLLM 0.32/0.33 caches it; transformers' own V4 cache keeps compressor buffers
# and entry counts kvtier does not restore, so the transformers integration refuses the model)
_DSV4_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_DSV4_BY_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _dsv4_layer_types(cfg: Cfg) -> list[tuple[str, int]]:
    """(layer type, compress ratio) of each decoder layer, read as transformers' DeepseekV4Config
    does: `layer_types` + `compress_rates`, else the legacy per-layer `compress_ratios` (which may
    list the MTP layers after the decoder's), else the V4 default (2 HCA, then CSA/HCA in turn)."""
    n = cfg.layers()
    rates = {k: v for k, v in _DSV4_TYPES.items() if v}
    given = cfg.data.get("compress_rates")
    if isinstance(given, Mapping):
        for k, v in given.items():
            rates[str(k)] = _positive_field(cfg, f"compress_rates[{k!r}]", v)
    for key in ("compress_rate_csa", "compress_rate_hca"):
        if key in cfg.data:
            name = "compressed_sparse_attention" if key.endswith("csa") else "heavily_compressed_attention"
            rates[name] = _positive_field(cfg, key, cfg.data[key])
    types = cfg.data.get("layer_types")
    legacy = cfg.data.get("compress_ratios")
    if types is None and isinstance(legacy, list):
        if len(legacy) < n or any(r not in _DSV4_BY_RATIO for r in legacy):
            raise ConfigError(
                f"config.json of model_type {cfg.model_type!r} has compress_ratios={legacy!r}; it must "
                f"list one of 0, 4, 128 for each of the {n} layers"
            )
        types = [_DSV4_BY_RATIO[r] for r in legacy[:n]]
    if types is None:
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(
            f"config.json field 'layer_types' must list one type per layer ({n} layers), got {types!r}"
        )
    out = []
    for i, t in enumerate(types):
        if t not in _DSV4_TYPES:
            raise UnsupportedModelError(
                f"layer {i} of model_type {cfg.model_type!r} has layer type {t!r}; kvtier reads "
                f"{', '.join(_DSV4_TYPES)} for this family"
            )
        out.append((t, rates.get(t, 0)))
    return out


def _deepseek_v4(cfg: Cfg, d: int) -> list[tuple[int, Spec]]:
    """DeepSeek V4: shared-KV MQA (one head of `head_dim`, K = V) over a sliding window on every
    layer; compressed layers add one cache entry per `ratio` tokens (CSA: 4, HCA: 128) and a
    compressor state (a window of uncompressed K/V + gate, float32: CSA's overlapping windows keep
    2 x ratio tokens of 2 series, HCA's ratio tokens of one); CSA adds the lightning indexer's
    compressed keys (fp8 + a float32 scale per entry, whatever the KV dtype) and its own compressor
    state. MTP layers (`num_nextn_predict_layers`) cache a sliding window only, when the engine
    drafts with them.

    Sizes are vLLM's (0.32/0.33 DeepseekV4 attention specs, checked against them in
    tests/integrations/test_vllm_plan_dsv4.py). Under `fp8_ds_mla` (DeepSeek's packed format, what
    vLLM uses by default) a row is the fp8 no-rope part, the bf16 rope part and one scale byte per
    64 values plus one pad byte: 584 bytes for head_dim 512, rope 64."""
    head, window = cfg.int("head_dim"), cfg.int("sliding_window")
    rope = cfg.get("qk_rope_head_dim")
    if rope is None:
        factor = cfg.get("partial_rotary_factor")
        rope = round(head * factor) if isinstance(factor, (int, float)) and factor > 0 else 64
    rope = _positive_field(cfg, "qk_rope_head_dim", rope)
    index_dim = cfg.int("index_head_dim")
    if cfg.kv_format == "fp8_ds_mla":
        nope = head - rope
        row, row_dtype = nope + 2 * rope + nope // 64 + 1, "uint8"
    else:
        row, row_dtype = head * d, None
    swa = Spec("sliding", "sliding", row, window=window, dtype=row_dtype)
    out: list[tuple[int, Spec]] = []
    layers = _dsv4_layer_types(cfg)
    for i, (t, ratio) in enumerate(layers):
        out.append((i, swa))
        if not ratio:
            continue
        csa = t == "compressed_sparse_attention"
        out.append((i, Spec(f"compressed_{ratio}", "mla", row, compress_ratio=ratio, dtype=row_dtype)))
        if csa:
            out.append((i, Spec("indexer", "mla", index_dim + STATE_FP32_BYTES, compress_ratio=ratio,
                                dtype="uint8")))
        series = 2 if csa else 1
        out.append((i, Spec(f"compressor_{ratio}", "sliding", series * head * 2 * STATE_FP32_BYTES,
                            window=series * ratio, dtype="float32")))
        if csa:
            out.append((i, Spec("indexer_compressor", "sliding", 2 * index_dim * 2 * STATE_FP32_BYTES,
                                window=2 * ratio, dtype="float32")))
    mtp = cfg.data.get("num_nextn_predict_layers", cfg.defaults.get("num_nextn_predict_layers")) or 0
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise ConfigError(f"config.json of model_type {cfg.model_type!r} has num_nextn_predict_layers="
                          f"{mtp!r}; it must be an integer >= 0")
    draft = Spec("mtp_sliding", "sliding", row, window=window, dtype=row_dtype, cacheable=False,
                 reason="MTP draft layer: cached only when the engine drafts with it")
    out += [(len(layers) + j, draft) for j in range(mtp)]
    return out


Reader = Callable[[Cfg, int], list[tuple[int, Spec]]]

# model_type -> (reader, transformers 5.19 class defaults the reader may need)
FAMILIES: dict[str, tuple[Reader, dict[str, object]]] = {
    "llama": (read_llama, {}),
    "qwen2": (_qwen2, {"max_window_layers": 28, "sliding_window": 4096}),
    "qwen2_moe": (_qwen2, {"max_window_layers": 28, "sliding_window": 4096}),
    "qwen3": (_qwen2, {"max_window_layers": 28, "sliding_window": 4096, "head_dim": 128}),
    "qwen3_moe": (_all_sliding_if_window, {"sliding_window": 4096}),
    "mistral": (_all_sliding_if_window, {"sliding_window": 4096}),
    "mixtral": (_all_sliding_if_window, {}),
    "gemma2": (_every_nth_full("sliding_window_pattern", 2),
               {"num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 256, "sliding_window": 4096, "hidden_size": 2304}),
    "gemma3_text": (_every_nth_full("sliding_window_pattern", 6),
                    {"num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                     "head_dim": 256, "sliding_window": 4096, "hidden_size": 2304}),
    "gemma4_text": (_gemma4, {"num_hidden_layers": 30, "num_attention_heads": 8,
                              "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 512,
                              "hidden_size": 2304}),
    "gpt_oss": (_every_nth_full("sliding_window_pattern", 2),
                {"num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
                 "head_dim": 64, "sliding_window": 128, "hidden_size": 2880}),
    "deepseek_v2": (_mla, {"kv_lora_rank": 512, "qk_rope_head_dim": 64}),
    "deepseek_v3": (_mla, {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}),
    "deepseek_v4": (_deepseek_v4, {"num_hidden_layers": 43, "head_dim": 512, "sliding_window": 128,
                                   "index_head_dim": 128, "num_nextn_predict_layers": 1}),
    "kimi_k2": (_mla, {"kv_lora_rank": 512, "qk_rope_head_dim": 64}),
    "qwen3_next": (_gated_deltanet, {"head_dim": 256, "linear_conv_kernel_dim": 4,
                                     "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                     "linear_num_key_heads": 16, "linear_num_value_heads": 32}),
    "qwen3_5_text": (_gated_deltanet, {"head_dim": 256, "linear_conv_kernel_dim": 4,
                                       "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                       "linear_num_key_heads": 16, "linear_num_value_heads": 32}),
    "qwen3_5_moe_text": (_gated_deltanet, {"head_dim": 256, "linear_conv_kernel_dim": 4,
                                           "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                           "linear_num_key_heads": 16, "linear_num_value_heads": 32}),
    "bamba": (_bamba, {"mamba_d_conv": 4, "mamba_d_state": 256, "mamba_n_heads": 128,
                       "mamba_n_groups": 1, "mamba_expand": 2}),
    "falcon_h1": (_falcon_h1, {"mamba_d_conv": 4, "mamba_d_state": 256, "mamba_n_heads": 128,
                               "mamba_n_groups": 1, "mamba_expand": 2, "mamba_d_ssm": 1024}),
    "jamba": (_jamba, {"mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
                       "attn_layer_period": 8, "attn_layer_offset": 4}),
    "llama4_text": (_llama4, {"attention_chunk_size": 8192, "head_dim": 128}),
}
