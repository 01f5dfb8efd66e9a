"""Geometry from the shipped config.json fixtures, checked against hand-derived numbers.

Notation in the comments: kv = num_key_value_heads, hd = head_dim, d = bytes per element of the
KV dtype. Attention bytes per token per layer = 2 (K and V) * kv * hd * d.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError, UnsupportedModelError
from kvtier.core.geometry import Geometry
from kvtier.core.load import load_geometry
from kvtier.core.hf_config import SUPPORTED_MODEL_TYPES, geometry_from_hf_config

import kvtier

DATA = Path(kvtier.__file__).parent / "data"


def _groups(g: Geometry) -> list[tuple]:
    return [
        (x.name, x.kind, x.num_layers, x.bytes_per_token_per_layer or x.state_bytes_per_layer,
         x.window or x.attention_chunk)
        for x in g.groups
    ]


def test_llama_3_8b(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("llama-3-8b"))
    # 32 full layers; hd = 4096 / 32 = 128; 2 * 8 * 128 * 2 (bf16) = 4096
    assert _groups(g) == [("full", "full", 32, 4096, None)]
    assert g.groups[0].layers == tuple(range(32))
    assert g.tokens_per_hash == 16 and g.groups[0].tokens_per_block == 16
    assert g.groups[0].dtype == "bfloat16"


def test_gemma_3_270m(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("gemma-3-270m"))
    # layer_types: full at 5, 11, 17 (every 6th); 2 * 1 * 256 * 2 = 1024; window 512.
    # Layer 0 is sliding, so the sliding group comes first.
    assert _groups(g) == [("sliding", "sliding", 15, 1024, 512), ("full", "full", 3, 1024, None)]
    assert g.groups[1].layers == (5, 11, 17)


def test_gemma_3_27b_matches_the_issue_example(hf_config, geometry_path) -> None:
    g = geometry_from_hf_config(hf_config("gemma-3-27b"))
    # text_config: 62 layers, pattern 6 -> full at 5, 11, ..., 59 = 10 layers, 52 sliding;
    # 2 * 16 * 128 * 2 = 8192; window 1024: the issue's global/local groups.
    assert _groups(g) == [("sliding", "sliding", 52, 8192, 1024), ("full", "full", 10, 8192, None)]
    assert g.groups[1].layers == tuple(range(5, 62, 6))
    example = {x.name: x for x in load_geometry(geometry_path("gemma-3-27b-example")).groups}
    assert g.groups[1].bytes_per_token_per_layer == example["global"].bytes_per_token_per_layer
    assert g.groups[0].window == example["local"].window


def test_gemma_2_9b_float32_and_dtype_option(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("gemma-2-9b"))
    # torch_dtype float32; alternate sliding (even) / full (odd): 21 + 21; 2 * 8 * 256 * 4 = 16384
    assert _groups(g) == [("sliding", "sliding", 21, 16384, 4096), ("full", "full", 21, 16384, None)]
    assert g.groups[0].layers == tuple(range(0, 42, 2))
    bf16 = geometry_from_hf_config(hf_config("gemma-2-9b"), dtype="bfloat16")
    assert [x.bytes_per_token_per_layer for x in bf16.groups] == [8192, 8192]
    assert bf16.fingerprint() != g.fingerprint()


def test_gemma_4_style_global_layers_have_their_own_head_size(hf_config) -> None:
    cfg = hf_config("gemma-4-like")
    g = geometry_from_hf_config(cfg)
    # 30 layers, pattern 6: full at 5, 11, 17, 23, 29. sliding: 2 * 4 * 256 * 2 = 4096;
    # full: attention_k_eq_v with 1 global KV head of global_head_dim 512: 2 * 1 * 512 * 2 = 2048
    assert _groups(g) == [("sliding", "sliding", 25, 4096, 1024), ("full", "full", 5, 2048, None)]
    # without attention_k_eq_v the global layers keep num_key_value_heads: 2 * 4 * 512 * 2
    cfg["text_config"]["attention_k_eq_v"] = False
    assert geometry_from_hf_config(cfg).groups[1].bytes_per_token_per_layer == 8192
    # the last 10 layers reuse earlier KV and cache nothing: layers 0..19 remain,
    # full at 5, 11, 17 -> 3; sliding 17
    cfg["text_config"]["num_kv_shared_layers"] = 10
    shared = geometry_from_hf_config(cfg)
    assert [(x.name, x.num_layers) for x in shared.groups] == [("sliding", 17), ("full", 3)]
    assert max(max(x.layers) for x in shared.groups) == 19


def test_gpt_oss_20b(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("gpt-oss-20b"))
    # no torch_dtype in the config -> bfloat16; 2 * 8 * 64 * 2 = 2048; window 128
    assert _groups(g) == [("sliding", "sliding", 12, 2048, 128), ("full", "full", 12, 2048, None)]
    assert g.groups[0].dtype == "bfloat16"


def test_deepseek_v3_mla(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("deepseek-v3"))
    # MLA caches kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 elements * 2 = 1152
    assert _groups(g) == [("mla", "mla", 61, 1152, None)]


def test_qwen3_next(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("qwen3-next-80b-a3b"))
    # full_attention_interval 4: full at 3, 7, ..., 47 = 12; 36 GatedDeltaNet layers.
    # full: 2 * 2 * 256 * 2 = 2048.
    # conv: (2 * 16 * 128 + 32 * 128) = 8192 channels * kernel 4 * 2 = 65536
    # recurrent (float32): 32 * 128 * 128 * 4 = 2097152; state = 2162688
    assert _groups(g) == [("linear_attention", "state", 36, 2162688, None),
                          ("full", "full", 12, 2048, None)]
    assert g.groups[1].layers == tuple(range(3, 48, 4))
    fp8 = geometry_from_hf_config(hf_config("qwen3-next-80b-a3b"), dtype="float8_e4m3fn")
    # the dtype scales the conv state and the attention, not the float32 recurrent state:
    # 8192 * 4 * 1 + 2097152 = 2129920; 2 * 2 * 256 * 1 = 1024
    assert [x.bytes_per_token_per_layer or x.state_bytes_per_layer for x in fp8.groups] == [2129920, 1024]


def test_qwen3_5_like_wrapper(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("qwen3.5-like"))
    # text_config: 32 layers -> 8 full, 24 linear; full 2 * 4 * 256 * 2 = 4096; state as Qwen3-Next
    assert _groups(g) == [("linear_attention", "state", 24, 2162688, None),
                          ("full", "full", 8, 4096, None)]


def test_falcon_h1_every_layer_has_attention_and_mamba(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("falcon-h1-0.5b"))
    # attention: 2 * 2 * 64 * 2 = 512. Mamba-2: intermediate = mamba_d_ssm 1536;
    # conv (1536 + 2 * 1 * 128) = 1792 * 4 * 2 = 14336; SSM (float32) 24 * 64 * 128 * 4 = 786432
    assert _groups(g) == [("full", "full", 36, 512, None), ("mamba", "state", 36, 800768, None)]
    assert g.groups[0].layers == g.groups[1].layers == tuple(range(36))


def test_bamba_9b(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("bamba-9b"))
    # attention on 9, 18, 27: 2 * 8 * 128 * 2 = 4096. Mamba-2: intermediate 2 * 4096 = 8192;
    # conv (8192 + 2 * 128) * 4 * 2 = 67584; SSM 128 heads * 64 * 128 * 4 = 4194304
    assert _groups(g) == [("mamba", "state", 29, 4261888, None), ("full", "full", 3, 4096, None)]
    assert g.groups[1].layers == (9, 18, 27)


def test_jamba(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("jamba-v0.1"))
    # attention where i % 8 == 4: 4, 12, 20, 28; 2 * 8 * 128 * 2 = 4096.
    # Mamba-1: intermediate 8192; conv 8192 * 4 * 2 = 65536; SSM 8192 * 16 * 4 = 524288
    assert _groups(g) == [("mamba", "state", 28, 589824, None), ("full", "full", 4, 4096, None)]
    assert g.groups[1].layers == (4, 12, 20, 28)


def test_llama_4_scout_chunked(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("llama-4-scout"))
    # no_rope_layer_interval 4: NoPE (full) layers 3, 7, ..., 47 = 12; 36 chunked, A = 8192;
    # 2 * 8 * 128 * 2 = 4096
    assert _groups(g) == [("chunked", "chunked", 36, 4096, 8192), ("full", "full", 12, 4096, None)]


def test_qwen2_5_and_mistral(hf_config) -> None:
    # Qwen2.5: use_sliding_window false -> all full; hd 3584 / 28 = 128: 2 * 4 * 128 * 2 = 2048
    assert _groups(geometry_from_hf_config(hf_config("qwen2.5-7b"))) == [("full", "full", 28, 2048, None)]
    # Mistral v0.1: sliding_window 4096 on every layer: 2 * 8 * 128 * 2 = 4096
    assert _groups(geometry_from_hf_config(hf_config("mistral-7b-v0.1"))) == [
        ("sliding", "sliding", 32, 4096, 4096)]


def test_qwen2_sliding_on_layers_from_max_window_layers(hf_config) -> None:
    cfg = hf_config("qwen2.5-7b") | {"use_sliding_window": True, "sliding_window": 4096,
                                     "max_window_layers": 20}
    g = geometry_from_hf_config(cfg)
    assert _groups(g) == [("full", "full", 20, 2048, None), ("sliding", "sliding", 8, 2048, 4096)]


def test_block_size_sets_every_group_and_the_hash_unit(hf_config) -> None:
    g = geometry_from_hf_config(hf_config("qwen3-next-80b-a3b"), block_size=64)
    assert g.tokens_per_hash == 64
    assert {x.tokens_per_block for x in g.groups} == {64}


def test_load_geometry_recognises_a_config_json(config_path) -> None:
    g = load_geometry(config_path("gpt-oss-20b"), dtype="float16", block_size=32)
    assert g.groups[0].dtype == "float16" and g.tokens_per_hash == 32
    assert "model_type 'gpt_oss'" in g.source


def test_generic_reading_is_stated(hf_config) -> None:
    cfg = hf_config("llama-3-8b") | {"model_type": "my_decoder"}
    g = geometry_from_hf_config(cfg)
    assert g.source.startswith("generic reading of model_type 'my_decoder'")
    assert _groups(g) == [("full", "full", 32, 4096, None)]


@pytest.mark.parametrize("extra", [{"sliding_window": 4096}, {"mamba_d_state": 16},
                                   {"kv_lora_rank": 512},
                                   {"layer_types": ["sliding_attention"] * 32}])
def test_unknown_hybrid_model_type_is_refused(hf_config, extra) -> None:
    cfg = hf_config("llama-3-8b") | {"model_type": "mystery"} | extra
    with pytest.raises(UnsupportedModelError) as e:
        geometry_from_hf_config(cfg)
    assert "'mystery'" in str(e.value) and "gemma3" in str(e.value) and "\n" not in str(e.value)


def test_supported_list_is_complete() -> None:
    for mt in ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gemma3_text", "gemma4",
               "gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_5", "falcon_h1", "bamba", "jamba",
               "llama4"):
        assert mt in SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize(
    "name, change, words",
    [
        ("llama-3-8b", {"num_hidden_layers": None}, ["'num_hidden_layers'"]),
        ("llama-3-8b", {"num_key_value_heads": "eight"}, ["'num_key_value_heads'", "'eight'"]),
        ("deepseek-v3", {"kv_lora_rank": 0}, ["'kv_lora_rank'"]),
        ("gpt-oss-20b", {"layer_types": ["full_attention"] * 3}, ["'layer_types'", "24"]),
        ("gpt-oss-20b", {"layer_types": ["banana"] * 24}, ["'banana'"]),
        ("bamba-9b", {"attn_layer_indices": 9}, ["malformed"]),
        ("llama-3-8b", {"model_type": None, "architectures": ["X"]}, ["model_type"]),
        ("gemma-3-270m", {"use_bidirectional_attention": True}, ["bidirectional"]),
    ],
)
def test_bad_configs_are_one_line_errors(hf_config, name, change, words) -> None:
    cfg = hf_config(name) | change
    with pytest.raises(ConfigError) as e:
        geometry_from_hf_config(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize("kwargs, word", [({"dtype": "int3"}, "int3"), ({"block_size": 0}, "block_size"),
                                          ({"block_size": True}, "block_size")])
def test_bad_options(hf_config, kwargs, word) -> None:
    with pytest.raises(ConfigError, match=word):
        geometry_from_hf_config(hf_config("llama-3-8b"), **kwargs)


SHIPPED = ["bamba-9b", "deepseek-v3", "falcon-h1-0.5b", "gemma-2-9b", "gemma-3-270m", "gemma-3-27b",
           "gemma-4-like", "gpt-oss-20b", "jamba-v0.1", "llama-3-8b", "llama-4-scout",
           "mistral-7b-v0.1", "qwen2.5-7b", "qwen3-next-80b-a3b", "qwen3.5-like"]


def test_every_shipped_config_is_tested_here(config_path) -> None:
    shipped = sorted(p.stem for p in config_path("x").parent.glob("*.json"))
    assert shipped == sorted(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_pretrained_config_reads_the_same_geometry(hf_config, name) -> None:
    """A loaded transformers config (what engineer C's integration has) gives the same groups,
    layers and fingerprint as its config.json: to_dict() carries what __post_init__ derived."""
    transformers = pytest.importorskip("transformers")
    from kvtier.core.hf_config import geometry_from_pretrained_config

    data = hf_config(name)
    clean = {k: v for k, v in data.items() if not k.startswith("_kvtier")}
    obj = transformers.AutoConfig.for_model(**clean)
    a, b = geometry_from_pretrained_config(obj), geometry_from_hf_config(data)
    assert _groups(a) == _groups(b)
    assert [x.layers for x in a.groups] == [x.layers for x in b.groups]
    assert a.fingerprint() == b.fingerprint()


def test_class_defaults_apply_only_to_absent_keys(hf_config) -> None:
    mistral = hf_config("mistral-7b-v0.1")
    # Mistral v0.3 writes "sliding_window": null: every layer is full attention
    assert _groups(geometry_from_hf_config(mistral | {"sliding_window": None})) == [
        ("full", "full", 32, 4096, None)]
    # an absent key takes transformers' MistralConfig default, 4096
    del mistral["sliding_window"]
    assert _groups(geometry_from_hf_config(mistral))[0][4] == 4096
    # Qwen3's class default head_dim is 128 whatever hidden_size / heads is (here 64)
    qwen3 = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 1024,
             "num_attention_heads": 16, "num_key_value_heads": 2}
    assert _groups(geometry_from_hf_config(qwen3)) == [("full", "full", 2, 2 * 2 * 128 * 2, None)]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(SHIPPED), data=st.data(), value=_JSON)
def test_any_value_in_any_config_field_is_a_geometry_or_a_config_error(name, data, value) -> None:
    cfg = json.loads(json.dumps(_SHIPPED_DATA[name]))
    target = cfg["text_config"] if "text_config" in cfg and data.draw(st.booleans()) else cfg
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = value
    try:
        geometry_from_hf_config(cfg)
    except ConfigError as exc:
        assert "\n" not in str(exc)


_SHIPPED_DATA = {n: json.loads((DATA / "configs" / f"{n}.json").read_text()) for n in SHIPPED}


@pytest.mark.parametrize("name, key", [("qwen3-next-80b-a3b", "full_attention_interval"),
                                       ("gemma-3-270m", "_sliding_window_pattern")])
@pytest.mark.parametrize("value", [0, -2, "6"])
def test_layer_patterns_must_be_positive_integers(hf_config, name, key, value) -> None:
    cfg = hf_config(name)
    cfg.pop("layer_types", None)
    with pytest.raises(ConfigError, match=key):
        geometry_from_hf_config(cfg | {key: value})


@pytest.mark.parametrize("name, key, value, message", [
    # found by the property test above: a list where gemma 4 wants a head count was a TypeError
    ("gemma-4-like", "num_global_key_value_heads", [], "num_global_key_value_heads=[]; it must be a positive integer"),
    ("gemma-4-like", "per_layer_config", {"x": {}}, "per_layer_config key 'x'; keys must be layer numbers"),
    ("gemma-4-like", "per_layer_config", {"0": {"head_dim": []}}, "per_layer_config[0].head_dim=[]"),
    # a typo of 10**9 layers used to build a 10**9-entry list (out of memory)
    ("llama-3-8b", "num_hidden_layers", 10**9, "kvtier reads models of at most 100000 layers"),
])
def test_field_values_that_crashed_or_hung_the_reader_are_config_errors(name, key, value, message) -> None:
    cfg = json.loads(json.dumps(_SHIPPED_DATA[name]))
    target = cfg["text_config"] if "text_config" in cfg else cfg
    target[key] = value
    if key == "num_global_key_value_heads":
        target["attention_k_eq_v"] = True  # the field is only read then
    with pytest.raises(ConfigError, match=re.escape(message)):
        geometry_from_hf_config(cfg)
