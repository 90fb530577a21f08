"""The package graph has no cycle: each package imports only packages below it.

Nodes are the subpackages of `sessiongate` and its top-level modules (`errors`,
`protocol`, `cli`, ...); an edge is any import, at module level or inside a function, read
from the source with `ast` (so a lazy import that hides a cycle from Python is still one).
docs/architecture.md ("Package map") says what each package may import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "python" / "sessiongate"


def _node_of(relative: Path) -> str:
    """The graph node of a file: its subpackage, or the top-level module's name."""
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imported_modules(path: Path, module: str) -> Iterator[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            yield stem
            # `from sessiongate import errors` imports the module `sessiongate.errors`.
            yield from (f"{stem}.{alias.name}" for alias in node.names)


def package_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    nodes = {_node_of(p.relative_to(root)) for p in root.rglob("*.py")}
    nodes |= {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    graph: dict[str, set[str]] = {node: set() for node in nodes if node != "__init__"}
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        source = _node_of(relative)
        if source == "__init__":
            continue
        module = ".".join(("sessiongate", *relative.with_suffix("").parts))
        for imported in _imported_modules(path, module):
            parts = imported.split(".")
            if parts[0] != "sessiongate" or len(parts) < 2:
                continue
            target = parts[1]
            if target in graph and target != source:
                graph[source].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_graph_has_no_cycle() -> None:
    graph = package_graph()
    assert {"front", "session", "dataplane", "errors", "protocol"} <= set(graph)
    found = cycles(graph)
    assert not found, "import cycles between packages: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_kernel_imports_no_package() -> None:
    """errors, protocol and json_safety are what everyone imports, so they import nothing."""
    graph = package_graph()
    for kernel in ("errors", "protocol", "json_safety"):
        assert graph[kernel] <= {"errors", "json_safety"}, (kernel, graph[kernel])


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_the_cycle_finder_finds_cycles(
    edges: dict[str, set[str]], expected: list[list[str]]
) -> None:
    assert cycles(edges) == expected


def test_a_lazy_import_is_an_edge(tmp_path: Path) -> None:
    root = tmp_path / "sessiongate"
    (root / "alpha").mkdir(parents=True)
    (root / "beta").mkdir()
    (root / "alpha" / "__init__.py").write_text("")
    (root / "beta" / "__init__.py").write_text("from sessiongate.alpha import thing\n")
    (root / "alpha" / "use.py").write_text("def f():\n    from sessiongate.beta import x\n")
    assert cycles(package_graph(root)) == [["alpha", "beta"]]
