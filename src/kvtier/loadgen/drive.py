"""Send the same prompts to two or more servers, one request at a time, and time each.

Each prompt goes to every server before the next prompt is sent; who goes first rotates with
the prompt, so neither server is always the one that runs right after the other (a server's
background work, e.g. writes behind, then lands on the other's request as often as on its own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .client import Stream
from .stats import Sample


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    base_url: str
    model: str  # the served model name requests carry


def drive(endpoints: Sequence[Endpoint], prompts: Sequence[Sequence[int]], stream: Stream,
          max_tokens: int, progress: Callable[[int], None] | None = None) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {e.name: [] for e in endpoints}
    for i, prompt in enumerate(prompts):
        k = i % len(endpoints)
        for e in [*endpoints[k:], *endpoints[:k]]:
            out[e.name].append(stream(e.base_url, e.model, prompt, max_tokens))
            if progress is not None:
                progress(1)
    return out
