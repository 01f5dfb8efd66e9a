"""Groups, geometries, the geometry JSON format, fingerprints and load_geometry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.core.geometry import Geometry, Group
from kvtier.core.load import load_geometry

ISSUE_EXAMPLE = {
    "name": "gemma-3-27b", "tokens_per_hash": 16,
    "groups": [
        {"name": "global", "kind": "full", "num_layers": 10, "tokens_per_block": 16,
         "bytes_per_token_per_layer": 8192},
        {"name": "local", "kind": "sliding", "window": 1024, "num_layers": 52,
         "tokens_per_block": 16, "bytes_per_token_per_layer": 8192},
        {"name": "gdn", "kind": "state", "num_layers": 36, "tokens_per_block": 1056,
         "state_bytes_per_layer": 1048576},
        {"name": "tail", "kind": "full", "num_layers": 2, "tokens_per_block": 4,
         "bytes_per_token_per_layer": 256, "cacheable": False, "reason": "scratch buffer"},
    ],
}


def _write(tmp_path: Path, data: object, name: str = "g.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


def test_issue_example_loads_exactly(tmp_path: Path, geometry_path) -> None:
    g = load_geometry(_write(tmp_path, ISSUE_EXAMPLE))
    assert g.name == "gemma-3-27b" and g.tokens_per_hash == 16
    assert [x.name for x in g.groups] == ["global", "local", "gdn", "tail"]
    gdn, tail = g.groups[2], g.groups[3]
    assert gdn.state_bytes == 36 * 1048576 and gdn.bytes_per_token == 0
    assert g.groups[0].bytes_per_token == 10 * 8192
    assert not tail.cacheable and tail.reason == "scratch buffer"
    assert [x.name for x in g.cacheable_groups] == ["global", "local", "gdn"]
    # the shipped copy is the same geometry
    assert load_geometry(geometry_path("gemma-3-27b-example")) == g


def test_to_dict_round_trip_with_layers() -> None:
    g = Geometry(groups=(
        Group("full", "full", 2, 16, bytes_per_token_per_layer=64, layers=(1, 3)),
        Group("ssm", "state", 2, 16, state_bytes_per_layer=1000, layers=(0, 2), dtype="float16"),
    ), tokens_per_hash=16, name="x")
    doc = json.loads(json.dumps(g.to_dict()))
    assert doc["groups"][0]["layers"] == [1, 3]
    assert Geometry.from_dict(doc) == g


@pytest.mark.parametrize(
    "path, value, words",
    [
        (("groups", 0, "colour"), "red", ["unknown field 'colour'", "'global'"]),
        (("flavour",), 1, ["unknown field 'flavour'"]),
        (("groups", 1, "window"), None, ["'window'"]),
        (("groups", 0, "kind"), "dense", ["'dense'", "full"]),
        (("groups", 0, "num_layers"), 0, ["'num_layers'", "positive"]),
        (("groups", 0, "tokens_per_block"), "16", ["'tokens_per_block'"]),
        (("groups", 2, "bytes_per_token_per_layer"), 8, ["state group", "bytes_per_token_per_layer"]),
        (("groups", 0, "window"), 8, ["'window'", "only 'sliding'"]),
        (("groups", 3, "reason"), "", ["'tail'", "reason"]),
        (("groups", 0, "dtype"), "int4", ["'int4'"]),
        (("groups", 0, "dtype"), ["x"], ["dtype"]),
        (("groups", 0, "cacheable"), "yes", ["'cacheable'"]),
        (("groups", 1, "name"), "global", ["'global'", "twice"]),
        (("groups", 0, "layers"), [0, 1], ["lists 2 layers", "num_layers=10"]),
        (("groups", 0, "layers"), "all", ["'layers'"]),
        (("tokens_per_hash",), 0, ["'tokens_per_hash'"]),
        (("groups",), [], ["no groups"]),
        (("groups",), {"a": 1}, ["'groups'"]),
        (("name",), 7, ["'name'"]),
    ],
)
def test_bad_geometry_fields_name_the_field(tmp_path: Path, path, value, words) -> None:
    doc = json.loads(json.dumps(ISSUE_EXAMPLE))
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    with pytest.raises(ConfigError) as e:
        load_geometry(_write(tmp_path, doc))
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize("field", ["name", "kind", "num_layers", "tokens_per_block"])
def test_missing_group_field_is_named(tmp_path: Path, field: str) -> None:
    doc = json.loads(json.dumps(ISSUE_EXAMPLE))
    del doc["groups"][0][field]
    with pytest.raises(ConfigError, match=f"missing field '{field}'"):
        load_geometry(_write(tmp_path, doc))


@pytest.mark.parametrize("field", ["tokens_per_hash", "groups"])
def test_missing_geometry_field_is_named(tmp_path: Path, field: str) -> None:
    doc = json.loads(json.dumps(ISSUE_EXAMPLE))
    del doc[field]
    if field == "groups":  # without 'groups' the file is not recognised as a geometry JSON
        with pytest.raises(ConfigError, match="no 'groups'"):
            load_geometry(_write(tmp_path, doc))
        return
    with pytest.raises(ConfigError, match=f"missing field '{field}'"):
        load_geometry(_write(tmp_path, doc))


def test_state_and_attention_bytes_are_required_by_kind(tmp_path: Path) -> None:
    doc = json.loads(json.dumps(ISSUE_EXAMPLE))
    del doc["groups"][2]["state_bytes_per_layer"]
    with pytest.raises(ConfigError, match="missing field 'state_bytes_per_layer'"):
        load_geometry(_write(tmp_path, doc))
    doc = json.loads(json.dumps(ISSUE_EXAMPLE))
    del doc["groups"][0]["bytes_per_token_per_layer"]
    with pytest.raises(ConfigError, match="missing field 'bytes_per_token_per_layer'"):
        load_geometry(_write(tmp_path, doc))


def test_a_layer_is_in_one_attention_group_and_one_state_group_at_most() -> None:
    full = Group("a", "full", 2, 16, bytes_per_token_per_layer=8, layers=(0, 1))
    with pytest.raises(ConfigError, match="layer 1 is in group 'a' and in group 'b'"):
        Geometry((full, Group("b", "sliding", 1, 16, bytes_per_token_per_layer=8, window=4,
                              layers=(1,))), tokens_per_hash=16)
    # Falcon-H1 style: the same layers in one attention group and one state group is fine
    Geometry((full, Group("m", "state", 2, 16, state_bytes_per_layer=8, layers=(0, 1))), 16)


def test_fingerprint_ignores_names_and_follows_layout() -> None:
    base = Geometry.from_dict(ISSUE_EXAMPLE)
    renamed = json.loads(json.dumps(ISSUE_EXAMPLE))
    renamed["name"] = "other"
    renamed["groups"][0]["name"] = "g0"
    renamed["groups"][3]["reason"] = "another reason"
    assert Geometry.from_dict(renamed, source="elsewhere").fingerprint() == base.fingerprint()
    changes = [
        ("groups", 0, "bytes_per_token_per_layer", 4096),
        ("groups", 1, "window", 512),
        ("groups", 0, "dtype", "float16"),
        ("groups", 3, "cacheable", True),
        ("groups", 0, "layers", list(range(10))),
        ("tokens_per_hash", None, None, 32),
    ]
    seen = {base.fingerprint()}
    for key, idx, field, value in changes:
        doc = json.loads(json.dumps(ISSUE_EXAMPLE))
        if idx is None:
            doc[key] = value
        else:
            doc[key][idx][field] = value
        fp = Geometry.from_dict(doc).fingerprint()
        assert fp not in seen
        seen.add(fp)
    swapped = json.loads(json.dumps(ISSUE_EXAMPLE))
    swapped["groups"][0], swapped["groups"][1] = swapped["groups"][1], swapped["groups"][0]
    assert Geometry.from_dict(swapped).fingerprint() != base.fingerprint()  # order = group index


def test_fingerprint_is_stable_across_processes(tmp_path: Path) -> None:
    path = _write(tmp_path, ISSUE_EXAMPLE)
    here = load_geometry(path).fingerprint()
    code = f"from kvtier.core.load import load_geometry; print(load_geometry({str(path)!r}).fingerprint())"
    for seed in ("1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
        assert out.stdout.strip() == here
    assert len(here) == 16 and int(here, 16) >= 0


def test_load_geometry_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_geometry(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="has no config.json"):
        load_geometry(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_geometry(tmp_path / "bad.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ConfigError, match="not a UTF-8"):
        load_geometry(tmp_path / "bin.json")
    with pytest.raises(ConfigError, match="neither"):
        load_geometry(_write(tmp_path, [1, 2]))
    with pytest.raises(ConfigError, match="drop --dtype"):
        load_geometry(_write(tmp_path, ISSUE_EXAMPLE), dtype="float16")


def test_model_directory_reads_its_config_json(tmp_path: Path, hf_config) -> None:
    _write(tmp_path, hf_config("llama-3-8b"), "config.json")
    assert load_geometry(tmp_path).groups[0].num_layers == 32


def test_every_shipped_geometry_loads(geometry_path) -> None:
    paths = sorted(geometry_path("x").parent.glob("*.json"))
    assert len(paths) >= 4
    for p in paths:
        g = load_geometry(p)
        assert g.groups and g.fingerprint()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3000) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None)
@given(group=st.integers(0, 3), field=st.sampled_from(sorted(
    {"name", "kind", "num_layers", "tokens_per_block", "bytes_per_token_per_layer",
     "state_bytes_per_layer", "window", "attention_chunk", "dtype", "cacheable", "reason",
     "layers"})), value=_JSON)
def test_any_json_value_in_any_field_is_a_geometry_or_a_config_error(group, field, value) -> None:
    doc = json.loads(json.dumps(ISSUE_EXAMPLE))
    doc["groups"][group][field] = value
    try:
        Geometry.from_dict(doc)
    except ConfigError as exc:
        assert "\n" not in str(exc)
