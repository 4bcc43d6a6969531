"""The plain FSDP layer's modules import each other one way only and never take another module's private
names (issue #14: the checkpoint code used to reach into the wrapper, so ``state_dict`` and
``fully_sharded`` imported each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_haiscale.fsdp

PACKAGE = "lightning_haiscale.fsdp"
FOLDER = Path(lightning_haiscale.fsdp.__file__).parent


def _imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every import statement in ``path``, wherever it is (``TYPE_CHECKING`` included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return found


def _graph() -> dict[str, set[str]]:
    modules = {f"{PACKAGE}.{p.stem}": p for p in FOLDER.glob("*.py") if p.stem != "__init__"}
    return {name: {m for m, _ in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_fsdp_modules_import_each_other_one_way() -> None:
    assert _cycle(_graph()) is None, f"import cycle: {' -> '.join(_cycle(_graph()) or [])}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_fsdp_modules_take_no_private_names_from_the_package() -> None:
    private = [
        (path.name, module, name)
        for path in FOLDER.glob("*.py")
        for module, name in _imports(path)
        if module.startswith("lightning_haiscale") and name.startswith("_")
    ]
    assert private == []
