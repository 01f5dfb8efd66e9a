"""`kvtier inspect` and `kvtier check [--fix]` on a real disk tier directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kvtier.cli import main
from kvtier.core.geometry import Geometry, Group
from kvtier.core.keys import Namespace
from kvtier.core.plan import make_plan
from kvtier.store.store import Store
from kvtier.store.tiers.disk_files import DATA_OFFSET, slab_name, slot_stride

C = 32
GEOM = Geometry(
    groups=(
        Group("full", "full", num_layers=1, tokens_per_block=16, bytes_per_token_per_layer=64),
        Group("ssm", "state", num_layers=1, tokens_per_block=16, state_bytes_per_layer=700),
    ),
    tokens_per_hash=16,
)
PLAN = make_plan(GEOM, chunk_tokens=C)
NS = Namespace("cli-model", GEOM.fingerprint(), "bfloat16")
ROW = sum(gp.chunk_bytes for gp in PLAN.groups)


def _fill(root: Path) -> None:
    toks = list(range(3 * C + 1))
    pl = {(gp.index, i): torch.full((gp.chunk_bytes,), i + 1, dtype=torch.uint8) for gp in PLAN.groups for i in range(3)}
    with Store(PLAN, NS, disk_dir=root, disk_bytes=4 * ROW) as s:
        assert s.save_tokens(toks, pl) == 6


def _flip(root: Path, group: int, slot: int) -> None:
    nbytes = PLAN.groups[group].chunk_bytes
    with open(root / NS.id / slab_name(group, nbytes), "r+b") as f:
        off = slot * slot_stride(nbytes) + DATA_OFFSET + 5
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def _run(capsys, *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_inspect_counts_chunks_bytes_and_groups(tmp_path: Path, capsys) -> None:
    _fill(tmp_path)
    code, info = _run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0
    assert info["chunks"] == 6 and info["bad"] == 0
    assert info["payload_bytes"] == 3 * ROW
    (ns,) = info["namespaces"]
    assert ns["namespace"] == NS.id and ns["in_use_by_pid"] is None
    assert [(g["group"], g["slot_bytes"], g["chunks"]) for g in ns["groups"]] == [(0, 2048, 3), (1, 700, 3)]
    assert 0 <= ns["groups"][0]["newest_age_s"] <= ns["groups"][0]["oldest_age_s"] < 600


def test_inspect_shows_the_live_writer(tmp_path: Path, capsys) -> None:
    import os

    with Store(PLAN, NS, disk_dir=tmp_path, disk_bytes=4 * ROW):
        code, info = _run(capsys, "inspect", str(tmp_path), "--json")
    assert info["namespaces"][0]["in_use_by_pid"] == str(os.getpid())


def test_check_finds_and_fixes_a_bad_checksum(tmp_path: Path, capsys) -> None:
    _fill(tmp_path)
    _flip(tmp_path, 0, 1)
    code, rep = _run(capsys, "check", str(tmp_path), "--json")
    assert code == 1
    assert rep["checked"] == 6 and rep["fixed"] == 0
    assert [(b["group"], b["slot"], b["problem"]) for b in rep["bad"]] == [(0, 1, "payload checksum mismatch")]
    code, rep = _run(capsys, "check", str(tmp_path), "--fix", "--json")
    assert (code, rep["fixed"]) == (0, 1)
    code, rep = _run(capsys, "check", str(tmp_path), "--json")
    assert (code, rep["checked"], rep["bad"]) == (0, 5, [])


def test_check_fix_refuses_a_directory_in_use(tmp_path: Path, capsys) -> None:
    _fill(tmp_path)
    _flip(tmp_path, 1, 0)
    with Store(PLAN, NS, disk_dir=tmp_path, disk_bytes=4 * ROW) as s:
        # the store dropped the bad slot at its restart scan? no: the header is fine, the
        # payload is bad, which only a read or `check` sees
        assert s.rebuilt == 6
        code = main(["check", str(tmp_path), "--fix"])
        err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: namespace") and "in use by pid" in err


def test_cli_exit_codes_and_one_line_errors(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvtier", "inspect", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    _fill(tmp_path)
    r = subprocess.run([sys.executable, "-m", "kvtier", "inspect", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "6 chunks" in r.stdout
