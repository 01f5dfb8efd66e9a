"""One module per `kvtier` subcommand; see kvtier.cli for the contract.

The parser class and the module finder live here, not in `kvtier.cli`, so `bench` (a command
that has subcommands of its own) uses them without importing the CLI above it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as every kvtier error
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def available(package: str, names: tuple[str, ...]) -> list[tuple[str, object]]:
    out = []
    for name in names:
        modname = f"{package}.{name}"
        if importlib.util.find_spec(modname) is None:
            continue
        out.append((name, importlib.import_module(modname)))
    return out
