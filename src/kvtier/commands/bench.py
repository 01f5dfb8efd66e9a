"""`kvtier bench NAME`: benchmarks that print ratios measured side by side in one run.

Each benchmark is a module `kvtier.commands.bench_<name>` with the same contract as a
command module (HELP, add_arguments, run). Noisy machines: benchmarks report medians of
several rounds and ratios, never one absolute time.
"""

from __future__ import annotations

import argparse

from kvtier.commands import Parser, available

BENCHES = ("store", "ttft", "vllm", "serve", "redis", "replay", "route")

HELP = "benchmarks: kvtier against a plain baseline, as ratios (store, ttft, vllm, serve, redis, route)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", parser_class=Parser)
    sub.required = True
    for name, mod in available("kvtier.commands", tuple(f"bench_{b}" for b in BENCHES)):
        short = name.removeprefix("bench_")
        p = sub.add_parser(short, help=getattr(mod, "HELP", ""), description=getattr(mod, "HELP", ""))
        mod.add_arguments(p)  # type: ignore[attr-defined]
        p.set_defaults(_run=mod.run)  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> int:  # replaced by the chosen bench's run
    raise AssertionError("unreachable: argparse sets _run to the chosen benchmark")
