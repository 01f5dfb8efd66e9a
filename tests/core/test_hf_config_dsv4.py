"""DeepSeek V4 config.json → geometry, and the compressed groups it needs (`compress_ratio`).

Hand-derived sizes (head_dim hd = 512, rope 64, index_head_dim 128, window 128):
- sliding window (every layer, K = V shared, one head): hd * d bytes per token; fp8_ds_mla packs
  a row as 448 fp8 + 64 bf16 + 7 scale bytes + 1 pad = 584;
- compressed entries (CSA ratio 4, HCA ratio 128): one row per `ratio` tokens;
- indexer keys (CSA only): 128 fp8 + a 4-byte scale = 132 bytes per entry, whatever the dtype;
- compressor states, float32: CSA 2 series x (K/V + gate) x hd x 4 = 8192 B/token over 2 x 4
  tokens, HCA 1 x 2 x hd x 4 = 4096 B/token over 128; the indexer's 2 x 2 x 128 x 4 = 2048 over 8.
The same numbers are checked against vLLM's own DeepSeek V4 specs in
tests/integrations/test_vllm_plan_dsv4.py.
"""

from __future__ import annotations

import json

import pytest

from kvtier.core.geometry import Geometry, Group
from kvtier.core.hf_config import geometry_from_hf_config
from kvtier.core.plan import make_plan
from kvtier.errors import ConfigError, UnsupportedModelError

TINY = {  # the engine-less harness's tiny DeepSeek V4 (tests/integrations/vllm_engineless/dsv4_specs.py)
    "model_type": "deepseek_v4", "torch_dtype": "bfloat16", "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1, "head_dim": 512, "qk_rope_head_dim": 64, "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4, 0], "index_head_dim": 128,
}


def _rows(g: Geometry) -> list[tuple]:
    return [(x.name, x.kind, x.layers, x.bytes_per_token_per_layer, x.compress_ratio, x.window, x.dtype,
             x.tokens_per_block, x.cacheable) for x in g.groups]


def test_tiny_deepseek_v4_bfloat16() -> None:
    g = geometry_from_hf_config(TINY)
    assert _rows(g) == [
        ("sliding", "sliding", (0, 1, 2, 3), 1024, 1, 128, "bfloat16", 16, True),
        ("compressed_4", "mla", (1, 3), 1024, 4, None, "bfloat16", 16, True),
        ("indexer", "mla", (1, 3), 132, 4, None, "uint8", 16, True),
        ("compressor_4", "sliding", (1, 3), 8192, 1, 8, "float32", 16, True),
        ("indexer_compressor", "sliding", (1, 3), 2048, 1, 8, "float32", 16, True),
        # a block holds whole entries: lcm(16, 128) tokens
        ("compressed_128", "mla", (2,), 1024, 128, None, "bfloat16", 128, True),
        ("compressor_128", "sliding", (2,), 4096, 1, 128, "float32", 16, True),
        ("mtp_sliding", "sliding", (4,), 1024, 1, 128, "bfloat16", 16, False),
    ]
    assert "drafts" in g.groups[-1].reason


def test_fp8_ds_mla_rows_are_584_bytes() -> None:
    g = geometry_from_hf_config(TINY, dtype="fp8_ds_mla")
    by = {x.name: x for x in g.groups}
    for name in ("sliding", "compressed_4", "compressed_128", "mtp_sliding"):
        assert (by[name].bytes_per_token_per_layer, by[name].dtype) == (584, "uint8"), name
    assert by["indexer"].bytes_per_token_per_layer == 132
    assert by["compressor_4"].dtype == "float32"
    assert geometry_from_hf_config(TINY).fingerprint() != g.fingerprint()


def test_chunk_bytes_count_whole_entries() -> None:
    plan = make_plan(geometry_from_hf_config(TINY, dtype="fp8_ds_mla"), chunk_tokens=256)
    by = {gp.name: gp for gp in plan.groups}
    assert by["compressed_4"].chunk_bytes == 2 * (256 // 4) * 584  # 2 layers, 64 entries each
    assert by["compressed_128"].chunk_bytes == 1 * 2 * 584  # 2 entries
    assert by["indexer"].chunk_bytes == 2 * 64 * 132
    assert by["sliding"].chunk_bytes == 4 * 256 * 584


def test_layer_types_form_equals_legacy_ratios() -> None:
    modern = {k: v for k, v in TINY.items() if k != "compress_ratios"}
    modern["layer_types"] = ["sliding_attention", "compressed_sparse_attention",
                             "heavily_compressed_attention", "compressed_sparse_attention"]
    assert _rows(geometry_from_hf_config(modern)) == _rows(geometry_from_hf_config(TINY))
    # compress_rates moves the ratios, as transformers' DeepseekV4Config reads them
    modern["compress_rates"] = {"compressed_sparse_attention": 8, "heavily_compressed_attention": 64}
    names = [x.name for x in geometry_from_hf_config(modern).groups]
    assert "compressed_8" in names and "compressed_64" in names


def test_default_layer_schedule_is_transformers() -> None:
    """No layer_types or compress_ratios: 2 HCA layers, then CSA and HCA in turn (V4-Pro)."""
    cfg = {k: v for k, v in TINY.items() if k != "compress_ratios"} | {"num_hidden_layers": 6}
    by = {x.name: x.layers for x in geometry_from_hf_config(cfg).groups}
    assert by["compressed_128"] == (0, 1, 2, 4) and by["compressed_4"] == (3, 5)


@pytest.mark.parametrize("field, value, match", [
    ("compress_ratios", [0, 4, 7, 4], "compress_ratios=.*0, 4, 128"),
    ("compress_ratios", [0, 4], "compress_ratios=.*each of the 4 layers"),
    ("layer_types", ["sliding_attention"] * 3 + ["linear_attention"], "layer type 'linear_attention'"),
    ("num_nextn_predict_layers", -1, "num_nextn_predict_layers=-1"),
    ("compress_rates", {"compressed_sparse_attention": 0}, "compress_rates.*positive"),
])
def test_bad_fields_name_the_value(field: str, value: object, match: str) -> None:
    cfg = dict(TINY)
    if field == "layer_types":
        cfg.pop("compress_ratios")
    cfg[field] = value
    with pytest.raises((ConfigError, UnsupportedModelError), match=match):
        geometry_from_hf_config(cfg)


def test_fp8_ds_mla_is_refused_for_other_models() -> None:
    llama = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    with pytest.raises(ConfigError, match="'fp8_ds_mla' is a packed KV format of deepseek_v4 only"):
        geometry_from_hf_config(llama, dtype="fp8_ds_mla")


# -- Group.compress_ratio ------------------------------------------------------------------------

def test_compress_ratio_rules() -> None:
    with pytest.raises(ConfigError, match="compress_ratio=4 but kind 'sliding'"):
        Group("a", "sliding", 1, 16, 64, window=8, compress_ratio=4)
    with pytest.raises(ConfigError, match="tokens_per_block=16, not a multiple of its compress_ratio=128; .* use 128"):
        Group("a", "mla", 1, 16, 64, compress_ratio=128)
    with pytest.raises(ConfigError, match="field 'compress_ratio' is 0"):
        Group("a", "mla", 1, 16, 64, compress_ratio=0)
    g = Group("a", "mla", 2, 256, 584, compress_ratio=128)
    assert g.bytes_for_tokens(256) == 2 * 2 * 584
    with pytest.raises(ConfigError, match="not a whole number of entries"):
        g.bytes_for_tokens(64)
    with pytest.raises(ConfigError, match="bytes_for_tokens"):
        g.bytes_per_token  # noqa: B018 - a compressed group has no whole bytes per token


def test_compress_ratio_round_trips_and_leaves_old_fingerprints_alone() -> None:
    plain = Geometry(groups=(Group("a", "mla", 2, 256, 584),), tokens_per_hash=64)
    assert "compress_ratio" not in json.dumps(plain.to_dict())  # fingerprints of older geometries hold
    assert plain.fingerprint() == Geometry.from_dict(plain.to_dict()).fingerprint()
    packed = Geometry(groups=(Group("a", "mla", 2, 256, 584, compress_ratio=4),), tokens_per_hash=64)
    again = Geometry.from_dict(json.loads(json.dumps(packed.to_dict())))
    assert again.groups[0].compress_ratio == 4 and again.fingerprint() == packed.fingerprint()
    assert packed.fingerprint() != plain.fingerprint()


def test_a_layer_in_two_caches_is_still_refused_without_compressed_groups() -> None:
    with pytest.raises(ConfigError, match="layer 1 is in group 'a' and in group 'b'"):
        Geometry(groups=(Group("a", "full", 1, 16, 64, layers=(1,)),
                         Group("b", "sliding", 1, 16, 64, window=8, layers=(1,))), tokens_per_hash=16)


def test_transformers_integration_refuses_deepseek_v4() -> None:
    """transformers' own V4 cache keeps compressor buffers and entry counts beside its KV: kvtier
    refuses the model there (a tiny random-weight DeepseekV4ForCausalLM), pointing at vLLM."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from kvtier.integrations.transformers import PrefixCache

    cfg = DeepseekV4Config(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, head_dim=64, q_lora_rank=32, o_lora_rank=16, o_groups=2,
                           n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=32,
                           index_topk=8, sliding_window=16, compress_ratios=[4, 128])
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModelError, match="deepseek_v4.*compressor buffers.*vLLM"):
        PrefixCache.for_model(model, cpu_bytes=1 << 20)


def test_kvtier_plan_sends_deepseek_v4_to_vllms_grouping(tmp_path, capsys) -> None:
    """`kvtier plan DIR` (no engine) on DeepSeek V4 prints the per-cache reading but no vLLM
    config: vLLM groups these caches its own way (`--engine vllm` prints the one to use)."""
    from kvtier.cli import main

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert main(["plan", str(tmp_path), "--dtype", "fp8_ds_mla", "--hit-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "compressed_128" in out and "indexer_compressor" in out
    assert "--engine vllm" in out and '"kv_connector"' not in out
