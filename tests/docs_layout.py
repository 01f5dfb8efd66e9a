"""docs/interfaces.md's "Layout and layering" block matches the tree under src/kvtier.

The block is the first fenced block after that heading. It starts with `src/kvtier/` at column 0;
every other line is either an entry or a continuation:
- an entry: indented by two spaces per level below src/kvtier/, then a name (`x.py`, `x.c`, or
  `x/` for a package, which stands for its `__init__.py`), then the module's job;
- a continuation of the job above: indented to the job's column (CONTINUATION_INDENT or more).
A line that is neither fails the test, so a mistyped entry is never skipped in silence.

Its tests run from tests/test_layers.py, in the same module (one pytest worker, one at a time) as
the layering tests that place probe modules in src/kvtier for a moment: a check of the tree on
another worker would see them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvtier"
DOC = ROOT / "docs" / "interfaces.md"
HEADING = "## Layout and layering"
CONTINUATION_INDENT = 20  # entries nest at most a few levels (indent < 20); their jobs start at 28
ENTRY = re.compile(r"(?P<name>[A-Za-z0-9_]+(?:\.py|\.c|/))(?:\s|$)")


def layout_block(text: str) -> list[str]:
    """The lines inside the first fenced block after HEADING."""
    after = text.split(HEADING, 1)
    assert len(after) == 2, f"{DOC} has no {HEADING!r} section"
    lines = after[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[start + 1:end]


def listed(block: list[str]) -> set[str]:
    """Paths relative to src/kvtier that the block lists (`pkg/__init__.py` for a package line)."""
    assert block and block[0].split()[0] == "src/kvtier/", f"the block must start with src/kvtier/: {block[:1]}"
    out = {"__init__.py"}
    parents: list[str] = []  # the packages above the current line, by depth
    for n, line in enumerate(block[1:], start=2):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent >= CONTINUATION_INDENT:
            continue
        m = ENTRY.match(line, indent)
        assert m and indent % 2 == 0 and indent >= 2, (
            f"{DOC.name} layout line {n} is neither an entry ('  ' x depth, then name.py, name.c or "
            f"name/) nor a continuation (indented {CONTINUATION_INDENT}+): {line!r}")
        depth = indent // 2 - 1
        assert depth <= len(parents), f"{DOC.name} layout line {n} is nested under no package: {line!r}"
        del parents[depth:]
        name = m["name"]
        path = "/".join([*parents, name.rstrip("/")])
        if name.endswith("/"):
            parents.append(name.rstrip("/"))
            path += "/__init__.py"
        assert path not in out, f"{DOC.name} lists {path} twice (line {n})"
        out.add(path)
    return out


def in_tree() -> set[str]:
    return {p.relative_to(SRC).as_posix() for pattern in ("*.py", "*.c") for p in SRC.rglob(pattern)
            if "__pycache__" not in p.parts}


def check_the_layout_lists_every_module_and_only_modules_that_exist() -> None:
    doc, tree = listed(layout_block(DOC.read_text())), in_tree()
    missing, stale = sorted(tree - doc), sorted(doc - tree)
    assert not missing and not stale, (
        f"docs/interfaces.md's layout block differs from src/kvtier: not listed {missing}; "
        f"listed but absent {stale}. One line per module, its job in a line")


def check_every_directory_under_src_is_a_package() -> None:
    """A directory without __init__.py would be listed as a package that is not one."""
    dirs = [d for d in SRC.rglob("*") if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))]
    assert [d for d in dirs if not (d / "__init__.py").is_file()] == []


def check_a_malformed_block_fails_loudly(line: str, problem: str) -> None:
    with pytest.raises(AssertionError, match=problem):
        listed(["src/kvtier/   the package", *line.splitlines()])
