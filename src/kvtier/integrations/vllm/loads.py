"""The chunks of each request's loads, kept until no failed load can need them (the manager's).

vLLM completes a failed load too. KvtierConnector tells the manager which loads failed first
(`mark_failed`), vLLM then calls complete_load for them (their promotion slots are aborted, never
committed unfilled: promotion.py), and the connector calls `load_failed`, which forgets the
load's chunks in every tier, so no later request is offered the same bad hit. vLLM signals a
request finished (an abort) also while its load is in flight, before that load completes: its
chunks are then kept until the load completes, so a failed load still forgets them; a load that
worked drops them then.

Pure: no torch, no vLLM. A failure is named by `mark_failed`, never planted as a flag across a
call.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable

Chunk = tuple[bytes, int]  # (chunk hash, plan group)


class LoadLedger:
    """Per request: the chunks of its last load, its load jobs in flight (prepare_load ..
    complete_load), whether it finished meanwhile, whether its load failed in the output vLLM is
    handling now. Per engine key (vLLM's OffloadKey, opaque here): the tier of each index pin its
    loads hold, oldest first (each complete_load releases the oldest)."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[Chunk]] = {}
        self._jobs: dict[str, int] = {}
        self._finished: set[str] = set()  # finished while loading: chunks kept until the load ends
        self._failing: set[str] = set()
        self._pins: dict[Hashable, list[str]] = {}

    def started(self, req_id: str, chunks: list[Chunk]) -> None:
        """prepare_load scheduled a load job of `chunks` for the request."""
        self._chunks[req_id] = chunks
        self._jobs[req_id] = self._jobs.get(req_id, 0) + 1

    def pinned(self, key: Hashable, tier: str) -> None:
        """A load of `key` pinned its chunk in `tier` (prepare_load)."""
        self._pins.setdefault(key, []).append(tier)

    def unpin(self, key: Hashable) -> str | None:
        """The tier of `key`'s oldest load pin, released here (complete_load); None without one."""
        tiers = self._pins.get(key)
        if not tiers:
            return None
        tier = tiers.pop(0)
        if not tiers:
            del self._pins[key]
        return tier

    def source(self, key: Hashable) -> str | None:
        """The tier `key`'s latest load reads from, while its pin is held."""
        tiers = self._pins.get(key)
        return tiers[-1] if tiers else None

    def pins(self) -> int:
        """Load pins held, over every key."""
        return sum(len(t) for t in self._pins.values())

    def completed(self, req_id: str) -> None:
        """vLLM completed one of the request's load jobs (also a failed one)."""
        left = self._jobs.pop(req_id, 0) - 1
        if left > 0:
            self._jobs[req_id] = left
        elif req_id in self._finished and req_id not in self._failing:
            # finished while loading and the load worked: nothing will ask for its chunks again
            self._finished.discard(req_id)
            self._chunks.pop(req_id, None)

    def finished(self, req_id: str) -> None:
        """vLLM finished the request: its chunks are dropped, or kept until its load completes."""
        if req_id in self._jobs:
            self._finished.add(req_id)
        else:
            self._chunks.pop(req_id, None)

    def failed(self, req_id: str) -> list[Chunk]:
        """The request's load failed (after its complete_load): the chunks to forget, dropped here."""
        self._finished.discard(req_id)
        return self._chunks.pop(req_id, [])

    def mark_failed(self, req_ids: Collection[str]) -> None:
        """These requests' loads failed in the output vLLM handles next (until `clear_failed`)."""
        self._failing = set(req_ids)

    def clear_failed(self) -> None:
        self._failing = set()

    def failing(self, req_id: str) -> bool:
        """Whether `mark_failed` named the request's load."""
        return req_id in self._failing

    def busy(self) -> bool:
        """Some load is in flight, holds a pin or its chunks are kept."""
        return bool(self._chunks or self._jobs or self._pins)

    def clear(self) -> None:
        """The manager's index was reset: no load's chunks or pins are kept (the failed marks of
        the output being handled stay)."""
        self._pins.clear()
        self._chunks.clear()
        self._jobs.clear()
        self._finished.clear()
