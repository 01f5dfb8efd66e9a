"""The bench's request driver (loadgen/drive.py): order, and waiting for an idle machine."""

from __future__ import annotations

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


def test_a_busy_machine_is_waited_on_up_to_the_limit(monkeypatch) -> None:  # noqa: ANN001
    """CPU counters that say busy (10 % idle a window) keep it waiting its whole limit; counters
    that say idle, or do not move, end the wait after one window."""
    from kvtier.loadgen import drive as d

    reads = {"n": 0}

    def counters(idle_share: float, step: int = 100):  # noqa: ANN202
        reads["n"] = 0

        def read() -> tuple[int, int]:
            reads["n"] += 1
            return int(reads["n"] * step * idle_share), reads["n"] * step
        return read

    monkeypatch.setattr(d, "_cpu_times", counters(0.1))
    assert wait_quiet(window_s=0.05, max_s=0.3) >= 0.3
    # one window is the first read and one more (counted, not timed: a loaded machine's sleep
    # may overrun the window)
    monkeypatch.setattr(d, "_cpu_times", counters(0.95))
    wait_quiet(window_s=0.05, max_s=0.3)
    assert reads["n"] == 2
    monkeypatch.setattr(d, "_cpu_times", counters(0.0, step=0))
    wait_quiet(window_s=0.05, max_s=0.3)
    assert reads["n"] == 2


def test_the_real_counters_read() -> None:
    from kvtier.loadgen.drive import _cpu_times

    got = _cpu_times()
    assert got is None or 0 <= got[0] <= got[1]
