"""The import order of kvtier's planes (docs/interfaces.md, "Layout"):

    errors <- core <- index <- store <- local_models / router <- replay / integrations / loadgen
        <- commands <- cli

A module may import kvtier modules of its own package or of a plane below it, never above it
nor beside it (replay, integrations and loadgen do not import each other; router sits below them,
so integrations/ray routes by it). local_models
(local model directories for demos, benches and tests) imports only errors; the demo's runner
and `kvtier bench vllm` use it. core and index import only the standard library (no torch, no
numpy, no engine, no redis client); store never imports an engine,
nor does router (it reads vLLM's KV events in a router process without vLLM).
Imports inside functions count too: a lazy import is still a dependency. No import circle
between modules, lazy or not. `import kvtier` itself loads only errors and core.

Read from the source with `ast`, so the test needs no optional package installed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"

PLANES = {"errors": 0, "core": 1, "index": 2, "store": 3, "local_models": 4, "router": 4,
          "replay": 5, "integrations": 5, "loadgen": 5, "commands": 6, "cli": 7, "__main__": 8}
STDLIB_ONLY = {"core", "index"}
NO_ENGINE = {"store", "router"}
ENGINES = {"torch", "transformers", "vllm", "accelerate", "gguf", "safetensors"}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in the file. For
    `from pkg import name`, the module `pkg.name` when that is a kvtier module, else `pkg`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    for n in tree.body:  # `if TYPE_CHECKING:` / try blocks at module level are module level too
        if isinstance(n, (ast.If, ast.Try)):
            top_level |= {id(s) for s in ast.walk(n)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                full = f"{mod}.{a.name}"
                out.append((full if is_module(full) else mod, node.lineno, id(node) in top_level))
    return out


def is_module(name: str) -> bool:
    if not name.startswith("kvtier"):
        return False
    p = SRC.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file() or p.with_suffix(".c").is_file()


def plane(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def violations() -> list[str]:
    bad = []
    for path in modules():
        me = module_name(path)
        mine = plane(me)
        for target, line, top in imports(path):
            where = f"{path.relative_to(SRC.parent)}:{line}"
            root = target.split(".")[0]
            if root != "kvtier":
                if mine in STDLIB_ONLY and root not in sys.stdlib_module_names:
                    bad.append(f"{where}: {me} ({mine}) imports {target}; {mine}/ uses the standard library only")
                if mine in NO_ENGINE and root in ENGINES - {"torch", "safetensors"}:
                    bad.append(f"{where}: {me} ({mine}) imports the engine {target}")
                continue
            theirs = plane(target)
            if mine is None:  # kvtier/__init__.py: only errors and core when imported
                if top and theirs not in ("errors", "core", None):
                    bad.append(f"{where}: `import kvtier` loads {target}; export it lazily")
                continue
            if theirs is None or theirs == mine:
                continue
            if theirs not in PLANES or mine not in PLANES:
                bad.append(f"{where}: {me} imports {target}: a module outside the planes")
            elif PLANES[theirs] >= PLANES[mine]:
                bad.append(f"{where}: {me} ({mine}) imports {target} ({theirs}), which is not below it")
    return bad


def cycles() -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for path in modules():
        me = module_name(path)
        graph[me] = {t for t, _, _ in imports(path) if t.startswith("kvtier.") and is_module(t)
                     and t != me and not me.startswith(t + ".") and not t.startswith(me + ".")}
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                found.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_every_module_lives_in_a_plane() -> None:
    loose = [module_name(p) for p in modules() if plane(module_name(p)) not in PLANES and module_name(p) != "kvtier"]
    assert loose == [], f"modules outside the planes: {loose}; move them into one of {sorted(PLANES)}"


def test_imports_point_down() -> None:
    assert violations() == []


def test_no_import_circles() -> None:
    assert cycles() == []


@pytest.mark.parametrize("source, expect", [
    ("from kvtier.store.store import Store\n", "not below it"),
    ("import torch\n", "standard library only"),
    ("def f():\n    from kvtier.integrations.vllm import spec\n", "not below it"),
])
def test_the_check_bites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, expect: str) -> None:
    """A core module that imports upward (even lazily) or imports torch is reported."""
    fake = SRC / "core" / "_layer_probe.py"
    fake.write_text(source)
    try:
        assert any(expect in v for v in violations())
    finally:
        fake.unlink()


def test_a_circle_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = SRC / "core" / "_probe_a.py", SRC / "core" / "_probe_b.py"
    a.write_text("def f():\n    from kvtier.core import _probe_b\n")
    b.write_text("from kvtier.core._probe_a import f\n")
    try:
        assert ["kvtier.core._probe_a", "kvtier.core._probe_b", "kvtier.core._probe_a"] in cycles()
    finally:
        a.unlink()
        b.unlink()


# -- vLLM's private attributes live in integrations/vllm/compat.py only -------------------------
# The rule, checked on the source with `ast` (no vLLM needed):
# 1. no kvtier module but compat.py reads an attribute named in VLLM_PRIVATE (the private
#    attributes of vLLM objects kvtier has used; a new one goes into compat.py and this list);
# 2. in a module that imports vllm (at any level), other than compat.py, an attribute access
#    `x._name` (one leading underscore, not a dunder) where `x` is not `self` or `cls` must name a
#    private that kvtier itself defines (an attribute assigned on self or cls, a function, class or
#    module-level name, a class-body field, anywhere in kvtier): anything else is a private of
#    vLLM's (or another library's) object and belongs behind a named function in compat.py.
# getattr(x, "_name") counts like x._name (a string literal as the attribute).

COMPAT = "kvtier.integrations.vllm.compat"
VLLM_PRIVATE = {"_connector_worker_meta", "_load_jobs", "_transfer_events", "_manager_locked",
                "_canonical_layout"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def kvtier_private_names() -> set[str]:
    """Every private name kvtier itself defines (rule 2's allowed set)."""
    out: set[str] = set()
    for path in modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) \
                    and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                out.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
    return {n for n in out if _private(n)}


def _attribute_reads(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(receiver source, attribute name, line) of every `x.attr` and `getattr(x, "attr", ...)`."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            out.append((ast.unparse(n.value), n.attr, n.lineno))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr", "setattr") \
                and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
            out.append((ast.unparse(n.args[0]), n.args[1].value, n.lineno))
    return out


def vllm_private_reads() -> list[str]:
    allowed = kvtier_private_names() - VLLM_PRIVATE
    bad = []
    for path in modules():
        me = module_name(path)
        if me == COMPAT:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        uses_vllm = any(t.split(".")[0] == "vllm" for t, _, _ in imports(path))
        for receiver, attr, line in _attribute_reads(tree):
            where = f"{path.relative_to(SRC.parent)}:{line}"
            if attr in VLLM_PRIVATE:
                bad.append(f"{where}: {receiver}.{attr} is vLLM's private state; read it through compat.py")
            elif uses_vllm and _private(attr) and receiver not in ("self", "cls") and attr not in allowed:
                bad.append(f"{where}: {receiver}.{attr} is a private attribute kvtier does not define "
                           "(vLLM's?); reach it through a named function in compat.py")
    return bad


def test_vllm_private_attributes_only_in_compat() -> None:
    assert vllm_private_reads() == []


@pytest.mark.parametrize("source", [
    "def f(w):\n    return w._connector_worker_meta\n",  # rule 1, even without a vllm import
    "import vllm\n\ndef f(h):\n    return h._some_vllm_state\n",  # rule 2
    "import vllm\n\ndef f(h):\n    return getattr(h, '_some_vllm_state', None)\n",
])
def test_the_private_attribute_check_bites(source: str) -> None:
    fake = SRC / "integrations" / "vllm" / "_private_probe.py"
    fake.write_text(source)
    try:
        assert any("_private_probe.py" in v for v in vllm_private_reads())
    finally:
        fake.unlink()


# docs/interfaces.md's layout block against the tree (tests/docs_layout.py): here, because the
# probe modules above sit in src/kvtier for a moment, and pytest-xdist keeps a module on one worker
sys.path.insert(0, str(Path(__file__).parent))
import docs_layout  # noqa: E402


def test_the_layout_lists_every_module_and_only_modules_that_exist() -> None:
    docs_layout.check_the_layout_lists_every_module_and_only_modules_that_exist()


def test_every_directory_under_src_is_a_package() -> None:
    docs_layout.check_every_directory_under_src_is_a_package()


@pytest.mark.parametrize("line, problem", [
    ("  core/\n      plan.py   two levels below core/", "nested under no package"),
    ("  cor e.py   a space in the name", "neither an entry"),
    ("   odd.py   an odd indent", "neither an entry"),
    ("  errors.py   once\n  errors.py   twice", "twice"),
])
def test_a_malformed_block_fails_loudly(line: str, problem: str) -> None:
    docs_layout.check_a_malformed_block_fails_loudly(line, problem)
