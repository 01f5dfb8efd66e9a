"""The weights digest (kvtier.integrations.weights): the same weights give the same digest however they are
loaded; a change in any tensor's first, middle or last 4 KiB, its name, dtype or shape gives a new
one; the rule is the same for tensors in memory and in safetensors files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvtier.integrations.weights import WINDOW, files_digest, module_digest, windows, with_weights


def test_windows_by_hand() -> None:
    assert windows(0) == [(0, 0)]
    assert windows(3 * WINDOW) == [(0, 3 * WINDOW)]
    n = 10 * WINDOW
    assert windows(n) == [(0, WINDOW), (5 * WINDOW - WINDOW // 2, 5 * WINDOW + WINDOW // 2),
                          (9 * WINDOW, 10 * WINDOW)]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(256, 64, bias=False)  # 64 KiB of float32: three windows
        self.small = torch.nn.Linear(4, 4)
        self.register_buffer("steps", torch.arange(3))


def _model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def test_same_weights_same_digest_however_loaded() -> None:
    a, b = _model(0), _model(1)
    assert module_digest(a) != module_digest(b)
    b.load_state_dict(a.state_dict())
    assert module_digest(a) == module_digest(b)


@pytest.mark.parametrize("flat_index", [0, 8192, 16383], ids=["first", "middle", "last"])
def test_a_change_in_any_window_changes_the_digest(flat_index: int) -> None:
    m = _model()
    before = module_digest(m)
    with torch.no_grad():
        m.big.weight.view(-1)[flat_index] += 1e-3
    assert module_digest(m) != before


def test_a_change_outside_every_window_is_not_seen() -> None:
    """The stated limit: bytes outside the three windows are not read."""
    m = _model()
    before = module_digest(m)
    with torch.no_grad():
        m.big.weight.view(-1)[4000] += 1.0  # float 4000 = byte 16000: between the windows
    assert module_digest(m) == before


def test_names_dtypes_and_meta_tensors() -> None:
    m = _model()
    d = module_digest(m)
    assert module_digest(m.to(torch.bfloat16)) != d
    with torch.device("meta"):
        meta = Tiny()
    assert len(module_digest(meta)) == 16  # no bytes to read: name, dtype and shape only


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def test_files_digest_follows_the_tensors(tmp_path: Path) -> None:
    m = _model()
    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    one = files_digest(_save(tmp_path / "a", state))
    assert one is not None and files_digest(_save(tmp_path / "b", state)) == one
    changed = dict(state, **{"big.weight": state["big.weight"].clone()})
    changed["big.weight"].view(-1)[16383] += 1e-3  # the last window
    assert files_digest(_save(tmp_path / "c", changed)) != one
    outside = dict(state, **{"big.weight": state["big.weight"].clone()})
    outside["big.weight"].view(-1)[4000] += 1.0
    assert files_digest(_save(tmp_path / "d", outside)) == one  # the same stated limit
    assert files_digest(tmp_path / "a" / "model.safetensors") == one  # the file alone: the same
    assert files_digest(tmp_path / "nothing-here") is None


def test_other_weight_files_are_sampled(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    blob = bytearray(torch.randint(0, 256, (4 << 20,), dtype=torch.uint8).numpy().tobytes())
    (d / "model.gguf").write_bytes(bytes(blob))
    first = files_digest(d)
    blob[0] ^= 1  # the first sample
    (d / "model.gguf").write_bytes(bytes(blob))
    assert files_digest(d) not in (None, first)
    (d / "broken.safetensors").write_bytes(b"\xff" * 64)  # not a safetensors file: sampled
    assert files_digest(d) is not None


def test_with_weights() -> None:
    assert with_weights("m", None) == "m"
    assert with_weights("m", "ab") == "m#weights=ab"
    assert with_weights("m#weights=ab", "ab") == "m#weights=ab"


def test_vllm_model_identity_names_config_and_weights(tmp_path: Path) -> None:
    from kvtier.integrations.weights import model_identity

    state = {k: v.contiguous() for k, v in _model().state_dict().items()}
    d = _save(tmp_path / "m", state)
    ident = model_identity(str(d))
    assert ident.startswith(f"{d}#") and ident.endswith(f"#weights={files_digest(d)}")
    assert model_identity(str(d)) == ident  # a restart of the same checkpoint: the same namespace
    state["small.bias"] = state["small.bias"] + 1  # re-saved, fine-tuned, at the same path
    _save(d, state)
    assert model_identity(str(d)) != ident
    assert model_identity("org/some-hub-id") == "org/some-hub-id"  # nothing local to read


def test_a_safetensors_header_pointing_past_the_file_is_hashed_not_read(tmp_path: Path) -> None:
    import json as _json

    d = tmp_path / "m"
    d.mkdir()
    header = _json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    assert files_digest(d) is not None  # no exception, no read past the end
