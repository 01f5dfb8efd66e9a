"""A restarted process restores what an earlier process stored on disk (real subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvtier.integrations.transformers import PrefixCache
from test_transformers import C, T, _cuts, plain_split_logits

pytestmark = pytest.mark.usefixtures("torch_one_thread")

FAMILIES = ("gemma3", "bamba")  # sliding + full; Mamba-2 state + full
WRITER = """
import sys, torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
from kvtier.local_models import tiny_random_dir
from kvtier.integrations.transformers import PrefixCache
root, chunk, ids = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
for family in sys.argv[4:]:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_random_dir(family))).eval()
    pc = PrefixCache.for_model(model, chunk_tokens=chunk, disk_dir=f"{root}/{family}", disk_bytes=8 << 20)
    print(family, pc.generate(torch.tensor([ids]), max_new_tokens=1, pad_token_id=0).saved_payloads)
"""


def test_disk_tier_survives_a_process_restart(load_tiny, prompt, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    ids = ",".join(str(x) for x in prompt[0, :T + 1].tolist())
    # one writer process for both families (a process start costs seconds), then it exits
    done = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), str(C), ids, *FAMILIES],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = dict(line.split() for line in done.stdout.strip().splitlines())
    assert set(saved) == set(FAMILIES) and all(int(n) > 0 for n in saved.values())

    for family in FAMILIES:
        model = load_tiny(family)
        pc = PrefixCache.for_model(model, chunk_tokens=C, disk_dir=str(tmp_path / family), disk_bytes=8 << 20)
        assert pc.store.rebuilt > 0
        logits, stats = pc.forward(prompt, save=False)
        assert stats.restored_tokens == T, family
        assert stats.restored_tokens_by_tier == {"disk": T}
        ref = plain_split_logits(model, prompt, _cuts(family, 0, T), _cuts(family, T, prompt.shape[1]))
        assert torch.equal(logits, ref), family
        pc.store.close()
