"""`Subscriber`: engines' ZMQ KV event publishers followed on a background thread, feeding a
`PrefixIndex`; a restart or a gap in the sequence numbers resets (or replays) one engine."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping

from .events import decode_batch
from .index import PrefixIndex

log = logging.getLogger("kvtier.router")


class Subscriber:
    """Subscribe to engines' ZMQ KV event publishers (vLLM's `--kv-events-config`) on a background
    thread, feeding `index`. `endpoints`: {engine name: "tcp://host:port"}, or "bind:ENDPOINT" for
    an engine whose publisher connects (vLLM connects to a tcp endpoint without `*`, e.g. loopback);
    `replay`: {engine name: its `replay_endpoint`}, asked for the batches of a gap in the sequence,
    at most once per `replay_interval_s` per engine (each ask may hold this one thread, which serves
    every engine, for `replay_timeout_s`): a gap sooner after the last ask resets that engine."""

    def __init__(self, index: PrefixIndex, endpoints: Mapping[str, str], topic: str = "",
                 replay: Mapping[str, str] | None = None, replay_timeout_s: float = 1.0,
                 replay_interval_s: float = 10.0) -> None:
        import zmq

        from kvtier.errors import ConfigError

        for name, value in (("replay_interval_s", replay_interval_s), ("replay_timeout_s", replay_timeout_s)):
            if not _seconds(value):
                raise ConfigError(f"Subscriber {name}={value!r}: give seconds as a finite number >= 0 "
                                  f"(the default is {10.0 if name == 'replay_interval_s' else 1.0})")
        if stray := sorted(set(replay or {}) - set(endpoints)):
            raise ConfigError(f"replay endpoints for {stray} name no engine of {sorted(endpoints)}; "
                              "name each replay endpoint by the engine whose publisher it belongs to")
        self.index = index
        self.batches = 0  # applied, replayed ones included
        self._replay, self._replay_timeout_s = dict(replay or {}), replay_timeout_s
        self._replay_interval_s = replay_interval_s
        self._replay_at: dict[str, float] = {}  # engine -> when its replay endpoint was last asked
        self._seq: dict[str, int] = {}  # engine -> the last sequence number applied
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._socks = []  # (engine, endpoint, SUB socket, its monitor of disconnections)
        for name, endpoint in endpoints.items():
            s = self._socket(zmq.SUB)
            s.setsockopt_string(zmq.SUBSCRIBE, topic)
            self._socks.append((name, endpoint, s, s.get_monitor_socket(zmq.EVENT_DISCONNECTED)))
            try:
                if endpoint.startswith("bind:"):
                    s.bind(endpoint.removeprefix("bind:"))
                else:
                    s.connect(endpoint)
            except zmq.ZMQError as exc:  # a taken port fails here, loudly
                self._close()
                raise ConfigError(f"engine {name!r}: ZMQ endpoint {endpoint!r} failed ({exc}); give e.g. "
                                  "tcp://10.0.0.5:5557, or bind:tcp://127.0.0.1:5557 on a free port") from None
        for name, endpoint in self._replay.items():  # asked only at a gap: checked now
            probe = self._socket(zmq.DEALER)
            try:
                probe.connect(endpoint)
            except zmq.ZMQError as exc:
                self._close()
                raise ConfigError(f"engine {name!r}: replay endpoint {endpoint!r} failed ({exc}); give the "
                                  "address vLLM binds its replay_endpoint on, e.g. tcp://10.0.0.5:5558") from None
            finally:
                probe.close(0)
        self._thread = threading.Thread(target=self._run, name="kvtier-router", daemon=True)
        self._thread.start()

    def _socket(self, kind: int):  # noqa: ANN202 - a zmq.Socket (zmq is imported lazily)
        import zmq

        s = self._ctx.socket(kind)
        s.setsockopt(zmq.MAXMSGSIZE, self.index.limits.max_message_bytes)
        s.setsockopt(zmq.LINGER, 0)
        return s

    def _run(self) -> None:
        import zmq

        poller, of = zmq.Poller(), {}
        for name, endpoint, s, monitor in self._socks:
            poller.register(s, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            of[s], of[monitor] = (name, None, s), (name, endpoint, s)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                name, endpoint, sub = of[sock]
                try:
                    frames = sock.recv_multipart()
                    if endpoint is None:
                        self._receive(name, frames)
                    else:  # ZMQ drops a connection that sent over max_message_bytes for good
                        self.index.count(name, "disconnects")
                        if endpoint.startswith("bind:"):
                            continue  # the publisher connects again itself
                        with contextlib.suppress(zmq.ZMQError):
                            sub.disconnect(endpoint)
                        sub.connect(endpoint)  # (what was lost meanwhile is a gap)
                except Exception:  # noqa: BLE001 - this thread serves every engine: one message never stops it
                    self.index.count(name, "message_errors")
                    log.exception("kvtier router: a message from engine %r was not applied", name)

    def _receive(self, name: str, frames: list[bytes]) -> None:
        """vLLM's `[topic, seq (8 bytes big-endian), payload]`. A sequence number that goes back is
        a restarted engine, whose tiers went with it (no removal is sent after a kill): reset. A gap
        is filled from the replay endpoint, else (or where its buffer no longer reaches) reset."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.index.count(name, "bad_messages")
            return
        seq, last = int.from_bytes(frames[1], "big"), self._seq.get(name)
        if last is not None and seq <= last:
            self.index.reset(name, "restart")
            last = None
        start = 0 if last is None else last + 1
        if seq > start:  # missed [start, seq): at a first message, whatever the buffer still holds
            run = self._replayed(name, start, seq)
            if last is not None and len(run) < seq - start:
                self.index.reset(name, "gap")  # the batches after it are a suffix: kept
            self.index.count(name, "replayed_batches", len(run))
            for payload in run:
                self._apply(name, payload)
        self._seq[name] = seq
        self._apply(name, frames[2])

    def _replayed(self, name: str, start: int, end: int) -> list[bytes]:
        """The payloads of batches [s, end) from the engine's replay endpoint, for the smallest s
        it still holds (vLLM keeps `buffer_steps` batches); [] without one, on no answer, or when
        the engine's endpoint was asked less than `replay_interval_s` ago (`replays_limited`): an
        engine whose endpoint is down, or that gaps on every batch, costs every engine at most one
        `replay_timeout_s` wait per interval."""
        import zmq

        if (endpoint := self._replay.get(name)) is None:
            return []
        now = time.monotonic()
        if (at := self._replay_at.get(name)) is not None and now - at < self._replay_interval_s:
            self.index.count(name, "replays_limited")
            return []
        self._replay_at[name] = now
        got: dict[int, bytes] = {}
        s = self._socket(zmq.DEALER)  # a fresh one each time: no late answer to an earlier ask
        try:
            s.connect(endpoint)
            s.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self._replay_timeout_s
            while s.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                frames = s.recv_multipart()  # [b"", (topic,) seq, payload]; the end: seq -1, b""
                if len(frames) < 3 or len(frames[-2]) != 8 or not frames[-1]:
                    break
                seq = int.from_bytes(frames[-2], "big")
                if start <= seq < end:
                    got[seq] = frames[-1]
                if seq >= end - 1 or time.monotonic() >= deadline:
                    break
        finally:
            s.close(0)
        first = end
        while first - 1 in got:
            first -= 1
        return [got[n] for n in range(first, end)]

    def _apply(self, name: str, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except ValueError:  # msgspec.DecodeError is one
            self.index.count(name, "bad_messages")
            return
        self.index.apply(name, events)
        self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._close()

    def _close(self) -> None:
        for _, _, s, monitor in self._socks:
            s.disable_monitor()
            monitor.close(0)
            s.close(0)


def _seconds(value: object) -> bool:
    """A duration: an int or float (not a bool), finite, >= 0 (a NaN or negative interval would
    replay on every gap, a NaN timeout never wait)."""
    import math

    return type(value) in (int, float) and math.isfinite(value) and value >= 0  # type: ignore[arg-type]
