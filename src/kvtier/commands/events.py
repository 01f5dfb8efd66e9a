"""`kvtier events --zmq [NAME=]ENDPOINT ... [--prompt FILE]`: follow engines' KV event streams.

Subscribes to one or many vLLM engines' ZMQ KV event publishers (`--kv-events-config`) with
`kvtier.router`, prints what each engine's kvtier tiers hold (chunks per tier and group, each
group's residency rule, what was skipped, dropped or reset) every `--every` seconds, and, with
`--prompt FILE` (a JSON list of token ids), the longest prefix each engine can restore in every
group. `--replay [NAME=]ENDPOINT` names an engine's `replay_endpoint`, asked to fill a gap.
`--seconds` stops after that long (default: until interrupted). `--json` prints one JSON object
per report. Text from the events is printed with its control characters escaped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

HELP = "follow vLLM engines' KV events: what each kvtier tier holds, longest restorable prefix"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zmq", metavar="[NAME=]ENDPOINT", action="append", required=True,
                   help="an engine's ZMQ publisher, e.g. tcp://10.0.0.5:5557, or bind:tcp://127.0.0.1:5557 "
                        "where the engine connects (repeat for more engines)")
    p.add_argument("--replay", metavar="[NAME=]ENDPOINT", action="append",
                   help="an engine's replay endpoint (vLLM's kv_events_config replay_endpoint), named as in "
                        "--zmq or by position, e.g. tcp://10.0.0.5:5558: a gap in its events is replayed, "
                        "not reset")
    p.add_argument("--topic", default="", help="the publisher's topic (vLLM's kv_events_config topic)")
    p.add_argument("--prompt", metavar="FILE", help="a JSON list of token ids to match each report")
    p.add_argument("--every", type=float, default=2.0, help="seconds between reports (default 2)")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (default: never)")
    p.add_argument("--json", action="store_true", help="one JSON object per report")


def _endpoints(values: list[str], flag: str = "--zmq") -> dict[str, str]:
    from kvtier.errors import ConfigError

    out: dict[str, str] = {}
    for i, v in enumerate(values):
        name, sep, endpoint = v.partition("=")
        if not sep:
            name, endpoint = f"engine{i}", v
        if "://" not in endpoint:
            raise ConfigError(f"{flag} {v!r} is not a ZMQ endpoint; give e.g. tcp://127.0.0.1:5557 "
                              "(vLLM's kv_events_config endpoint, with the host the engine runs on)")
        out[name] = endpoint
    return out


def _prompt(path: str | None) -> list[int] | None:
    from kvtier.errors import ConfigError

    if path is None:
        return None
    try:
        with open(path) as f:
            tokens = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--prompt {path!r} cannot be read as JSON ({exc}); give a file holding a "
                          "JSON list of token ids") from None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ConfigError(f"--prompt {path!r} must hold a JSON list of token ids (integers)")
    return tokens


def run(args: argparse.Namespace) -> int:
    from kvtier.router import PrefixIndex, Subscriber

    endpoints = _endpoints(args.zmq)
    tokens = _prompt(args.prompt)
    index = PrefixIndex()
    replay = _endpoints(args.replay or [], "--replay")
    sub = Subscriber(index, endpoints, args.topic, replay=replay)
    deadline = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")
    try:
        while True:
            time.sleep(max(0.05, min(args.every, deadline - time.monotonic())))
            report = {"batches": sub.batches, "engines": index.summary()}
            if tokens is not None:
                report["restorable"] = [{"engine": r.engine, "tokens": r.tokens, "tiers": list(r.tiers)}
                                        for r in index.longest_prefix(tokens)]
            if args.json:
                print(json.dumps(report), flush=True)
            else:
                _print(report)
            if time.monotonic() >= deadline:
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        sub.close()


def _print(report: dict) -> None:
    out = sys.stdout
    out.write(f"{report['batches']} event batches\n")
    for name, e in report["engines"].items():
        out.write(_safe(f"  {name}: chunk {e['chunk_tokens']} tokens") + "\n")
        for g, info in e["groups"].items():
            held = ", ".join(f"{t} {n}" for t, n in info["chunks"].items()) or "nothing"
            out.write(_safe(f"    group {g} ({info['rule']}): {held}") + "\n")
        if e.get("counts"):
            out.write("    " + ", ".join(f"{k} {n}" for k, n in sorted(e["counts"].items())) + "\n")
    for r in report.get("restorable", []):
        out.write(_safe(f"  restorable on {r['engine']}: {r['tokens']} tokens ({', '.join(r['tiers']) or '-'})") + "\n")
    out.flush()


def _safe(text: str) -> str:
    """`text` with its control characters escaped: tier names and kinds come from the engines'
    events, and an escape sequence must not reach the terminal."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
