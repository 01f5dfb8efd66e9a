"""End-to-end fixtures: real (tiny, random-weight) transformers models, real stores.

Tiny model directories are built once per machine under the kvtier cache (`kvtier.local_models`),
each with the SmolLM2 tokenizer; a session loads each model once.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def torch_one_thread():  # type: ignore[no-untyped-def]
    """Tiny models do not gain from a second thread, and on a shared 2-core machine two threads
    spin-wait on each other: a 16-token forward goes from 20 ms to 800 ms under load. Scoped to
    the modules that ask for it, so other e2e tests keep torch's default."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, object]:
    return {}


@pytest.fixture(scope="session")
def load_tiny(tiny_models: dict[str, object]):  # type: ignore[no-untyped-def]
    """load_tiny(family) -> the model (float32, eval), loaded once per session."""
    from transformers import AutoModelForCausalLM

    from kvtier.local_models import tiny_random_dir

    def load(family: str, dtype: str = "float32"):  # type: ignore[no-untyped-def]
        key = f"{family}-{dtype}"
        if key not in tiny_models:
            d = tiny_random_dir(family)
            tiny_models[key] = AutoModelForCausalLM.from_pretrained(
                str(d), dtype=getattr(torch, dtype)).eval()
        return tiny_models[key]

    return load


@pytest.fixture
def prompt() -> "torch.Tensor":
    """90 token ids from a seeded generator (no tokenizer needed)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, 40000, (1, 90), generator=g)
