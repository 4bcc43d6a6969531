"""The package's floors, checked on its import statements (issue 34): the engine imports nothing of the package;
the plain-PyTorch layer never imports Lightning nor anything above it; the adapter core nothing above it; the
Lightning faces do not import each other; no module takes another module's private names; and no two modules
import each other in a circle (issue #14: the checkpoint code used to reach into the FSDP wrapper, so
``state_dict`` and ``fully_sharded`` imported each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_haiscale

ROOT = Path(lightning_haiscale.__file__).parent

ENGINE = {"_C", "hfreduce"}
PLAIN = {"ddp", "fsdp", "pipeline", "cpu_offload", "use_counts", "clip_grad", "grad_sync", "rank_layout"}
CORE = {"adapter"}  # the adapter core: below both Lightning faces, above the plain layer
FACES = {"strategies", "fabric", "callbacks"}
TOOLS = {"testing"}  # helpers for tests and benchmarks: may import the engine, the plain layer and Lightning
BELOW = {"engine": set(), "plain": ENGINE | PLAIN, "core": ENGINE | PLAIN | CORE}
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")

def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every import statement in ``path``, wherever it is (``TYPE_CHECKING`` included),
    relative imports resolved."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{module}" if module else base
            found += [(module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return found


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _room(module: str) -> str:
    """The top-level part of the package a module belongs to (``lightning_haiscale.fsdp.wrap`` -> ``fsdp``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _floor(room: str) -> str:
    for name, rooms in (("engine", ENGINE), ("plain", PLAIN), ("core", CORE), ("face", FACES), ("tool", TOOLS)):
        if room in rooms:
            return name
    raise AssertionError(f"lightning_haiscale.{room} is on no floor: add it to one in tests/test_layering.py")


def _violations() -> list[str]:
    found = []
    for module, path in _modules().items():
        room = _room(module)
        if not room:
            continue  # the package's __init__ registers the strategies: it sits on top of everything
        floor = _floor(room)
        for target, _ in _imports(path):
            if target.split(".")[0] in LIGHTNING and floor in ("engine", "plain"):
                found.append(f"{module} imports {target}: the {floor} layer knows nothing of Lightning")
            if not target.startswith("lightning_haiscale."):
                continue
            other = _room(target)
            if other == room:
                continue
            if floor in BELOW and other not in BELOW[floor]:
                found.append(f"{module} imports {target}: the {floor} layer imports only {sorted(BELOW[floor])}")
            if floor == "face" and other in FACES:
                found.append(f"{module} imports {target}: a Lightning face imports no other face")
            if floor == "tool" and _floor(other) in ("face", "core"):
                found.append(f"{module} imports {target}: the test tools stay below the faces")
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {m for m, _ in _imports(path) if m in modules and m != name and not m.startswith(name + ".")}
        for name, path in modules.items()
        if path.name != "__init__.py"  # a package's __init__ re-exports its modules: not an edge of the design
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
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


def test_every_floor_imports_only_downward() -> None:
    assert _violations() == []


def test_modules_import_each_other_one_way() -> None:
    found = _cycle(_graph())
    assert found is None, f"import cycle: {' -> '.join(found or [])}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_modules_take_no_private_names_from_each_other() -> None:
    private = [
        (_module_name(path), module, name)
        for path in ROOT.rglob("*.py")
        for module, name in _imports(path)
        if module.startswith("lightning_haiscale") and name.startswith("_") and name != "_C"
    ]
    assert private == []


def test_the_checks_see_a_plain_module_importing_lightning(tmp_path: Path, monkeypatch) -> None:
    """The floor check is not vacuous: a plain module that imports Lightning and a face, a face that imports another
    face, and the adapter core importing a face are reported."""
    import sys

    fake = tmp_path / "lightning_haiscale"
    (fake / "fsdp").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "fsdp" / "__init__.py").write_text("")
    (fake / "fsdp" / "bad.py").write_text("import lightning.pytorch\nfrom lightning_haiscale.strategies import x\n")
    for room, target in (("fabric", "strategies.fsdp"), ("adapter", "fabric.shared")):
        (fake / room).mkdir()
        (fake / room / "__init__.py").write_text("")
        (fake / room / "bad.py").write_text(f"from lightning_haiscale.{target} import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert len(_violations()) == 4
