"""kvtier.router against vLLM's real Scheduler (the engine-less harness, harness.py): before each
request the router predicts, from the KV events published so far (vLLM's own event types through
msgpack, as its ZMQ publisher sends them), how many tokens the engine restores from kvtier; the
GPU prefix cache is reset, the request runs, and the tokens the scheduler loaded are recorded.

    python router_harness.py '[{"name": ..., ...}, ...]'   ->   one line `RESULT {"name": {...}}`

Scenario keys: those of harness.py (layers, dsv4, mtp, extra, prompt_tokens), and queries: a list
of ["a", n] (A's first n tokens), ["a+", n] (A and n new tokens), ["branch", k, n] (A's first k
tokens and n new ones), ["reset"] (vLLM's reset_prefix_cache(reset_connector=True), then the
router asked at once, before any step); draft_groups (the router's hint).
This is a test helper, not kvtier code.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402


class Capture:
    """vLLM's event publisher, keeping each batch as the ZMQ publisher would send it."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, batch) -> None:  # noqa: ANN001 - vLLM's KVEventBatch
        import msgspec

        self.payloads.append(msgspec.msgpack.encode(batch))

    def shutdown(self) -> None:
        pass


class EventsHarness(harness.Harness):
    def _finish_init(self, sc: dict, vconf, kv_bytes: int) -> None:  # noqa: ANN001
        from vllm.config import KVEventsConfig

        vconf.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        super()._finish_init(sc, vconf, kv_bytes)
        self.capture = self.sched.kv_event_publisher = Capture()


def run_router(sc: dict) -> dict:
    from kvtier.router import PrefixIndex, decode_batch

    h = EventsHarness(sc)
    index = PrefixIndex(draft_groups=sc.get("draft_groups", ()))
    applied = 0
    placeholders = 0

    def feed() -> None:
        nonlocal applied, placeholders
        for payload in h.capture.payloads[applied:]:
            events = decode_batch(payload)
            placeholders += sum(1 for ev in events if isinstance(ev, dict) and ev.get("type") == "BlockStored"
                                and ev.get("medium") != "GPU" and not ev.get("token_ids"))
            index.apply("e", events)
        applied = len(h.capture.payloads)

    a = harness._store_a(h, int(sc.get("prompt_tokens", 200)))
    rows = []
    for i, q in enumerate(sc["queries"]):
        if q[0] == "reset":
            assert h.sched.reset_prefix_cache(reset_connector=True)
            feed()  # no step since: what the reset published at once
            rows.append({"query": q, "held_after_reset": sum(
                sum(g["chunks"].values()) for g in index.summary().get("e", {}).get("groups", {}).values())})
            continue
        prompt = (a[:q[1]] if q[0] == "a" else a + [50 + j for j in range(q[1])] if q[0] == "a+"
                  else a[:q[1]] + [60 + (j * 31) % 700 for j in range(q[2])])
        feed()
        predicted = index.longest_prefix(prompt, "e")[0].tokens
        assert harness._fresh_gpu_cache(h)
        req_id = f"q{i}"
        req = h.add(req_id, prompt, max_tokens=2)
        restored = -1
        for _ in harness._steps():
            so = h.step()
            n = so.num_scheduled_tokens.get(req_id, 0)
            if n:
                restored = req.num_computed_tokens - n
                break
            time.sleep(0.01)
        for _ in harness._steps():  # to its end: its stores land
            h.step()
            if not h.sched.requests:
                break
        h.drain()
        rows.append({"query": q, "prompt_tokens": len(prompt), "predicted": predicted, "restored": restored})
    feed()
    return {"rows": rows, "summary": index.summary(), "placeholders": placeholders}


def main() -> None:
    scenarios = json.loads(sys.argv[1])
    results: dict = {}
    import vllm

    for sc in scenarios:
        try:
            results[sc["name"]] = run_router(sc)
        except Exception as exc:  # noqa: BLE001 - reported per scenario
            results[sc["name"]] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    results["vllm_version"] = vllm.__version__
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
