"""The repository's import graph, read statically (ast): no import circle, and no import from a higher floor.

Floors, top to bottom: tidal -> loadgen -> services -> shared -> gpu_ext; a module may import its own
floor or a lower one. Every import counts, at module level or inside a function (a lazy import is still
a dependency), except those under `if TYPE_CHECKING:` (never executed).
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("tidal", "loadgen", "services", "shared", "gpu_ext")  # top to bottom


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the floors' packages."""
    found: dict[str, Path] = {}
    for top in FLOORS:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import node, skipping the bodies of `if TYPE_CHECKING:` (their `else:` still counts)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that `name` is or lies in (None: outside the repository's floors)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the repository modules it imports."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, else a name in `base`
            for name in names:
                owner = _owner(name, modules)
                if owner is not None and owner != module:
                    targets.add(owner)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def floor(module: str) -> int:
    """0 for the top floor (tidal), larger further down."""
    return FLOORS.index(module.split(".")[0])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                  if floor(target) < floor(source))


def test_the_graph_reader_sees_lazy_relative_and_submodule_imports(tmp_path: Path) -> None:
    """The reader itself, on a small tree: a circle through a function-level import, an upward import
    through a relative one, and a TYPE_CHECKING import that does not count."""
    files = {
        "tidal/__init__.py": "", "tidal/top.py": "import shared.low\n",
        "shared/__init__.py": "", "shared/low.py": "def f():\n    from shared import other\n",
        "shared/other.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tidal.top\n"
                           "from .low import f\n",
        "services/__init__.py": "", "services/svc.py": "from shared.low import f\n",
        "gpu_ext/__init__.py": "", "gpu_ext/ext.py": "from ..services import svc\n",
        "loadgen/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(module_files(tmp_path))
    assert graph["tidal.top"] == {"shared.low"} and graph["shared.other"] == {"shared.low"}
    assert circles(graph) == [["shared.low", "shared.other"]]
    assert upward_imports(graph) == ["gpu_ext.ext -> services.svc"]


def test_no_import_circle() -> None:
    found = circles(import_graph(module_files()))
    assert found == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_from_a_higher_floor() -> None:
    found = upward_imports(import_graph(module_files()))
    assert found == [], f"upward imports (floors {' -> '.join(FLOORS)}):\n" + "\n".join(found)
