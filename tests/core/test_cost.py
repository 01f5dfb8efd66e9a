"""kvtier.core.cost: prefill FLOPs per geometry, against hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.cost import ComputeModel, Term, causal_pairs, compute_from_geometry, compute_from_hf_config
from kvtier.core.geometry import Geometry, Group
from kvtier.core.hf_config import geometry_from_hf_config

CONFIGS = Path(__file__).resolve().parents[2] / "src" / "kvtier" / "data" / "configs"


def test_causal_pairs_by_hand():
    assert causal_pairs(0) == 0
    assert causal_pairs(4) == 1 + 2 + 3 + 4
    # window 3: queries see 1, 2, 3, 3, 3 keys
    assert causal_pairs(5, window=3) == 1 + 2 + 3 + 3 + 3
    assert causal_pairs(2, window=3) == 1 + 2
    # chunk 2: 1, 2 | 1, 2 | 1
    assert causal_pairs(5, attention_chunk=2) == 1 + 2 + 1 + 2 + 1


def tiny_config(**extra):
    """A 2-layer Llama-like config small enough to count by hand."""
    return {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
            "intermediate_size": 16, **extra}


def test_tiny_llama_by_hand():
    cfg = tiny_config()
    m = compute_from_hf_config(cfg, geometry_from_hf_config(cfg))
    # per layer: q 8*8 + k,v 2*8*4 + o 8*8 = 192 params; MLP 3*8*16 = 384 -> 2*576 = 1152 FLOPs/token
    # pairs: 4 x 2 heads x 4 = 32 FLOPs per pair; T=3: 6 pairs
    per_layer = 1152 * 3 + 32 * 6
    assert m.flops(3) == 2 * per_layer
    assert m.linear_flops_per_token == 2 * 1152
    assert m.by_group(3) == {"full": 2 * per_layer}


def test_sliding_is_capped_at_the_window():
    cfg = tiny_config(model_type="mistral", sliding_window=4)
    m = compute_from_hf_config(cfg, geometry_from_hf_config(cfg))
    # each extra token beyond W costs the same: linear + W pairs
    steps = [m.flops(t + 1) - m.flops(t) for t in range(4, 12)]
    assert len(set(steps)) == 1 and steps[0] == 2 * (1152 + 32 * 4)
    full = compute_from_hf_config(tiny_config(), geometry_from_hf_config(tiny_config()))
    assert m.flops(100) < full.flops(100)
    assert m.flops(4) == full.flops(4)


def test_a_state_group_is_linear():
    cfg = {"model_type": "qwen3_next", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "full_attention_interval": 2,
           "linear_num_key_heads": 1, "linear_key_head_dim": 2, "linear_num_value_heads": 2,
           "linear_value_head_dim": 2, "linear_conv_kernel_dim": 2}
    m = compute_from_hf_config(cfg, geometry_from_hf_config(cfg))
    state = [t for t in m.terms if t.kind == "state"]
    assert len(state) == 1 and state[0].pair_flops == 0
    # GatedDeltaNet: qkvz 8*(2*2 + 2*4) + ba 8*4 + conv (4+4)*2 + out 4*8 = 96+32+16+32 = 176 params;
    # recurrent state 2*2*2 = 8 elements x 3 multiply-adds
    assert state[0].linear_flops_per_token == 2 * 176 + 2 * 3 * 8
    assert state[0].flops(10) == 10 * state[0].flops(1)
    # attention layer: q_proj doubled by the output gate: 8*16 + 2*8*4 + 8*8 = 256
    full = [t for t in m.terms if t.kind == "full"]
    assert full[0].linear_flops_per_token == 2 * 256 and full[0].pair_flops == 32


def test_moe_counts_active_experts_only():
    dense = tiny_config()
    moe = tiny_config(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    d = compute_from_hf_config(dense, geometry_from_hf_config(dense))
    m = compute_from_hf_config(moe, geometry_from_hf_config(moe))
    # 2 experts of 384 + router 8*8 instead of one MLP of 384, per layer
    assert m.linear_flops_per_token - d.linear_flops_per_token == 2 * 2 * (384 + 64)


@given(st.integers(0, 5000), st.integers(1, 2000))
def test_monotonic_in_hit_tokens(t, dt):
    cfg = json.loads((CONFIGS / "gemma-3-27b.json").read_text())
    m = compute_from_hf_config(cfg, geometry_from_hf_config(cfg))
    assert m.flops(t + dt) > m.flops(t)


def test_shipped_hybrids_read():
    for name, groups in (("qwen3-next-80b-a3b", {"linear_attention", "full"}),
                         ("jamba-v0.1", {"mamba", "full"}), ("gemma-3-27b", {"sliding", "full"})):
        cfg = json.loads((CONFIGS / f"{name}.json").read_text())
        m = compute_from_hf_config(cfg, geometry_from_hf_config(cfg))
        assert m is not None and set(m.by_group(512)) == groups
    cfg = json.loads((CONFIGS / "qwen3-next-80b-a3b.json").read_text())
    m = compute_from_hf_config(cfg, geometry_from_hf_config(cfg))
    assert 3.0e9 < m.linear_flops_per_token / 2 < 3.5e9  # "A3B": ~3B active, embeddings aside


def test_geometry_estimate():
    g = Geometry((Group("full", "full", 2, 16, bytes_per_token_per_layer=16),  # 2*kv*d = 8 elements
                  Group("swa", "sliding", 1, 16, bytes_per_token_per_layer=16, window=2),
                  Group("ssm", "state", 1, 16, state_bytes_per_layer=64)), 16)
    m = compute_from_geometry(g, active_params=100)
    # 200 FLOPs/token; full: 2 layers x 16 FLOPs a pair; swa 1 layer x 16, pairs capped at 2
    assert m.flops(3) == 200 * 3 + 2 * 16 * 6 + 16 * (1 + 2 + 2)
    assert isinstance(m, ComputeModel) and isinstance(m.terms[0], Term)
