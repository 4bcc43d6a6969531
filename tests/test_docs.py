"""The design map is tested: every module of the package is named in its package's docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import lightning_haiscale

# ---- the design map: each package's docstring names its modules --------------------------------------------------

PACKAGE = Path(lightning_haiscale.__file__).parent
LISTED = re.compile(r"^\s*- ``(\w+)``", re.M)


def _packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_package_docstring_names_every_module(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    modules |= {p.parent.name for p in package.glob("*/__init__.py")}
    listed = set(LISTED.findall(docstring))
    assert modules <= listed, f"{package.name}/__init__.py's docstring lacks a line for {sorted(modules - listed)}"
    assert listed <= modules, f"{package.name}/__init__.py's docstring lists what is gone: {sorted(listed - modules)}"
