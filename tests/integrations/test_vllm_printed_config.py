"""Every vLLM config `kvtier plan` prints starts kvtier's spec: the printed
`kv_connector_extra_config` is handed to `KvtierOffloadingSpec` with vLLM's offloading config for
the same groups, and vLLM's own KV-cache specs of those groups (as KvtierConnector hands them
over). DeepSeek-V4-like groups have 256/64/8/4 tokens per block."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.commands.plan import vllm_extra_config
from kvtier.core.geometry import dtype_bytes
from kvtier.core.load import load_geometry
from kvtier.core.plan import make_plan

pytest.importorskip("vllm")


def _spec(geometry, tmp_path: Path, extra: dict, engine_id: str):
    """kvtier's spec of an engine with these groups, built as KvtierConnector has vLLM build it:
    vLLM's KV-cache specs handed over through compat for the spec's construction."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    from kvtier.integrations.vllm.compat import kv_cache_config_for_spec
    from kvtier.integrations.vllm.spec import KvtierOffloadingSpec

    torch_dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}
    groups, kv_groups, layer = [], [], 0
    for gid, g in enumerate(gr for gr in geometry.groups if gr.cacheable):
        esize = dtype_bytes(g.dtype)
        common = dict(block_size=g.tokens_per_block, dtype=torch_dtype[esize])
        if g.is_state:  # a GDN/Mamba layer in vLLM's align mode: one state page per block
            spec = MambaSpec(block_size=g.tokens_per_block, shapes=((g.state_bytes_per_layer,),),
                             dtypes=(torch.uint8,), mamba_cache_mode="align")
        elif g.kind == "mla":
            spec = MLAAttentionSpec(num_kv_heads=1, head_size=g.bytes_per_token_per_layer // esize, **common)
        else:
            common.update(num_kv_heads=1, head_size=g.bytes_per_token_per_layer // (2 * esize))
            spec = (SlidingWindowSpec(sliding_window=g.window, **common) if g.kind == "sliding"
                    else FullAttentionSpec(**common))
        names = tuple(f"model.layers.{layer + i}.attn" for i in range(g.num_layers))
        layer += g.num_layers
        groups.append(OffloadingGroupConfig(g.tokens_per_block, names, gid))
        kv_groups.append(SimpleNamespace(kv_cache_spec=spec, layer_names=list(names)))
    unit = min(g.tokens_per_block for g in geometry.groups if g.cacheable)
    config = OffloadingConfig(
        groups=tuple(groups), worker_kv_bytes_per_block=1024, enable_kv_cache_events=False,
        extra_config=dict(extra, **{"kvtier.directory": str(tmp_path)}), engine_id=engine_id,
        model=OffloadingModelConfig(name=str(tmp_path), dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=unit, blocks_per_chunk=int(extra.get("blocks_per_chunk", 1))),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))
    with kv_cache_config_for_spec(engine_id, SimpleNamespace(kv_cache_groups=kv_groups)):
        return KvtierOffloadingSpec(config)


@pytest.mark.parametrize("name", ["deepseek-v4-like", "gpt-oss-120b-fp8kv", "gemma-3-270m", "llama-4-scout",
                                  "qwen3-next-80b-a3b", "falcon-h1-0.5b"])
def test_the_printed_config_starts_the_spec(name: str, geometry_path, config_path, tmp_path: Path) -> None:
    """Attention and state (GDN, Mamba-2) geometries."""
    path = geometry_path(name)
    geometry = load_geometry(path) if path.exists() else load_geometry(config_path(name), block_size=16)
    plan = make_plan(geometry)
    extra = vllm_extra_config(plan)
    spec = _spec(geometry, tmp_path, extra, f"printed-{name}")
    ctx = spec.ctx
    assert ctx.plan.geometry.source.startswith("vLLM KV-cache specs")
    cacheable = [g for g in geometry.groups if g.cacheable]
    # each group's chunk is blocks_per_chunk of its own blocks, and its slots are sized for it
    for gp, g, span in zip(ctx.plan.groups, cacheable, ctx.span_tokens):
        assert span == g.tokens_per_block * ctx.blocks_per_chunk
        if g.is_state:  # blocks_per_chunk state pages
            assert gp.chunk_bytes == g.state_bytes * ctx.blocks_per_chunk and gp.group.kind == "state"
        else:
            assert gp.chunk_bytes == span * g.bytes_per_token_per_layer * g.num_layers
    assert not ctx.off_reason


def test_mixed_blocks_print_no_token_chunk_size(geometry_path) -> None:
    extra = vllm_extra_config(make_plan(load_geometry(geometry_path("deepseek-v4-like"))))
    assert "kvtier.chunk_tokens" not in extra and extra["blocks_per_chunk"] == 1


def test_mixed_spans_share_tiers_by_tokens_and_have_no_dead_rule(geometry_path, tmp_path: Path) -> None:
    """Groups whose chunks span 256/64/8/4 tokens: each group's slots cover about the same tokens
    (equal slot counts gave a 4-token group 1/64 of a 256-token group's tokens), and no chunk is
    treated as dead for lack of a chunk with the same hash in the anchor groups."""
    geometry = load_geometry(geometry_path("deepseek-v4-like"))
    extra = vllm_extra_config(make_plan(geometry))
    ctx = _spec(geometry, tmp_path, extra, "mixed-share").ctx
    index = ctx.new_index()
    assert index.anchors == ()
    tokens = [index.slots(gp.index, "cpu") * span for gp, span in zip(ctx.plan.groups, ctx.span_tokens)]
    assert min(tokens) > 0.9 * max(tokens), tokens
