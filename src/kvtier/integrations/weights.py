"""A digest of a model's weights, mixed into the namespace's model field.

Why: a namespace named only by the model's name or path lets new weights served under the same
name (a re-saved fine-tune, a merged LoRA, a new revision copied over the old one) restore the
old weights' KV from a disk or Redis tier, with valid checksums: a silently wrong answer. The
integrations append `#weights=<16 hex digits>` to the model field, so such a change is a
namespace miss.

The rule (the same for tensors in memory and for weight files on disk):
- every tensor adds its name, dtype, shape and three windows of its bytes: the first, middle and
  last `WINDOW` bytes (all of it when it is at most three windows long);
- tensors go in name order, so load order and sharding into files do not matter to the
  in-memory digest; the file digest also adds each file's name and size.
A change anywhere in a tensor's first, middle or last 4 KiB, or in any name, dtype or shape, gives
a new digest. A full fine-tune or a merged LoRA (a dense update of whole matrices) changes all of
them. What it does not see: a change confined to bytes outside every window (say, a few embedding
rows edited in the middle of the matrix). Give a new model id or tenant for such a change.

Cost: three small reads per tensor (a few hundred tensors for a 7B model), a few milliseconds from
memory or the page cache; never a pass over the whole checkpoint.

Weight files without a tensor index kvtier reads (`.bin`, `.pt`, `.pth`, `.gguf`) are sampled
instead: their size and `FILE_SAMPLES` windows spread evenly over the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

WINDOW = 4096
FILE_SAMPLES = 256
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_TAG = b"kvtier-weights-v1"
_SAFETENSORS_MAX_HEADER = 100 << 20


def windows(nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges of a tensor of `nbytes` bytes that the digest reads."""
    if nbytes <= 3 * WINDOW:
        return [(0, nbytes)]
    mid = nbytes // 2 - WINDOW // 2
    return [(0, WINDOW), (mid, mid + WINDOW), (nbytes - WINDOW, nbytes)]


def _add_tensor(h: hashlib._Hash, name: str, dtype: str, shape: Iterable[int],
                parts: Iterable[bytes]) -> None:
    head = json.dumps([name, dtype, [int(s) for s in shape]]).encode()
    h.update(len(head).to_bytes(4, "little") + head)
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)


def _tensor_windows(t: object) -> list[bytes]:
    """The windows of a tensor's bytes; its float32 values for a dtype without a byte view; and
    `unreadable` for a tensor subclass that allows neither (e.g. a sharded DTensor)."""
    import torch

    for convert in (lambda x: x.view(torch.uint8), lambda x: x.to(torch.float32).view(torch.uint8)):
        try:
            raw = convert(t.detach().contiguous().reshape(-1))  # type: ignore[attr-defined]
            return [raw[a:b].cpu().numpy().tobytes() for a, b in windows(raw.numel())]
        except (RuntimeError, TypeError, NotImplementedError, AttributeError):
            continue
    return [b"unreadable"]


def module_digest(model: object) -> str:
    """16 hex digits over the `state_dict()` of a torch module (parameters and buffers).

    A tensor on the meta device (weights not loaded, e.g. offloaded by accelerate) adds its name,
    dtype and shape only."""
    import torch

    h = hashlib.blake2b(_TAG, digest_size=8)
    state = model.state_dict()  # type: ignore[attr-defined]
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        if t.device.type == "meta":
            _add_tensor(h, name, dtype, t.shape, [b"meta"])
            continue
        _add_tensor(h, name, dtype, t.shape, _tensor_windows(t))
    return h.hexdigest()


def _safetensors_index(fd: int, size: int) -> tuple[int, dict[str, dict]] | None:
    """(data start, header) of a safetensors file, or None when it is not one."""
    if size < 8:
        return None
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    if n <= 0 or n > _SAFETENSORS_MAX_HEADER or 8 + n > size:
        return None
    try:
        header = json.loads(os.pread(fd, n, 8))
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    return 8 + n, header


def _add_file(h: hashlib._Hash, path: Path) -> None:
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        name = path.name.encode()
        h.update(len(name).to_bytes(4, "little") + name + size.to_bytes(8, "little"))
        index = _safetensors_index(fd, size) if path.suffix == ".safetensors" else None
        if index is not None:
            start, header = index
            for tname in sorted(k for k in header if k != "__metadata__"):
                info = header[tname]
                try:
                    lo, hi = (int(x) for x in info["data_offsets"])
                    dtype, shape = str(info["dtype"]), [int(x) for x in info["shape"]]
                    if not 0 <= lo <= hi <= size - start:
                        raise ValueError(f"data_offsets {lo}..{hi} outside the file")
                except (KeyError, TypeError, ValueError):
                    _add_tensor(h, tname, "?", [], [json.dumps(info).encode()])
                    continue
                _add_tensor(h, tname, dtype, shape,
                            [os.pread(fd, b - a, start + lo + a) for a, b in windows(hi - lo)])
            return
        if size <= FILE_SAMPLES * WINDOW:
            h.update(os.pread(fd, size, 0))
            return
        step = (size - WINDOW) // (FILE_SAMPLES - 1)
        for i in range(FILE_SAMPLES):
            h.update(os.pread(fd, WINDOW, i * step))


def files_digest(path: str | os.PathLike[str]) -> str | None:
    """16 hex digits over the weight files of a model directory (or one weight file), by the
    rule above; None when there are none (a hub id, a directory without weights)."""
    p = Path(path)
    if p.is_file() and p.suffix in WEIGHT_SUFFIXES:
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    else:
        files = []
    if not files:
        return None
    h = hashlib.blake2b(_TAG, digest_size=8)
    for f in files:
        _add_file(h, f)
    return h.hexdigest()


def with_weights(model_id: str, digest: str | None) -> str:
    """The namespace's model field: `model_id#weights=DIGEST` (unchanged without a digest, or
    when `model_id` already names these weights)."""
    if digest is None:
        return model_id
    suffix = f"#weights={digest}"
    return model_id if model_id.endswith(suffix) else model_id + suffix


def model_identity(model: str) -> str:
    """The namespace's model field: the model path/name plus, for a local directory, a digest of
    its config.json and of its weight files (`files_digest`: every tensor's name, dtype, shape and
    first, middle and last 4 KiB), so two checkpoints at one path never share chunks."""
    cfg = Path(model) / "config.json"
    out = model
    if cfg.is_file():
        out = f"{model}#{hashlib.blake2b(cfg.read_bytes(), digest_size=8).hexdigest()}"
    return with_weights(out, files_digest(model))
