"""Prefix caching for Hugging Face transformers causal LMs: restore what the store holds,
compute only the rest, save the new chunks.

    from kvtier.integrations.transformers import PrefixCache
    pc = PrefixCache.for_model(model, cpu_bytes=2 << 30, disk_dir=os.path.expanduser("~/.cache/kvtier/kv"), disk_bytes=8 << 30)
    out = pc.generate(input_ids, max_new_tokens=64)      # out.sequences, out.stats
    logits, stats = pc.forward(input_ids)                # a plain prefill of the whole prompt

How a prompt of P tokens runs:
1. chunk hashes of the prompt (kvtier.core.keys, namespace = model id + geometry fingerprint + dtype);
   `store.lookup` gives the largest hit T (a multiple of chunk_tokens, <= P-1) every group can
   restore under the planner's rules; `store.load` reads the payloads (and shrinks T if one is
   bad: a corrupt chunk is never restored).
2. a fresh `DynamicCache(config=...)` is filled layer by layer (full layers: T tokens; sliding
   layers: the last W-1; state layers: the checkpoint taken at exactly T).
3. tokens [T, P-1) (`generate`) or [T, P) (`forward`) are computed with explicit position ids,
   split at chunk boundaries when the model has state groups so a checkpoint is taken at each.
   `generate` then hands the cache to `model.generate`, which computes the last prompt token and
   decodes as usual (greedy, sampling, streamers: all of transformers').
4. after the first token, the new chunks (those the plan says some hit reads) are saved.

Refused with UnsupportedModelError, never served: Mamba-1 families (their selective scan cannot
continue a multi-token suffix from a cached state in transformers), chunked-local attention
(Llama 4), MLA and DeepSeek V4 (compressor buffers beside its KV), whose cache layouts this
integration does not restore yet. Batch size > 1 and
padding are refused with ConfigError (run one sequence per call). A store made for another model,
geometry or dtype is a namespace miss: nothing is restored from it and nothing saved to it.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError, UnsupportedModelError
from kvtier.core.hf_config import geometry_from_pretrained_config
from kvtier.integrations.hf import cache_fill, layout as lay

log = logging.getLogger("kvtier.transformers")
from kvtier.core.keys import Namespace, chunk_hashes
from kvtier.core.plan import Plan, make_plan
from kvtier.store.store import Store
from kvtier.integrations.weights import module_digest, with_weights

# transformers model types whose Mamba-1 mixers restart the scan from zero on a multi-token
# forward: a restored state would be silently ignored, so they are refused.
MAMBA1_MODEL_TYPES = ("mamba", "falcon_mamba", "jamba")
_RESTORABLE_KINDS = ("full", "sliding", "state")


@dataclass(frozen=True, slots=True)
class PrefillStats:
    prompt_tokens: int
    restored_tokens: int  # T: prefix tokens that came from the store
    computed_tokens: int  # tokens this call ran through the model (prefill only)
    lookup_tokens: int  # the hit lookup promised (restored_tokens is smaller if a payload was bad)
    restored_tokens_by_tier: dict[str, int]  # prefix tokens per tier they came from
    restored_bytes: int
    restore_seconds: float  # lookup + load + filling the cache
    compute_seconds: float  # the prefill forward passes
    namespace_miss: bool  # the store belongs to another model/geometry/dtype


@dataclass(slots=True)
class Prefill:
    """A filled cache after prefilling `[0, end)`, and the new chunks waiting to be saved."""

    cache: object
    logits: torch.Tensor | None
    stats: PrefillStats
    _save: Callable[[Store | None], int] | None = None
    _capture: cache_fill.Capture | None = None  # generate keeps capturing while it decodes

    def save(self, store: Store | None = None, *, keep: bool = False) -> int:
        """Store the new chunks (in the PrefixCache's store, or `store` of the same namespace);
        returns payloads written. The captured K/V are released unless `keep`."""
        if self._save is None:
            return 0
        fn = self._save
        if not keep:
            self._save = None
        return fn(store)


@dataclass(frozen=True, slots=True)
class GenerateResult:
    sequences: torch.Tensor
    stats: PrefillStats
    saved_payloads: int  # chunk payloads written after decoding, summed over the tiers


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_id_of(model: torch.nn.Module) -> str:
    cfg = model.config  # type: ignore[attr-defined]
    return str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "") or type(model).__name__)


def check_supported(model: torch.nn.Module) -> None:
    cfg = model.config  # type: ignore[attr-defined]
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    mt = str(getattr(text, "model_type", ""))
    if getattr(cfg, "vision_config", None) is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is a multimodal model; kvtier's transformers integration is "
            "tested on text-only causal LMs (load the text model, e.g. AutoModelForCausalLM)"
        )
    if mt == "deepseek_v4":
        raise UnsupportedModelError(
            "model_type 'deepseek_v4': transformers' DeepSeek V4 cache keeps compressor buffers, "
            "overlap states and entry counts beside its KV, which kvtier does not restore; serve it "
            "with vLLM and kvtier's connector (docs/vllm.md)"
        )
    if mt in MAMBA1_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {mt!r} uses Mamba-1 layers: transformers cannot continue a multi-token "
            "suffix from their cached state, so a restored prefix would be ignored; kvtier refuses it"
        )


def model_plan(model: torch.nn.Module, *, chunk_tokens: int | None = None, block_size: int = 16,
               model_id: str | None = None) -> tuple[Plan, Namespace]:
    """The chunk plan and namespace of a loaded model (geometry read from its config)."""
    check_supported(model)
    dtype = dtype_name(model.dtype)  # type: ignore[attr-defined]
    geometry = geometry_from_pretrained_config(model.config, dtype=dtype, block_size=block_size)  # type: ignore[attr-defined]
    for g in geometry.cacheable_groups:
        if g.kind not in _RESTORABLE_KINDS:
            raise UnsupportedModelError(
                f"group {g.name!r} is {g.kind!r} attention; the transformers integration restores "
                f"only {', '.join(_RESTORABLE_KINDS)} groups"
            )
    plan = make_plan(geometry, chunk_tokens=chunk_tokens)
    # the weights' digest too: new weights under an old name must not restore the old KV
    model_field = with_weights(model_id or model_id_of(model), module_digest(model))
    ns = Namespace(model=model_field, geometry_fingerprint=geometry.fingerprint(), dtype=dtype)
    return plan, ns


class PrefixCache:
    """A model and a store: prefill and generate that restore the longest stored prefix."""

    def __init__(self, model: torch.nn.Module, store: Store, *, model_id: str | None = None,
                 block_size: int = 16) -> None:
        self.model = model
        self.store = store
        # the model's own identity, never the store's: two models of one geometry must not share
        plan, ns = model_plan(model, chunk_tokens=store.plan.chunk_tokens, block_size=block_size,
                              model_id=model_id)
        # A store of another model/geometry/dtype is a namespace miss, never a restore.
        self.namespace_ok = store.namespace == ns and store.plan == plan
        self.plan, self.namespace = plan, ns
        self.layouts = lay.probe_layouts(model, plan, self.new_cache)
        params = inspect.signature(model.forward).parameters
        self._cache_position = "cache_position" in params  # transformers < 5 wants it
        self._cache_kw = cache_fill.cache_kwarg(model)  # `cache` from 5.24, `past_key_values` before
        self.namespace_misses = 0
        self.unsafe_saves_refused = 0  # captures that did not match the tokens (never stored)

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, model_id: str | None = None, chunk_tokens: int | None = None,
                  block_size: int = 16, **store_kwargs: object) -> PrefixCache:
        """Build the store for `model` too (Store keyword arguments: cpu_bytes, disk_dir, ...)."""
        plan, ns = model_plan(model, chunk_tokens=chunk_tokens, block_size=block_size, model_id=model_id)
        return cls(model, Store(plan, ns, **store_kwargs), model_id=ns.model, block_size=block_size)  # type: ignore[arg-type]

    def new_cache(self) -> object:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)  # type: ignore[attr-defined]

    # -- public calls ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                all_logits: bool = True, save: bool = True) -> tuple[torch.Tensor, PrefillStats]:
        """Prefill the whole prompt; logits of the computed tokens [T, P) (or the last one)."""
        p = input_ids.shape[-1]
        pf = self.prefill(input_ids, attention_mask, end=p, logits="all" if all_logits else "last")
        if save:
            pf.save()
        assert pf.logits is not None
        return pf.logits, pf.stats

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 save: bool = True, **generate_kwargs: object) -> GenerateResult:
        """`model.generate` over a cache that restores the stored prefix; saves after decoding."""
        p = input_ids.shape[-1]
        if p < 1:
            raise ConfigError("input_ids is empty; give at least one prompt token")
        for name in ("past_key_values", "cache"):
            if name in generate_kwargs:
                raise ConfigError(f"do not pass {name}: PrefixCache.generate builds the cache itself")
        pf = self.prefill(input_ids, attention_mask, end=p - 1, logits="none")
        # Attention-only models keep capturing K/V while decoding, so the answer's chunks are
        # stored too and the next turn of a chat (prompt + answer + question) restores past
        # the answer. Models with state groups do not: without a checkpoint at those chunk
        # boundaries no hit could use the attention chunks, and bytes no hit reads are not stored.
        gc = generate_kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        one_sequence = all(int(generate_kwargs.get(k, getattr(gc, k, 1)) or 1) == 1  # type: ignore[call-overload]
                           for k in ("num_beams", "num_return_sequences"))
        # Assisted / prompt-lookup decoding feeds draft tokens and then crops the rejected ones
        # out of the cache; the capture would still hold their K/V, shifted into the positions of
        # the accepted tokens. Store only the prompt's chunks then (the length check in _save is
        # the second guard).
        assisted = any(generate_kwargs.get(k) is not None or getattr(gc, k, None) is not None
                       for k in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"))
        extend = save and one_sequence and not assisted and self.namespace_ok and pf._capture is not None and not any(
            isinstance(x, lay.StateLayout) for x in self.layouts.values())
        with torch.inference_mode():
            if extend:
                with pf._capture:  # type: ignore[union-attr]
                    out = self.model.generate(  # type: ignore[attr-defined]
                        input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                        **{self._cache_kw: pf.cache}, **generate_kwargs)
            else:
                out = self.model.generate(  # type: ignore[attr-defined]
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                    **{self._cache_kw: pf.cache}, **generate_kwargs)
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        saved = 0
        if extend:
            # K/V exist for every token but the last generated one (it was never fed back)
            done = seqs.shape[-1] - 1
            tokens = seqs[0, :done].tolist()
            restored = pf.stats.restored_tokens
            if done // self.plan.chunk_tokens > restored // self.plan.chunk_tokens:
                saved = self._save(None, chunk_hashes(self.plan, self.namespace, tokens),
                                   pf._capture, {}, restored, done)  # type: ignore[arg-type]
            pf._save = None
        elif save:
            saved = pf.save()
        return GenerateResult(sequences=seqs, stats=pf.stats, saved_payloads=saved)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                end: int | None = None, logits: str = "last") -> Prefill:
        """Restore the stored prefix and compute tokens [T, end); `logits`: all, last or none."""
        ids = self._check_input(input_ids, attention_mask)
        p = ids.shape[-1]
        end = p if end is None else end
        if not 0 <= end <= p:
            raise ConfigError(f"end={end} must be within the prompt (0..{p})")
        if logits not in ("all", "last", "none"):
            raise ConfigError(f"logits={logits!r}; use 'all', 'last' or 'none'")
        tokens = ids[0].tolist()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hashes = chunk_hashes(self.plan, self.namespace, tokens) if self.namespace_ok else []
            cache = self.new_cache()
            restored, lookup_tokens, by_tier, nbytes = self._restore(cache, hashes, p, end)
            t1 = time.perf_counter()
            out_logits, capture, snaps = self._compute(cache, ids, restored, end, logits)
            t2 = time.perf_counter()
        if not self.namespace_ok:
            self.namespace_misses += 1
        stats = PrefillStats(
            prompt_tokens=p, restored_tokens=restored, computed_tokens=end - restored,
            lookup_tokens=lookup_tokens, restored_tokens_by_tier=by_tier, restored_bytes=nbytes,
            restore_seconds=t1 - t0, compute_seconds=t2 - t1, namespace_miss=not self.namespace_ok)
        save = None
        if self.namespace_ok and end // self.plan.chunk_tokens > restored // self.plan.chunk_tokens:
            save = lambda store=None: self._save(store, hashes, capture, snaps, restored, end)  # noqa: E731
        return Prefill(cache=cache, logits=out_logits, stats=stats, _save=save, _capture=capture)

    # -- internals --------------------------------------------------------------------------------
    def _check_input(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2):
            raise ConfigError("input_ids must be a 1-D or [1, P] tensor of token ids")
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        if ids.shape[0] != 1:
            raise ConfigError(
                f"batch size {ids.shape[0]}: kvtier's transformers integration runs one sequence per "
                "call (each has its own prefix hit); call it once per sequence"
            )
        if attention_mask is not None and not bool((attention_mask != 0).all()):
            raise ConfigError(
                "attention_mask has padding: kvtier's transformers integration does not support "
                "padded (e.g. left-padded) prompts; pass the unpadded tokens of one sequence"
            )
        return ids.to(self.model.device)  # type: ignore[attr-defined]

    def _restore(self, cache: object, hashes: list[bytes], p: int, end: int
                 ) -> tuple[int, int, dict[str, int], int]:
        if not hashes:
            return 0, 0, {}, 0
        # a hit never goes past `end` (the caller computes from T): asking as if the prompt ended
        # at end+1 keeps T <= end, so every chunk the hit needs is one the store loads below
        hit = self.store.lookup(hashes, min(p, end + 1))
        if hit.tokens == 0:
            return 0, 0, {}, 0
        c = self.plan.chunk_tokens
        # one contiguous block per group for the chunks the hit names: loads land in place
        blocks: dict[int, tuple[torch.Tensor, dict[int, int]]] = {}
        for g, loads in enumerate(hit.chunks):
            if loads:
                size = self.plan.groups[g].chunk_bytes
                blocks[g] = (torch.empty(len(loads) * size, dtype=torch.uint8),
                             {ld.chunk_index: k for k, ld in enumerate(loads)})
        extra: dict[tuple[int, int], torch.Tensor] = {}

        def buffer(g: int, i: int) -> torch.Tensor | None:
            if not self.plan.groups[g].cacheable:
                return None
            size = self.plan.groups[g].chunk_bytes
            if g in blocks and i in blocks[g][1]:
                k = blocks[g][1][i]
                return blocks[g][0][k * size:(k + 1) * size]
            # a smaller hit after a bad payload may need chunks the lookup did not name
            return extra.setdefault((g, i), torch.empty(size, dtype=torch.uint8))

        # `load` returns a T whose every needed chunk it read (smaller than the hit if one was bad)
        t = self.store.load(hit, buffer)
        assert t <= end and t % c == 0, (t, end)
        if t == 0:
            return 0, hit.tokens, {}, 0
        nbytes = 0
        dev = self.model.device  # type: ignore[attr-defined]
        for g, layout in self.layouts.items():
            chunks = list(self.plan.chunks_for_hit(g, t))
            payloads = [buffer(g, i) for i in chunks]
            nbytes += sum(int(x.numel()) for x in payloads if x is not None)
            if isinstance(layout, lay.StateLayout):
                for li, (conv, rec) in zip(layout.layers, lay.unpack_state(layout, payloads[-1], dev)):
                    cache_fill.set_state(cache.layers[li], conv, rec)  # type: ignore[attr-defined]
                continue
            keys, values = lay.unpack_attention(layout, payloads, c)  # type: ignore[arg-type]
            first = chunks[0] * c
            for li, k, v in zip(layout.layers, keys, values):
                layer = cache.layers[li]  # type: ignore[attr-defined]
                assert layer.is_sliding or first == 0, "a full layer restores from token 0"
                cache_fill.set_attention(layer, k.to(dev), v.to(dev), t)
        return t, hit.tokens, self._by_tier(hit, t), nbytes

    def _by_tier(self, hit: object, t: int) -> dict[str, int]:
        """Prefix tokens per tier, counted on the group that restores the most chunks."""
        c = self.plan.chunk_tokens
        loads = max(hit.chunks, key=len)  # type: ignore[attr-defined]
        out: dict[str, int] = {}
        for ld in loads:
            if ld.chunk_index * c < t:
                out[ld.tier] = out.get(ld.tier, 0) + c
        return out

    def _compute(self, cache: object, ids: torch.Tensor, start: int, end: int, logits: str
                 ) -> tuple[torch.Tensor | None, cache_fill.Capture, dict[int, list]]:
        c = self.plan.chunk_tokens
        state_layouts = [x for x in self.layouts.values() if isinstance(x, lay.StateLayout)]
        attn_layers = sorted({li for x in self.layouts.values() if isinstance(x, lay.AttentionLayout)
                              for li in x.layers})
        # pieces: one forward, or one per chunk boundary when a state checkpoint is needed there
        cuts = [start]
        if state_layouts and self.namespace_ok:
            cuts += [b for b in range((start // c + 1) * c, end, c)]
        cuts.append(end)
        snaps: dict[int, list] = {}
        outs: list[torch.Tensor] = []
        capture = cache_fill.Capture(cache, attn_layers if self.namespace_ok else [])
        with capture:
            for a, b in zip(cuts, cuts[1:]):
                if b <= a:
                    continue
                last = b == end
                keep = 0 if logits == "all" else 1
                kwargs: dict[str, object] = {self._cache_kw: cache}
                if self._cache_position:
                    kwargs["cache_position"] = torch.arange(a, b, device=ids.device)
                out = self.model(  # type: ignore[operator]
                    input_ids=ids[:, a:b], position_ids=torch.arange(a, b, device=ids.device)[None],
                    use_cache=True, logits_to_keep=keep, **kwargs)
                if logits == "all" or (logits == "last" and last):
                    outs.append(out.logits)
                if b % c == 0 and state_layouts and self.namespace_ok:
                    snaps[b // c - 1] = [[cache_fill.snapshot_state(cache.layers[li]) for li in sl.layers]  # type: ignore[attr-defined]
                                         for sl in state_layouts]
        if not outs:
            return None, capture, snaps
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), capture, snaps

    def _save(self, store: Store | None, hashes: list[bytes], capture: cache_fill.Capture,
              snaps: dict[int, list], start: int, end: int) -> int:
        store = self.store if store is None else store
        if store.namespace != self.namespace or store.plan != self.plan:
            self.namespace_misses += 1  # never write one model's KV into another's store
            return 0
        c = self.plan.chunk_tokens
        new_chunks = list(range(start // c, end // c))
        payloads: dict[tuple[int, int], torch.Tensor] = {}
        state_order = [g for g, x in self.layouts.items() if isinstance(x, lay.StateLayout)]
        for g, layout in self.layouts.items():
            if isinstance(layout, lay.StateLayout):
                k = state_order.index(g)
                for i in new_chunks:
                    if i in snaps:
                        payloads[(g, i)] = lay.pack_state(layout, snaps[i][k]).cpu()
                continue
            wanted = [i for i in new_chunks if i in set(self.plan.store_chunks(g, end))]
            if not wanted:
                continue
            # consecutive runs of wanted chunks (store_chunks may skip some for chunked groups)
            keys, values = zip(*(capture.joined(li) for li in layout.layers))
            # The capture must hold exactly one sequence's K/V for tokens [start, end): anything
            # else (a cropped draft, a beam) would put K/V under the wrong positions' hashes.
            if any(k.shape[0] != 1 or k.shape[-2] != end - start for k in (*keys, *values)):
                self.unsafe_saves_refused += 1
                log.warning("kvtier: not storing: captured K/V do not match tokens [%d, %d)", start, end)
                return 0
            for i, blob in lay.pack_attention(layout, list(keys), list(values), start, wanted, c).items():
                payloads[(g, i)] = blob.cpu()
        return store.save(hashes, payloads, end)
