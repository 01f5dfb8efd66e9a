"""`kvtier SUBCOMMAND`: one module per subcommand under `kvtier.commands`.

Each command module exposes `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`,
and imports heavy libraries (torch, transformers, vllm) inside `run` only, so `kvtier plan`
starts in a blink. Exit codes: 0 ok, 1 failure, 2 usage (bad arguments or bad input files).
Errors are one line on stderr starting `error:`; tracebacks only with KVTIER_DEBUG=1.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvtier.commands import Parser, available
from kvtier.errors import ConfigError, KvtierError

# Order is the order `kvtier --help` lists them. A name whose module does not exist is skipped,
# so a command lands with its module and nothing else has to change.
COMMANDS = ("plan", "demo", "replay", "inspect", "check", "bench", "events")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvtier", description="Hybrid-aware tiered KV-cache offloading.")
    from kvtier import __version__

    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", parser_class=Parser)
    sub.required = True
    for name, mod in available("kvtier.commands", COMMANDS):
        p = sub.add_parser(name, help=getattr(mod, "HELP", ""), description=getattr(mod, "HELP", ""))
        mod.add_arguments(p)  # type: ignore[attr-defined]
        p.set_defaults(_run=mod.run)  # type: ignore[attr-defined]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except ConfigError as exc:
        if os.environ.get("KVTIER_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KvtierError as exc:
        if os.environ.get("KVTIER_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
