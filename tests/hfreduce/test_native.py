"""Without the native engine the pure-Python parts import, and the engine's users say how to build it.

Each case copies the installed package into a temporary folder (no ``setup.py`` beside it, as in a
site-packages install), with no extension or with one built for another Python, and imports it in a
fresh interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning_haiscale
from lightning_haiscale.hfreduce._native import explain_missing_engine

PACKAGE = Path(lightning_haiscale.__file__).parent

USER_SCRIPT = textwrap.dedent(
    """
    import sys
    # An editable install of the checkout (`make`) would find its _C for the copy: drop its finder.
    sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    import lightning_haiscale, lightning_haiscale.cpu_offload, lightning_haiscale.pipeline
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning_haiscale.cpu_offload import CPUOffload
    from lightning_haiscale.hfreduce import Communicator
    assert "hai_ddp" in StrategyRegistry and "hai_fsdp" in StrategyRegistry
    assert lightning_haiscale.__file__.startswith({root!r})
    try:
        Communicator()
    except ImportError as exc:
        print(exc)
    else:
        raise SystemExit("Communicator() without the engine did not raise ImportError")
    """
)


def _install_copy(root: Path, engine_name: str | None) -> None:
    shutil.copytree(PACKAGE, root / "lightning_haiscale", ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    if engine_name is not None:
        shutil.copy(next(PACKAGE.glob("_C.*.so")), root / "lightning_haiscale" / engine_name)


def _run_user_script(root: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", USER_SCRIPT.format(root=str(root))],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_without_engine_pure_python_parts_import_and_the_engine_says_how_to_build(tmp_path: Path) -> None:
    _install_copy(tmp_path, engine_name=None)
    message = _run_user_script(tmp_path)
    assert "it was not built" in message
    assert "pip install --no-build-isolation --force-reinstall" in message


def test_engine_built_for_another_python_is_named(tmp_path: Path) -> None:
    _install_copy(tmp_path, engine_name="_C.cpython-39-x86_64-linux-gnu.so")
    message = _run_user_script(tmp_path)
    assert "built for another Python (_C.cpython-39-x86_64-linux-gnu.so)" in message
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in message


def test_in_a_source_tree_the_fix_is_build_ext(tmp_path: Path) -> None:
    (tmp_path / "setup.py").touch()
    (tmp_path / "lightning_haiscale").mkdir()
    message = explain_missing_engine(ModuleNotFoundError("No module named 'x'"), tmp_path / "lightning_haiscale")
    assert "it was not built" in message
    assert f"in {tmp_path} with this Python: `{sys.executable} setup.py build_ext --inplace`" in message
