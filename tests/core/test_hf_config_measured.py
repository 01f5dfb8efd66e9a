"""The config readers against what transformers really caches.

For each family a tiny random model (a few layers, small dims) is built from a config object,
run once over a short prompt with a cache, and the bytes each cache layer holds are measured:
per token for attention layers, in total for conv + recurrent states. The geometry that
`geometry_from_pretrained_config` reads from the same config must give exactly those bytes,
for exactly those layer indices. This is what catches a wrong dtype (transformers keeps
recurrent / SSM states in float32) or a field read from the wrong place.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtier.core.hf_config import geometry_from_pretrained_config  # noqa: E402

PROMPT_TOKENS = 12  # shorter than every window below, so sliding layers keep every token

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             vocab_size=128)


def _configs() -> dict[str, object]:
    t = transformers
    return {
        "llama": t.LlamaConfig(num_hidden_layers=2, **SMALL),
        "qwen2-sliding": t.Qwen2Config(num_hidden_layers=4, use_sliding_window=True,
                                       sliding_window=32, max_window_layers=2, **SMALL),
        "mistral": t.MistralConfig(num_hidden_layers=2, sliding_window=32, **SMALL),
        "gemma2": t.Gemma2Config(num_hidden_layers=4, head_dim=16, sliding_window=32, **SMALL),
        "gemma3": t.Gemma3TextConfig(num_hidden_layers=7, head_dim=16, sliding_window=32, **SMALL),
        "gemma4": t.Gemma4TextConfig(
            num_hidden_layers=8, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=32, num_kv_shared_layers=2,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
            **SMALL),
        "gpt_oss": t.GptOssConfig(num_hidden_layers=4, head_dim=16, sliding_window=32,
                                  num_local_experts=2, num_experts_per_tok=1, **SMALL),
        "deepseek_v3": t.DeepseekV3Config(
            num_hidden_layers=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, q_lora_rank=None, n_routed_experts=2, num_experts_per_tok=1,
            n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32,
            **{**SMALL, "num_key_value_heads": 4}),
        "qwen3_next": t.Qwen3NextConfig(
            num_hidden_layers=4, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
            num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, **SMALL),
        "qwen3_5": t.Qwen3_5TextConfig(
            num_hidden_layers=4, head_dim=16, linear_conv_kernel_dim=3, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, **SMALL),
        "bamba": t.BambaConfig(num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=8,
                               mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                               mamba_n_groups=1, **SMALL),
        "falcon_h1": t.FalconH1Config(num_hidden_layers=2, head_dim=16, mamba_n_heads=8,
                                      mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                      mamba_d_ssm=96, mamba_d_head=12, mamba_n_groups=2, **SMALL),
        "jamba": t.JambaConfig(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                               expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                               mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, **SMALL),
        "llama4": t.Llama4TextConfig(num_hidden_layers=4, head_dim=16, attention_chunk_size=32,
                                     num_local_experts=2, intermediate_size_mlp=64, **SMALL),
    }


def _measure(layer: object) -> tuple[int, int]:
    """(attention bytes per token, state bytes) held by one transformers cache layer."""
    per_token = state = 0
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if isinstance(keys, torch.Tensor) and keys.numel():
        seq = keys.shape[-2]
        assert seq == PROMPT_TOKENS
        per_token = (keys.numel() * keys.element_size() + values.numel() * values.element_size()) // seq
    for attr in ("conv_states", "recurrent_states"):
        for t in (getattr(layer, attr, None) or {}).values():
            if isinstance(t, torch.Tensor):
                state += t.numel() * t.element_size()
    return per_token, state


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(_configs()))
def test_geometry_matches_the_bytes_transformers_caches(family: str) -> None:
    torch.manual_seed(0)
    config = _configs()[family]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (1, PROMPT_TOKENS))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    measured = {i: _measure(layer) for i, layer in enumerate(cache.layers)}

    geometry = geometry_from_pretrained_config(model.config)
    expected: dict[int, list[int]] = {}
    for g in geometry.groups:
        assert g.dtype == "bfloat16"  # read from the config object's torch dtype
        for layer in g.layers:
            slot = expected.setdefault(layer, [0, 0])
            if g.is_state:
                slot[1] = g.state_bytes_per_layer
            else:
                slot[0] = g.bytes_per_token_per_layer
    held = {i: m for i, m in measured.items() if m != (0, 0)}
    assert held == {i: tuple(v) for i, v in expected.items()}
