"""`load_geometry`: a geometry from a file, whichever kind it is.

It reads a geometry JSON (`Geometry.from_dict`) or a Hugging Face config.json (the readers in
`hf_config`), told apart by content. It lives apart from both so that `geometry` (the
vocabulary) never imports the HF readers, which import it: the dependency runs one way.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kvtier.core.geometry import Geometry
from kvtier.core.hf_config import geometry_from_hf_config
from kvtier.errors import ConfigError


def load_geometry(
    path: str | Path, *, dtype: str | None = None, block_size: int | None = None
) -> Geometry:
    """Read a geometry JSON file or a Hugging Face config.json (recognised by its content).

    `dtype` and `block_size` (the engine's tokens per block) apply to config.json only: a
    geometry JSON already states its bytes and block sizes, so passing them is an error
    rather than a silent no-op.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise ConfigError(
                f"directory {str(path)!r} has no config.json; give a geometry JSON or a config.json"
            )
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{str(path)!r} is not a UTF-8 text file; give a geometry JSON or a config.json") from None
    except FileNotFoundError:
        raise ConfigError(f"geometry file {str(path)!r} does not exist; give a geometry JSON or a config.json") from None
    except OSError as exc:
        raise ConfigError(f"cannot read geometry file {str(path)!r}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{str(path)!r} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if isinstance(data, dict) and "groups" in data:
        if dtype is not None or block_size is not None:
            raise ConfigError(
                f"{str(path)!r} is a geometry JSON: it states bytes and tokens per block itself; "
                "drop --dtype/--block-size (they apply to a Hugging Face config.json)"
            )
        return Geometry.from_dict(data, source=f"geometry file {p.name}")
    if isinstance(data, dict) and ("model_type" in data or "architectures" in data):
        geometry = geometry_from_hf_config(data, dtype=dtype, block_size=block_size)
        if not data.get("_name_or_path"):  # name it after the model directory or the file
            name = p.parent.name if p.name == "config.json" else p.stem
            geometry = replace(geometry, name=name or geometry.name)
        return geometry
    raise ConfigError(
        f"{str(path)!r} is neither a geometry JSON (it has no 'groups') nor a Hugging Face "
        "config.json (it has no 'model_type'); see docs/geometry.md for the geometry format"
    )
