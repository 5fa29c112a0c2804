"""No import cycles anywhere in the shipped packages.

Every import statement counts: module-level ones, ones inside functions and ones under
``if TYPE_CHECKING:``. A cycle hidden behind a lazy import still ties the modules together
(neither can be understood, tested or moved without the other). ``from pkg.mod import x``
is an arrow to ``pkg.mod``; ``from pkg import x`` is an arrow to ``pkg`` (its ``__init__``),
unless ``x`` is a submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: import root -> folder of the checkout
PACKAGES = {
    "daemon": REPO / "daemon",
    "sandbox": REPO / "sandbox",
    "tools": REPO / "tools",
    "federation": REPO / "federation",
    "trainers": REPO / "contrib" / "trainers",
}
NAMESPACE = "rolloutd."


def _modules() -> dict[str, Path]:
    found = {}
    for root, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [root, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _ours(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that ``name`` names (namespace prefix stripped), else None."""
    if name.startswith(NAMESPACE):
        name = name[len(NAMESPACE):]
    first, _, rest = name.partition(".")
    if first == "contrib":  # contrib/trainers, imported from a checkout
        name = rest
    return name if name in modules else None


def _arrows(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _ours(alias.name, modules)
                if target:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            target = _ours(source, modules)
            for alias in node.names:
                sub = _ours(f"{source}.{alias.name}", modules)
                if sub:
                    out.add(sub)
                elif target:
                    out.add(target)
    out.discard(module)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _arrows(m, p, modules) for m, p in modules.items()}
    assert len(graph) > 50
    assert _cycles(graph) == []
