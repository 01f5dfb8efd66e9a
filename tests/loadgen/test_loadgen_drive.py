"""The bench's request driver (loadgen/drive.py): order, and waiting for an idle machine."""

from __future__ import annotations

import os
import subprocess
import sys

from kvtier.loadgen.drive import Endpoint, drive, wait_quiet


def test_every_prompt_goes_to_every_server_first_one_rotating_each_after_a_quiet_wait() -> None:
    calls: list[str] = []

    def stream(url: str, model: str, prompt, max_tokens: int):  # noqa: ANN001, ANN202
        calls.append(f"{url}:{prompt[0]}")
        return (url, prompt[0])

    def quiet() -> float:
        calls.append("quiet")
        return 0.25

    eps = [Endpoint("a", "A", "m"), Endpoint("b", "B", "m")]
    waited: list[float] = []
    out = drive(eps, [[1], [2], [3]], stream, 4, quiet=quiet, waited=waited)
    assert calls == ["quiet", "A:1", "quiet", "B:1", "quiet", "B:2", "quiet", "A:2", "quiet", "A:3", "quiet", "B:3"]
    assert out == {"a": [("A", 1), ("A", 2), ("A", 3)], "b": [("B", 1), ("B", 2), ("B", 3)]}
    assert waited == [0.25] * 6


def test_a_busy_machine_is_waited_on_up_to_the_limit() -> None:
    """Every CPU spinning: the machine never looks idle, so the wait lasts its whole limit."""
    n = os.cpu_count() or 1
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        assert wait_quiet(max_s=0.6) >= 0.6
    finally:
        for p in spin:
            p.kill()
            p.wait()
