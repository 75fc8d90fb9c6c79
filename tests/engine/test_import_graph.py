"""No import cycle between the engine's modules (every import statement counts, TYPE_CHECKING ones too)."""

from __future__ import annotations

import ast
from pathlib import Path

import ember.engine

PACKAGE = "ember.engine"


def engine_import_graph() -> dict[str, set[str]]:
    root = Path(ember.engine.__file__).parent
    modules = {f"{PACKAGE}.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_engine_modules_import_each_other_without_a_cycle():
    graph = engine_import_graph()
    assert len(graph) > 15 and f"{PACKAGE}.kv_cache" in graph[f"{PACKAGE}.sessions"]  # the walk sees real edges
    assert f"{PACKAGE}.sessions" not in graph[f"{PACKAGE}.kv_cache"]  # the pool knows nothing of sessions
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
