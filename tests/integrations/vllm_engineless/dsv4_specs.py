"""DeepSeek-V4 KV-cache specs as vLLM's own DeepSeek-V4 layer classes build them, on CPU.

    dsv4_specs(kv_format) -> (model_dir, {layer name: KVCacheSpec})

writes a tiny DeepSeek-V4 config.json (no weights, no tokenizer) into a fresh temp dir, builds an
engine config of it, constructs vLLM's DeepSeek-V4 attention layers (one per decoder layer, plus the
MTP drafter's layer) under that config and returns what the model runner's get_kv_cache_spec would
report for them: each AttentionLayerBase module registered in the static forward context, its
get_kv_cache_spec(vllm_config), passed through customize_attention_spec(its backend, spec) as the
runner does (and, on vLLM 0.33, marked is_draft for the MTP layer as the proposer does).

kv_format:
  "fp8_ds_mla"      vLLM-CPU's own layer class DeepseekV4CPUAttention (the class vLLM builds on this
                    machine); cache_dtype "auto" resolves to DeepSeek's fp8_ds_mla (584 B per token
                    in 576 B-aligned pages).
  "bfloat16"/"auto" DeepseekV4FlashInferMLAAttention (vllm/models/deepseek_v4/nvidia/
                    flashinfer_sparse.py, the SM100 FLASHINFER_MLA_SPARSE_DSV4 layer), the only DSv4
                    class with the plain-row layout (use_fp8_ds_mla_layout=False): cache_dtype "auto"
                    with a bfloat16 model gives bf16 rows. vLLM-CPU's class cannot: it always
                    resolves "auto" to fp8_ds_mla and refuses a bf16 cache.
  "fp8"             the same FlashInfer class with --kv-cache-dtype fp8 (per-tensor fp8 rows).
platform="cuda" (keyword) builds "fp8_ds_mla" with the CUDA default class DeepseekV4FlashMLAAttention
instead of the CPU one.

The CUDA classes run their whole shared DeepseekV4Attention.__init__ (which builds every KV-cache
layer and all spec inputs) unchanged; only their CUDA-only tail, compute_fp8_einsum_recipe (a device
capability query for the o_proj GEMM), is answered as on SM100. While layers are built,
torch.cuda.Event/Stream are stand-ins, as vllm/v1/worker/cpu/shm.py installs them for vLLM's CPU
worker (there for good; here only while building).

The config is DeepSeek-V4-Flash's, shrunk: compress ratios [0, 4, 128, 4] (sliding-window-only,
C4 with the lightning indexer, C128, C4) plus one MTP layer (ratio 0), real attention geometry
(head_dim 512, rope 64, indexer head 128, window 128) since the specs and kernels depend on it, tiny
everything else (hidden 64, 8 heads, 4 experts, vocab 1024). It is written in the legacy
`compress_ratios` form, which vLLM 0.32's own DeepseekV4Config reads and transformers'
DeepseekV4Config (used by 0.33) folds into layer_types.

Run (prints each format's specs, vLLM's KV-cache groups and tensors, and its block sizes):

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 .venv/bin/python tests/integrations/vllm_engineless/dsv4_specs.py
    PYTHONPATH=/work/main/.vllm033 VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
        .venv/bin/python tests/integrations/vllm_engineless/dsv4_specs.py

This is a test helper, not kvtier code: it imports vLLM internals that move between releases.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMPRESS_RATIOS = [0, 4, 128, 4]  # per decoder layer; the MTP layer is appended as 0
FORMATS = {"fp8_ds_mla": "auto", "bfloat16": "auto", "auto": "auto", "bf16": "auto", "fp8": "fp8"}


def write_config(directory: str, ratios: list[int] = COMPRESS_RATIOS, mtp: int = 1) -> str:
    """A DeepSeek-V4-Flash-shaped config.json, shrunk (see the module docstring)."""
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
        "vocab_size": 1024, "hidden_size": 64, "moe_intermediate_size": 64,
        "num_hidden_layers": len(ratios), "num_nextn_predict_layers": mtp,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 2,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "num_hash_layers": 1,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": True,
        "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "sliding_window": 128, "compress_ratios": list(ratios) + [0] * mtp,
        "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "index_n_heads": 4, "index_head_dim": 128, "index_topk": 64,
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return directory


def engine_config(model: str, kv_format: str, *, mtp: bool = True, max_model_len: int = 4096, **kw):
    """The engine config vLLM builds for the model dir (MTP drafting on when mtp)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=max_model_len,
                      enforce_eager=True, enable_prefix_caching=True, kv_cache_dtype=FORMATS[kv_format],
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1} if mtp else None,
                      **kw)
    return args.create_engine_config()


def attention_class(kv_format: str, platform: str = "cpu"):
    """vLLM's DeepSeek-V4 attention layer class for the format, and the modules whose
    compute_fp8_einsum_recipe (a CUDA device query) it calls."""
    if kv_format == "fp8_ds_mla" and platform == "cpu":
        from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

        return DeepseekV4CPUAttention, []
    if kv_format == "fp8_ds_mla":
        from vllm.models.deepseek_v4.nvidia import flashmla

        return flashmla.DeepseekV4FlashMLAAttention, [flashmla]
    from vllm.models.deepseek_v4.nvidia import flashinfer_sparse

    return flashinfer_sparse.DeepseekV4FlashInferMLAAttention, [flashinfer_sparse]


def build(kv_format: str = "fp8_ds_mla", *, mtp: bool = True, platform: str = "cpu",
          directory: str | None = None, **engine_kw):
    """(model dir, specs, vllm config, layer modules): see dsv4_specs. `engine_kw` go to
    EngineArgs (the engine-less harness passes its kv_transfer_config). The layers are built and
    asked for their specs by kvtier's own code (kvtier.integrations.vllm.dsv4, which `kvtier plan
    --engine vllm` runs), with the layer class this helper picks for the format."""
    if kv_format not in FORMATS:
        raise ValueError(f"kv_format must be one of {sorted(FORMATS)}, not {kv_format!r}")
    from kvtier.integrations.vllm import dsv4

    model = write_config(directory or tempfile.mkdtemp(prefix="kvtier-dsv4-"), mtp=int(mtp))
    vconf = engine_config(model, kv_format, mtp=mtp, **engine_kw)
    cls, recipe_modules = attention_class(kv_format, platform)
    layers, draft_names = dsv4.build_layers(vconf, mtp=mtp, cls=cls, recipe_modules=recipe_modules)
    specs = dsv4.collect_specs(vconf, draft_names)
    dsv4.resolve_layout(vconf, specs)
    return model, specs, vconf, layers


def dsv4_specs(kv_format: str = "fp8_ds_mla", **kw) -> tuple[str, dict[str, object]]:
    """(temp dir holding the tiny DeepSeek-V4 config.json, {layer name: vLLM KVCacheSpec}) for
    kv_format "fp8_ds_mla" or "bfloat16" ("auto"/"bf16" alike; also "fp8"). Keywords: mtp (default
    True: the MTP drafter's layer too), platform ("cpu", or "cuda" for the FlashMLA class)."""
    model, specs, _vconf, _layers = build(kv_format, **kw)
    return model, specs


# -- printing --------------------------------------------------------------------------------------
SPEC_FIELDS = ("sliding_window", "tokens_per_state", "alignment", "state_content_bytes", "page_size_padded",
               "block_stride_alignment", "cache_role", "model_version", "kv_quant_mode", "is_draft",
               "head_size", "num_kv_heads")


def describe_spec(spec) -> str:
    out = [type(spec).__name__, f"block_size={spec.block_size}", f"page={spec.page_size_bytes}"]
    for attr in ("real_page_size_bytes", "unpadded_page_size_bytes"):
        value = getattr(spec, attr, None)
        if isinstance(value, int) and value != spec.page_size_bytes:
            out.append(f"{attr.replace('_bytes', '')}={value}")
    out.append(f"cache_dtype_str={getattr(spec, 'cache_dtype_str', None)}")
    out.append(f"dtype={str(getattr(spec, 'dtype', None)).replace('torch.', '')}")
    for name in SPEC_FIELDS:
        if hasattr(spec, name):
            value = getattr(spec, name)
            if value is None or value is False:
                continue
            out.append(f"{name}={getattr(value, 'name', value)}")
    return " ".join(out)


def kv_cache_config(vconf, specs: dict, kv_bytes: int = 256 << 20):
    """vLLM's grouping and tensors for the specs, as Harness.__init__ computes them."""
    try:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

        groups = get_global_kv_cache_groups(vconf, [specs])
        kvc = get_kv_cache_configs(vconf, [specs], [kv_bytes], groups)[0]
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        kvc = get_kv_cache_configs(vconf, [specs], [kv_bytes])[0]
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return kvc, resolve_kv_cache_block_sizes(kvc, vconf)


def _short(names: list[str]) -> str:
    return ", ".join(x.replace("model.layers.", "L") for x in names)


def report(kv_format: str, **kw) -> None:
    import vllm

    model, specs, vconf, layers = build(kv_format, **kw)
    print(f"\n=== vLLM {vllm.__version__}  kv_format={kv_format}  layer class={type(layers[0]).__name__}"
          f"  cache_dtype={vconf.cache_config.cache_dtype}  block_size={vconf.cache_config.block_size}"
          f"  layout={vconf.cache_config.kv_cache_layout}"
          f"  model={model}")
    for name, spec in specs.items():
        print(f"  {name:45s} {describe_spec(spec)}")
    kvc, (sched_bs, hash_bs) = kv_cache_config(vconf, specs)
    print(f"  groups (num_blocks={kvc.num_blocks}):")
    for i, g in enumerate(kvc.kv_cache_groups):
        s = g.kv_cache_spec
        extra = " eagle" if getattr(g, "is_eagle_group", False) else ""
        inner = getattr(s, "kv_cache_specs", None) or {n: s for n in g.layer_names}
        kinds = sorted({f"{type(x).__name__}/{x.block_size}/{x.page_size_bytes}" for x in inner.values()})
        print(f"   [{i}] {type(s).__name__} block_size={s.block_size} page={s.page_size_bytes}{extra} "
              f"inner(class/block/page)={kinds}: {_short(g.layer_names)}")
    print("  kv_cache_tensors:")
    for t in kvc.kv_cache_tensors:
        fields = {f: getattr(t, f) for f in ("offset", "size", "block_stride", "layer_stride") if hasattr(t, f)}
        names = list(getattr(t, "layers", None) or getattr(t, "shared_by", None))
        pages = sorted({specs[n].page_size_bytes for n in names})
        bss = sorted({specs[n].block_size for n in names})
        notes = []
        if fields.get("block_stride", 0) > max(pages):
            notes.append("block_stride>page")
        if any(p % b for p in pages for b in bss):
            notes.append("page%block_size!=0")
        print(f"    {fields} page={pages} block_size={bss} {' '.join(notes)} layers=[{_short(names)}]")
    print(f"  resolve_kv_cache_block_sizes -> scheduler_block_size={sched_bs} hash_block_size={hash_bs}")


def compare_platforms(kv_format: str = "fp8_ds_mla") -> bool:
    """Whether the CPU and the CUDA (FlashMLA) layer classes give the same specs."""
    cpu = dsv4_specs(kv_format, platform="cpu")[1]
    cuda = dsv4_specs(kv_format, platform="cuda")[1]
    same = list(cpu) == list(cuda) and all(cpu[n] == cuda[n] and type(cpu[n]) is type(cuda[n]) for n in cpu)
    print(f"\n{kv_format}: DeepseekV4CPUAttention and DeepseekV4FlashMLAAttention specs identical: {same}")
    for n in cpu:
        if n in cuda and cpu[n] != cuda[n]:
            print(f"  {n}: cpu {cpu[n]}\n  {' ' * len(n)}  cuda {cuda[n]}")
    return same


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = sys.argv[1:]
    for fmt in [a for a in args if not a.startswith("--")] or ["fp8_ds_mla", "bfloat16"]:
        report(fmt)
    if "--compare" in args:
        compare_platforms()
