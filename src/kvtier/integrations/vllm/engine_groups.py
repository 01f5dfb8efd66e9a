"""kvtier geometries for the KV-cache groups vLLM builds.

vLLM groups layers its own way: Gemma 3 270M (15 sliding + 3 full layers) becomes six groups of
three layers (five sliding, one full) because vLLM's hybrid allocator gives every group the same
page size. kvtier must index exactly those groups (a vLLM offload key carries vLLM's group
index), so the geometry used inside vLLM has one kvtier group per vLLM group, in vLLM's order,
with the kind, window and bytes of its layers taken from kvtier's reading of config.json.

- `geometry_for_groups`: used by the spec at engine start, from the groups vLLM hands it.
- `geometry_from_vllm`: used by `kvtier plan --engine vllm`; it asks vLLM's own grouping code
  (`get_kv_cache_groups`) which groups it would build, without loading weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError, UnsupportedModelError
from kvtier.core.geometry import DTYPE_BYTES, Geometry, Group, dtype_bytes
from kvtier.core.hf_config import geometry_from_hf_config

# kvtier's connector, as `kvtier plan` prints it (without kvtier's keys: grouping does not read them)
KVTIER_TRANSFER = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector",
                   "kv_role": "kv_both"}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """One KV-cache group as vLLM describes it: its index, tokens per block and layer names."""

    group_id: int
    tokens_per_block: int
    layer_names: tuple[str, ...]


_FLAT_RE = re.compile(r"^model\.(\d+)\.")
# parts of a vLLM layer name that mark a state layer (Mamba mixers, GDN linear attention, convs)
_STATE_PARTS = ("mixer", "mamba", "linear_attn", "conv", "ssm")


def layer_index(name: str, num_layers: int | None = None) -> int:
    """The model layer index in a vLLM layer name (`model.layers.7.self_attn.attn`). vLLM names
    Falcon-H1's SSM branch of layer i `model.{num_layers + i}.mixer` (every attention and SSM
    layer needs its own index there); that is layer i too."""
    m = _LAYER_RE.search(name)
    if m is not None:
        return int(m.group(1))
    m = _FLAT_RE.search(name)
    if m is not None and num_layers:
        i = int(m.group(1))
        return i - num_layers if i >= num_layers else i
    raise UnsupportedModelError(
        f"vLLM layer {name!r} has no 'layers.N.' in its name; kvtier cannot tell which model "
        "layer it is"
    )


def is_state_layer(name: str) -> bool:
    """Whether a vLLM layer name is a state layer's (by name: the offloading config vLLM hands a
    spec does not say)."""
    return any(part in name for part in _STATE_PARTS)


def read_hf_config(model: str) -> dict[str, object]:
    """config.json of a local model directory (or of a model in the local Hugging Face cache)."""
    path = Path(model)
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ConfigError(f"model directory {model!r} has no config.json")
        return json.loads(cfg.read_text())
    try:  # a hub id already in the local cache (HF_HUB_OFFLINE=1 keeps this off the network)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model).to_dict()
    except Exception as exc:  # noqa: BLE001 - any failure means: no config we can read
        raise ConfigError(f"cannot read the config of model {model!r}: {exc}") from None


def geometry_for_groups(
    model: str, dtype: str, groups: Sequence[EngineGroup], tokens_per_hash: int
) -> Geometry:
    """One kvtier group per vLLM group (same order), described from the model's config.json."""
    cfg = read_hf_config(model)
    hf = geometry_from_hf_config(cfg, dtype=dtype,
                                 block_size=groups[0].tokens_per_block if groups else None)
    # a layer may be in one attention group and one state group (Falcon-H1 runs both branches
    # in every layer): look a vLLM layer up by its index and by whether its name is a state's
    by_layer: dict[tuple[int, bool], Group] = {}
    for g in hf.groups:
        for i in g.layers:
            by_layer[(i, g.is_state)] = g
    num_layers = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else None

    def member(name: str) -> Group | None:
        i, state = layer_index(name, num_layers), is_state_layer(name)
        found = by_layer.get((i, state))
        if found is None and (i, not state) in by_layer and (i, state) not in by_layer:
            found = by_layer[(i, not state)]  # the layer has one kind only: the name cannot mislead
        return found

    out: list[Group] = []
    for eg in groups:
        members = [member(n) for n in eg.layer_names]
        if any(m is None for m in members):
            raise UnsupportedModelError(
                f"vLLM group {eg.group_id} has layers {list(eg.layer_names)} that kvtier's reading "
                f"of {model!r} does not know; kvtier refuses rather than guess their KV layout"
            )
        specs = {(m.kind, m.bytes_per_token_per_layer, m.state_bytes_per_layer, m.window,
                  m.attention_chunk) for m in members if m is not None}
        if len(specs) != 1:
            raise UnsupportedModelError(
                f"vLLM group {eg.group_id} mixes layers kvtier reads as different kinds {sorted(map(str, specs))}"
            )
        first = members[0]
        assert first is not None
        out.append(Group(
            name=f"vllm{eg.group_id}_{first.kind}",
            kind=first.kind,
            num_layers=len(eg.layer_names),
            tokens_per_block=eg.tokens_per_block,
            bytes_per_token_per_layer=first.bytes_per_token_per_layer,
            state_bytes_per_layer=first.state_bytes_per_layer,
            window=first.window,
            attention_chunk=first.attention_chunk,
            dtype=dtype,
            layers=tuple(layer_index(n, num_layers) for n in eg.layer_names),
        ))
    return Geometry(groups=tuple(out), tokens_per_hash=tokens_per_hash, name=hf.name,
                    source=f"vLLM KV-cache groups of {model}, dtype {dtype}")


# vLLM spec classes kvtier reads as plain attention; anything else (Mamba state, sparse or
# circular caches, cross attention, custom specs) makes the spec fall back to config.json.
_ATTENTION_SPECS = {"FullAttentionSpec": "full", "MLAAttentionSpec": "mla", "SlidingWindowSpec": "sliding",
                    "SlidingWindowMLASpec": "sliding", "ChunkedLocalAttentionSpec": "chunked"}


def kv_format(spec: object) -> str:
    """The format vLLM stores a spec's KV in: its cache dtype string (`fp8_ds_mla`, ...) or the
    torch dtype's name. Part of the namespace, so two formats never share a key."""
    per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: its layers'
    if isinstance(per_layer, dict) and per_layer:
        return ",".join(sorted({kv_format(s) for s in per_layer.values()}))
    fmt = getattr(spec, "cache_dtype_str", None)
    return str(fmt) if fmt else str(getattr(spec, "dtype", "?")).removeprefix("torch.")


def state_cache_modes(specs: Sequence[object]) -> set[str]:
    """vLLM's `mamba_cache_mode` of every state (Mamba/GDN) spec among `specs`. Only "align"
    keeps a state per block boundary; in the other modes a state block holds wherever the request
    was last, so a stored one would restore the wrong state."""
    return {str(getattr(s, "mamba_cache_mode", "none")) for s in specs if type(s).__name__ == "MambaSpec"}


def _state_page_bytes(spec: object) -> int:
    """A state spec's page without vLLM's padding (what the worker's canonical refs move)."""
    from dataclasses import replace

    return int(replace(spec, page_size_padded=None).page_size_bytes)  # type: ignore[type-var]


def _attention_kind(spec: object) -> tuple[str, int | None]:
    kind = _ATTENTION_SPECS[type(spec).__name__]
    window = getattr(spec, "sliding_window", None)
    chunk = getattr(spec, "attention_chunk_size", None)
    if kind == "sliding" or (kind in ("full", "mla") and window):
        return "sliding", int(window)
    if kind == "chunked" or (kind in ("full", "mla") and chunk):
        return "chunked", int(chunk)
    return kind, None


def _page_bytes(spec: object) -> int:
    """The bytes of one block of one layer that vLLM's offloading moves: the page without vLLM's
    padding (a state page without its padding to the attention page)."""
    if type(spec).__name__ == "MambaSpec":
        return _state_page_bytes(spec)
    return int(spec.unpadded_page_size_bytes)  # type: ignore[attr-defined]


def engine_page_bytes(groups: Sequence[EngineGroup], specs: Sequence[object]) -> tuple[int, ...]:
    """Each vLLM group's bytes per block, all its layers (a chunk is `blocks_per_chunk` of them)."""
    out = []
    for eg, spec in zip(groups, specs, strict=True):
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        layer_specs = [per_layer[n] for n in eg.layer_names] if isinstance(per_layer, dict) else [spec] * len(eg.layer_names)
        out.append(sum(_page_bytes(s) for s in layer_specs))
    return tuple(out)


def geometry_from_engine_specs(
    model: str, groups: Sequence[EngineGroup], specs: Sequence[object], tokens_per_hash: int,
    layer_of: dict[str, int] | None = None,
) -> Geometry | None:
    """One kvtier group per vLLM group, described from vLLM's own KV-cache spec of that group
    (kind, window, tokens per block, bytes), so no reading of config.json can disagree with what
    the engine allocates. Layers are named by vLLM's layer names (their order in `layer_of`), not
    by a parsed layer index. None when a group is not plain attention (kvtier then reads
    config.json, which knows state groups); a spec kvtier cannot describe exactly raises."""
    names = layer_of or {}
    out: list[Group] = []
    for eg, spec in zip(groups, specs, strict=True):
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        layer_specs = [per_layer[n] for n in eg.layer_names] if isinstance(per_layer, dict) else [spec] * len(eg.layer_names)
        kinds = {type(s).__name__ for s in layer_specs}
        if kinds == {"MambaSpec"}:  # a Mamba/GDN state group: one state page per block
            pages = {_state_page_bytes(s) for s in layer_specs}
            if len(pages) != 1:
                raise UnsupportedModelError(
                    f"vLLM group {eg.group_id} holds state layers of different sizes {sorted(pages)}; "
                    "kvtier describes a group by one page size")
            out.append(Group(
                name=f"vllm{eg.group_id}_state", kind="state", num_layers=len(eg.layer_names),
                tokens_per_block=int(layer_specs[0].block_size), state_bytes_per_layer=pages.pop(),
                dtype="uint8", layers=tuple(names.get(n, i) for i, n in enumerate(eg.layer_names))))
            continue
        if not kinds <= set(_ATTENTION_SPECS):
            return None
        # a group's kind: sliding if its layers look back a window, chunked if a local chunk
        kinds_of = {_attention_kind(s) for s in layer_specs}
        kind = ("sliding" if any(k[0] == "sliding" for k in kinds_of)
                else "chunked" if any(k[0] == "chunked" for k in kinds_of)
                else "mla" if any(k[0] == "mla" for k in kinds_of) else "full")
        window = max((k[1] for k in kinds_of if k[0] == "sliding"), default=None)
        chunk = max((k[1] for k in kinds_of if k[0] == "chunked"), default=None)
        tpbs = {int(s.block_size) for s in layer_specs}
        if tpbs != {eg.tokens_per_block}:
            raise UnsupportedModelError(
                f"vLLM group {eg.group_id}: layers of {sorted(tpbs)} tokens per block (offloading says "
                f"{eg.tokens_per_block}); kvtier refuses a group whose blocks it cannot size")
        tpb = eg.tokens_per_block
        n = len(eg.layer_names)
        # Exact where every layer has the same page of whole bytes per token. Otherwise (DeepSeek
        # V4: compressed entries, indexer keys and padded fp8_ds_mla pages in one group) the group
        # is described by its kind and rounded-up bytes per token, and its exact bytes per block
        # (engine_page_bytes) size its chunks and enter the namespace.
        total = sum(_page_bytes(s) for s in layer_specs)
        fmts = {kv_format(s) for s in layer_specs}
        fmt = fmts.pop() if len(fmts) == 1 else "uint8"
        out.append(Group(
            name=f"vllm{eg.group_id}_{kind}",
            kind=kind,
            num_layers=n,
            tokens_per_block=tpb,
            bytes_per_token_per_layer=-(-total // (tpb * n)),
            window=int(window) if kind == "sliding" else None,
            attention_chunk=int(chunk) if kind == "chunked" else None,
            dtype=fmt if fmt in DTYPE_BYTES else "uint8",
            layers=tuple(names.get(n, i) for i, n in enumerate(eg.layer_names)),
        ))
    return Geometry(groups=tuple(out), tokens_per_hash=tokens_per_hash, name=str(model),
                    source=f"vLLM KV-cache specs of {model}")


def geometry_from_vllm(path: str, dtype: str | None = None, block_size: int | None = None) -> Geometry:
    """The geometry vLLM would build for the model at `path` (its groups, in its order).

    Builds vLLM's engine config (no weights are loaded), gives vLLM's grouping code one spec per
    layer (attention as kvtier reads config.json; Mamba/GDN state as vLLM's own model class
    shapes it, in align mode) and converts the groups it returns.
    """
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    hf_cfg = read_hf_config(str(path))
    if hf_cfg.get("model_type") == "deepseek_v4":
        return _geometry_from_vllm_dsv4(str(path), dtype, block_size)
    stateful = any(g.is_state for g in geometry_from_hf_config(hf_cfg, dtype=dtype or "bfloat16").groups)
    # state models offload only with prefix caching in align mode (spec.py turns it off otherwise)
    extra_args = {"enable_prefix_caching": True, "mamba_cache_mode": "align"} if stateful else {}
    args = EngineArgs(model=str(path), dtype=dtype or "auto", block_size=block_size,
                      max_model_len=2048, enforce_eager=True, skip_tokenizer_init=True, **extra_args)
    vconf = args.create_engine_config()
    if vconf.cache_config.kv_cache_layout is None:
        # the engine core resolves this from its attention backends; "LBHNC" is what the
        # OffloadingConnector requires, and grouping depends only on whether it is packed
        vconf.cache_config.kv_cache_layout = "LBHNC"
    kv_dtype = str(vconf.model_config.dtype).removeprefix("torch.")
    if vconf.cache_config.cache_dtype not in (None, "auto"):
        kv_dtype = str(vconf.cache_config.cache_dtype)
    block = vconf.cache_config.block_size or 16
    hf = geometry_from_hf_config(hf_cfg, dtype=kv_dtype, block_size=block)
    tdtype = getattr(torch, kv_dtype)
    esize = dtype_bytes(kv_dtype)
    specs: dict[str, object] = {}
    for g in hf.groups:
        if g.is_state:
            state = _vllm_state_spec(vconf, block)
            for i in g.layers:
                specs[f"model.layers.{i}.linear_attn"] = state
            continue
        if g.kind not in ("full", "sliding", "chunked"):
            raise UnsupportedModelError(
                f"kvtier plan --engine vllm reads attention and state models only; group {g.name!r} is "
                f"{g.kind!r} (use --engine hf to see kvtier's own grouping)"
            )
        # vLLM groups by page size: one head of the layer's bytes per token gives the same page.
        head_size = g.bytes_per_token_per_layer // (2 * esize)
        for i in g.layers:
            common = dict(block_size=block, num_kv_heads=1, head_size=head_size, dtype=tdtype)
            if g.kind == "sliding":
                spec = SlidingWindowSpec(sliding_window=g.window, **common)
            elif g.kind == "chunked":
                spec = ChunkedLocalAttentionSpec(attention_chunk_size=g.attention_chunk, **common)
            else:
                spec = FullAttentionSpec(**common)
            specs[f"model.layers.{i}.self_attn.attn"] = spec
    groups = _vllm_groups(vconf, specs)
    engine_groups = [
        EngineGroup(gid, int(gs.kv_cache_spec.block_size), tuple(gs.layer_names))
        for gid, gs in enumerate(groups)
    ]
    unit = _hash_unit(vconf, groups)
    geometry = geometry_from_engine_specs(str(path), engine_groups, [gs.kv_cache_spec for gs in groups],
                                          tokens_per_hash=unit, layer_of={n: layer_index(n) for n in specs})
    if geometry is None:
        geometry = geometry_for_groups(str(path), kv_dtype, engine_groups, tokens_per_hash=unit)
    return Geometry(groups=geometry.groups, tokens_per_hash=unit, name=hf.name,
                    source=f"vLLM {_vllm_version()} KV-cache groups of {path}, dtype {kv_dtype}, "
                           f"block_size {block}, hash unit {unit}")


def _hash_unit(vconf: object, groups: list) -> int:
    """vLLM's hash block size for these groups (the gcd of their block sizes when they differ,
    with prefix caching or a connector on), as the engine resolves it."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return int(resolve_kv_cache_block_sizes(SimpleNamespace(kv_cache_groups=groups), vconf)[1])


def _vllm_groups(vconf: object, specs: dict[str, object]) -> list:
    """vLLM's KV-cache groups of the layer specs (compat: 0.33 plans them globally, 0.32 per worker)."""
    from .compat import kv_cache_groups

    return kv_cache_groups(vconf, specs)


def _geometry_from_vllm_dsv4(path: str, dtype: str | None, block_size: int | None) -> Geometry:
    """DeepSeek V4: its layer specs from vLLM's own attention classes (dsv4.py), grouped by vLLM.
    `dtype` "fp8_ds_mla"/"fp8"/"bfloat16" picks the KV format (default: what the platform's class
    resolves "auto" to: fp8_ds_mla)."""
    from vllm.engine.arg_utils import EngineArgs

    from kvtier.integrations.vllm import dsv4

    kv_dtype = {None: "auto", "fp8_ds_mla": "auto", "bfloat16": "auto", "bf16": "auto"}.get(dtype, dtype)
    # with kvtier's connector configured, as the engine will run (vLLM then hashes at the gcd of
    # the groups' block sizes; without a connector, prefix caching is off for DeepSeek V4)
    args = EngineArgs(model=path, skip_tokenizer_init=True, max_model_len=4096, enforce_eager=True,
                      enable_prefix_caching=True, kv_cache_dtype=kv_dtype, block_size=block_size,
                      kv_transfer_config=KVTIER_TRANSFER)
    vconf = args.create_engine_config()
    specs = dsv4.layer_specs(vconf)
    groups = _vllm_groups(vconf, specs)
    unit = _hash_unit(vconf, groups)
    engine_groups = [EngineGroup(gid, int(gs.kv_cache_spec.block_size), tuple(gs.layer_names))
                     for gid, gs in enumerate(groups)]
    # a vLLM layer name per cache, numbered in group order as the spec numbers them at engine start
    order = {n: i for i, n in enumerate(dict.fromkeys(n for g in engine_groups for n in g.layer_names))}
    geometry = geometry_from_engine_specs(path, engine_groups, [gs.kv_cache_spec for gs in groups],
                                          tokens_per_hash=unit, layer_of=order)
    assert geometry is not None  # every DeepSeek V4 spec is an attention spec
    fmt = ",".join(sorted({kv_format(s) for s in specs.values()}))
    return Geometry(groups=geometry.groups, tokens_per_hash=unit, name=path,
                    source=f"vLLM {_vllm_version()} KV-cache groups of {path} (its DeepSeek V4 layer "
                           f"classes), KV formats {fmt}, block_size {vconf.cache_config.block_size}, "
                           f"hash unit {unit}")


def _vllm_state_spec(vconf: object, block: int) -> object:
    """The MambaSpec vLLM's own model class gives a state layer (shapes and dtypes), align mode."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    mc = vconf.model_config  # type: ignore[attr-defined]
    cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    try:
        shapes = cls.get_mamba_state_shape_from_config(vconf)
        dtypes = cls.get_mamba_state_dtype_from_config(vconf)
    except AttributeError:
        raise UnsupportedModelError(
            f"vLLM's {cls.__name__} does not describe its state shapes; kvtier plan --engine vllm "
            "cannot show its groups (use --engine hf)") from None
    return MambaSpec(block_size=block, shapes=tuple(shapes), dtypes=tuple(dtypes), mamba_cache_mode="align")


def _vllm_version() -> str:
    from .compat import VLLM_VERSION_STR

    return VLLM_VERSION_STR
