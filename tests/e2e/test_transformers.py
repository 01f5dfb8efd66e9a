"""The transformers integration on tiny random-weight models of every supported family.

For a prompt of 90 tokens and a stored prefix of T=64 (chunks of 16 tokens):
- the logits of a run that restores the prefix equal, bit for bit, those of plain transformers
  computing the same split (prefix forward, then the suffix; state models split at the chunk
  boundaries where kvtier takes its checkpoints);
- they match one full forward pass within float32 tolerance;
- greedy `generate` gives the same tokens as plain `model.generate`.
Through the cpu tier, the disk tier and both.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError, UnsupportedModelError
from kvtier.integrations.transformers import PrefixCache, model_plan
from kvtier.store.store import Store

# the supported families (issue 4: Llama, Gemma 3, gpt-oss, Qwen3-Next and Qwen3.5, a Mamba-2
# hybrid (Bamba); Falcon-H1 runs attention and Mamba-2 side by side in every layer)
FAMILIES = ("llama", "gemma3", "gpt_oss", "qwen3_next", "qwen3_5", "bamba", "falcon_h1")
STATE_FAMILIES = ("qwen3_5", "qwen3_next", "bamba", "falcon_h1")
pytestmark = pytest.mark.usefixtures("torch_one_thread")

C = 16  # chunk tokens
T = 64  # the stored prefix


def _store_kwargs(tiers: str, tmp_path) -> dict[str, object]:  # type: ignore[no-untyped-def]
    kw: dict[str, object] = {}
    if "cpu" in tiers:
        kw["cpu_bytes"] = 8 << 20
    if "disk" in tiers:
        kw.update(disk_dir=str(tmp_path / "kv"), disk_bytes=8 << 20)
    return kw


def _cuts(family: str, start: int, end: int) -> list[int]:
    """Where kvtier splits a prefill of [start, end): at chunk boundaries for state models."""
    if family not in STATE_FAMILIES:
        return [start, end]
    return [start, *range((start // C + 1) * C, end, C), end]


def plain_split_logits(model, ids: torch.Tensor, cuts_prefix: list[int], cuts_suffix: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Plain transformers, no kvtier: the prefix pieces, then the suffix pieces' logits."""
    from transformers import DynamicCache

    from kvtier.integrations.hf.cache_fill import cache_kwarg

    cache = DynamicCache(config=model.config)
    kw = cache_kwarg(model)  # `cache` from transformers 5.24, `past_key_values` before
    outs = []
    with torch.inference_mode():
        for cuts, keep in ((cuts_prefix, None), (cuts_suffix, 0)):
            for a, b in zip(cuts, cuts[1:]):
                out = model(input_ids=ids[:, a:b], position_ids=torch.arange(a, b)[None],
                            use_cache=True, logits_to_keep=1 if keep is None else 0, **{kw: cache})
                if keep is not None:
                    outs.append(out.logits)
    return torch.cat(outs, dim=1)


def full_pass_logits(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        return model(input_ids=ids).logits


def plain_greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("tiers", ["cpu", "disk"])
@pytest.mark.parametrize("family", FAMILIES)
def test_restored_prefix_is_bit_exact(family: str, tiers: str, load_tiny, prompt, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = load_tiny(family)
    pc = PrefixCache.for_model(model, chunk_tokens=C, **_store_kwargs(tiers, tmp_path))
    p = prompt.shape[1]

    # turn 1: a prompt of T+1 tokens; kvtier prefills [0, T) and stores chunks 0..T/C-1
    first = pc.generate(prompt[:, :T + 1], max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert first.stats.restored_tokens == 0
    assert first.stats.computed_tokens == T
    assert first.saved_payloads > 0

    # turn 2: the 90-token prompt restores T and computes the rest
    logits, stats = pc.forward(prompt)
    assert stats.restored_tokens == T
    assert stats.computed_tokens == p - T
    assert stats.restored_tokens_by_tier == {tiers: T}
    ref = plain_split_logits(model, prompt, _cuts(family, 0, T), _cuts(family, T, p))
    assert torch.equal(logits, ref), f"max diff {(logits - ref).abs().max().item()}"
    full = full_pass_logits(model, prompt)[:, T:]
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)

    # turn 3: restores more (turn 2 stored up to 80; for state models, the checkpoint its
    # forward took at exactly 80 while computing up to 90): bit-exact against plain transformers
    # stopped at exactly 80 (greedy tokens alone missed a checkpoint taken at 90 for 3 families)
    r = (p - 1) // C * C
    logits, stats = pc.forward(prompt)
    assert stats.restored_tokens == r
    ref = plain_split_logits(model, prompt, _cuts(family, 0, r), _cuts(family, r, p))
    if family in STATE_FAMILIES:
        # turn 2 computed [T, r) and [r, p) as separate pieces: the same pieces as `ref`
        assert torch.equal(logits, ref), f"max diff {(logits - ref).abs().max().item()}"
    else:  # turn 2 computed [T, p) in one piece, so [T, r)'s K/V carry that matmul's rounding
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    # and greedy generate answers the same as plain transformers
    out = pc.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.stats.restored_tokens == (p - 1) // C * C
    assert torch.equal(out.sequences, plain_greedy(model, prompt, 6))


@pytest.mark.parametrize("family", ["gemma3", "bamba"])
def test_cpu_and_disk_tiers_together(family: str, load_tiny, prompt, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = load_tiny(family)
    kw = _store_kwargs("cpu+disk", tmp_path)
    plan, ns = model_plan(model, chunk_tokens=C)
    with Store(plan, ns, **kw) as store:  # type: ignore[arg-type]
        PrefixCache(model, store).generate(prompt[:, :T + 1], max_new_tokens=1, pad_token_id=0)
    # a new store over the same directory: cpu is empty, the prefix comes from disk
    with Store(plan, ns, **kw) as store:  # type: ignore[arg-type]
        pc = PrefixCache(model, store)
        logits, stats = pc.forward(prompt, save=False)
        assert stats.restored_tokens_by_tier == {"disk": T}
        _, again = pc.forward(prompt, save=False)  # promoted to cpu by the first load
        assert again.restored_tokens_by_tier == {"cpu": T}
    ref = plain_split_logits(model, prompt, _cuts(family, 0, T), _cuts(family, T, prompt.shape[1]))
    assert torch.equal(logits, ref)


def _corrupt(store: Store, pc: PrefixCache, prompt: torch.Tensor, group: int, chunk: int) -> None:
    from kvtier.store.tiers.disk_files import DATA_OFFSET, slab_name, slot_stride

    h = store.hashes(prompt[0].tolist())[chunk]
    [(tier, slot)] = store.index.where(h, group)  # type: ignore[union-attr]
    assert tier == "disk"
    size = pc.plan.groups[group].chunk_bytes
    path = store.slot_tiers["disk"].dir / slab_name(group, size)  # type: ignore[attr-defined]
    with open(path, "r+b") as f:
        f.seek(slot * slot_stride(size) + DATA_OFFSET + size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_chunk_on_disk_stops_the_hit_before_it(load_tiny, prompt, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = load_tiny("gemma3")
    plan, ns = model_plan(model, chunk_tokens=C)
    # every chunk stored: a hit at 2 * C needs the sliding chunks before it, which the default
    # placement keeps only where hits land (test_store_placement.py)
    kw = dict(disk_dir=str(tmp_path / "kv"), disk_bytes=8 << 20, placement="every")
    with Store(plan, ns, **kw) as store:  # type: ignore[arg-type]
        pc = PrefixCache(model, store)
        pc.generate(prompt[:, :T + 1], max_new_tokens=1, pad_token_id=0)
        full_group = next(gp.index for gp in plan.groups if gp.kind == "full")
        _corrupt(store, pc, prompt, full_group, 2)
        logits, stats = pc.forward(prompt, save=False)
        assert stats.lookup_tokens == T
        assert stats.restored_tokens == 2 * C  # the full group stops before chunk 2
        assert store.metrics()["corrupt_dropped"] >= 1
        torch.testing.assert_close(logits, full_pass_logits(model, prompt)[:, 2 * C:], atol=1e-4, rtol=1e-4)
        out = pc.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, save=False)
        assert torch.equal(out.sequences, plain_greedy(model, prompt, 6))


def test_store_of_another_model_is_a_namespace_miss(load_tiny, prompt) -> None:  # type: ignore[no-untyped-def]
    model = load_tiny("llama")
    plan, ns = model_plan(model, chunk_tokens=C, model_id="some-other-llama")
    with Store(plan, ns, cpu_bytes=8 << 20) as other:
        # the other model fills its store with this very prompt
        PrefixCache(model, other, model_id="some-other-llama").forward(prompt)
        writes = other.metrics()
        pc = PrefixCache(model, other)  # this model's own identity: another namespace
        assert not pc.namespace_ok
        logits, stats = pc.forward(prompt)
        assert stats.namespace_miss and stats.restored_tokens == 0
        assert other.metrics()["lookups"] == writes["lookups"]  # not even asked
        torch.testing.assert_close(logits, full_pass_logits(model, prompt), atol=1e-4, rtol=1e-4)


def test_new_weights_under_the_same_name_are_a_miss(load_tiny, prompt, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A re-saved fine-tune at the same path: same config, same name, other weights. Restoring
    the old weights' KV would give wrong logits with valid checksums; the weights digest in the
    namespace makes it a miss."""
    import copy

    kw = dict(disk_dir=str(tmp_path / "kv"), disk_bytes=8 << 20)
    old = load_tiny("llama")
    first = PrefixCache.for_model(old, chunk_tokens=C, **kw)
    first.forward(prompt)
    first.store.close()
    tuned = copy.deepcopy(old)
    with torch.no_grad():
        tuned.model.layers[0].self_attn.k_proj.weight.mul_(1.01)
    assert tuned.config._name_or_path == old.config._name_or_path
    pc = PrefixCache.for_model(tuned, chunk_tokens=C, **kw)
    assert pc.namespace.model != first.namespace.model and "#weights=" in pc.namespace.model
    logits, stats = pc.forward(prompt, save=False)
    assert stats.restored_tokens == 0 and stats.lookup_tokens == 0
    torch.testing.assert_close(logits, full_pass_logits(tuned, prompt), atol=1e-4, rtol=1e-4)
    pc.store.close()
    again = PrefixCache.for_model(old, chunk_tokens=C, **kw)  # the old weights still hit
    assert again.forward(prompt, save=False)[1].restored_tokens > 0
    again.store.close()


def test_store_of_another_dtype_is_a_miss(load_tiny, prompt, tmp_path) -> None:  # type: ignore[no-untyped-def]
    kw = dict(disk_dir=str(tmp_path / "kv"), disk_bytes=8 << 20)
    f32 = load_tiny("gemma3")
    first = PrefixCache.for_model(f32, chunk_tokens=C, **kw)
    first.forward(prompt)
    first.store.close()
    bf16 = load_tiny("gemma3", "bfloat16")
    pc = PrefixCache.for_model(bf16, chunk_tokens=C, **kw)
    assert pc.namespace.dtype == "bfloat16"
    _, stats = pc.forward(prompt)
    assert stats.restored_tokens == 0 and stats.lookup_tokens == 0


def test_mamba1_is_refused(load_tiny) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedModelError, match="Mamba-1"):
        model_plan(load_tiny("mamba"))


def test_batch_and_padding_are_refused(load_tiny, prompt) -> None:  # type: ignore[no-untyped-def]
    pc = PrefixCache.for_model(load_tiny("llama"), chunk_tokens=C, cpu_bytes=8 << 20)
    with pytest.raises(ConfigError, match="batch size 2"):
        pc.forward(prompt.repeat(2, 1))
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    with pytest.raises(ConfigError, match="padding"):
        pc.generate(prompt, attention_mask=mask, max_new_tokens=1)


def test_prefill_to_an_earlier_end_restores_only_up_to_it(load_tiny, prompt) -> None:  # type: ignore[no-untyped-def]
    model = load_tiny("gemma3")  # sliding W=24: a smaller hit needs other chunks than a larger one
    # placement "every": the default stores the sliding chunks only where hits land (here at 80)
    pc = PrefixCache.for_model(model, chunk_tokens=C, cpu_bytes=8 << 20, placement="every")
    pc.forward(prompt)  # stores chunks 0..4 (tokens < 80)
    pf = pc.prefill(prompt, end=40, logits="last")
    assert pf.stats.restored_tokens == 32 and pf.stats.computed_tokens == 8
    torch.testing.assert_close(pf.logits, full_pass_logits(model, prompt[:, :40])[:, -1:], atol=1e-4, rtol=1e-4)


def test_tiny_random_dir_is_deterministic_and_checks_the_family(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    from kvtier.local_models import tiny_random_dir

    a = tiny_random_dir("llama", tmp_path / "a", seed=7)
    b = tiny_random_dir("llama", tmp_path / "b", seed=7)
    assert (a / "tokenizer.json").exists() and (a / "config.json").exists()
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ConfigError, match="unknown tiny model family"):
        tiny_random_dir("gpt2", tmp_path / "c")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_next_chat_turn_restores_past_the_answer(family: str, load_tiny, prompt) -> None:  # type: ignore[no-untyped-def]
    model = load_tiny(family)
    pc = PrefixCache.for_model(model, chunk_tokens=C, cpu_bytes=8 << 20)
    first = pc.generate(prompt[:, :40], max_new_tokens=30, do_sample=False, pad_token_id=0)
    answer = first.sequences  # 40 prompt tokens + 30 generated: K/V exist for 69 of them
    follow_up = torch.cat([answer, prompt[:, 40:60]], dim=1)
    logits, stats = pc.forward(follow_up)
    assert stats.restored_tokens == 64  # past the 40-token prompt, into the answer
    torch.testing.assert_close(logits, full_pass_logits(model, follow_up)[:, 64:], atol=1e-4, rtol=1e-4)
    out = pc.generate(follow_up, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, plain_greedy(model, follow_up, 6))


def test_prompt_lookup_decoding_never_stores_cropped_draft_kv(load_tiny, prompt) -> None:  # type: ignore[no-untyped-def]
    """Prompt-lookup (assisted) decoding feeds draft tokens and crops the rejected ones from the
    cache; their K/V must never be stored under the accepted tokens' positions. A follow-up turn
    must restore only K/V a plain run computes (here: the 32 prompt tokens' chunks)."""
    model = load_tiny("llama")
    pc = PrefixCache.for_model(model, chunk_tokens=C, cpu_bytes=8 << 20)
    ids = torch.cat([prompt[:, :20], prompt[:, :20]], dim=1)  # repeats give the lookup drafts
    first = pc.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0,
                        prompt_lookup_num_tokens=4)
    follow_up = torch.cat([first.sequences, prompt[:, 40:60]], dim=1)
    logits, stats = pc.forward(follow_up, save=False)
    assert stats.restored_tokens == 32  # the prompt's two full chunks (39 tokens prefilled), no answer chunks
    torch.testing.assert_close(logits, full_pass_logits(model, follow_up)[:, 32:], atol=1e-4, rtol=1e-4)


def test_state_models_store_no_chunks_past_the_prompt(load_tiny, prompt) -> None:  # type: ignore[no-untyped-def]
    model = load_tiny("bamba")  # no state checkpoint is taken while decoding: nothing to store there
    pc = PrefixCache.for_model(model, chunk_tokens=C, cpu_bytes=8 << 20)
    first = pc.generate(prompt[:, :40], max_new_tokens=30, do_sample=False, pad_token_id=0)
    _, stats = pc.forward(torch.cat([first.sequences, prompt[:, 40:60]], dim=1), save=False)
    assert stats.restored_tokens == 32


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_runs_on_the_filled_cache(family: str, load_tiny, prompt) -> None:  # type: ignore[no-untyped-def]
    """`model.generate` must continue kvtier's cache, not build its own: if it ignored the cache
    (a renamed argument, e.g. `past_key_values` -> `cache` in transformers 5.24), it would
    recompute the whole prompt and still answer the same, so count what the model is fed."""
    model = load_tiny(family)
    pc = PrefixCache.for_model(model, chunk_tokens=C, cpu_bytes=8 << 20)
    pc.generate(prompt[:, :T + 1], max_new_tokens=1, do_sample=False, pad_token_id=0)
    fed: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: fed.append(args[0].shape[-1]))
    try:
        out = pc.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        hook.remove()
    p = prompt.shape[1]
    computed = _cuts(family, T, p - 1)
    # kvtier's prefill pieces [T, p-1), then generate: the last prompt token, then one per new token
    assert fed == [b - a for a, b in zip(computed, computed[1:])] + [1, 1, 1]
    assert out.stats.restored_tokens == T
    assert torch.equal(out.sequences, plain_greedy(model, prompt, 3))
