"""The native engine ``lightning_haiscale._C``, loaded on first use.

[Note: importing without the engine]
The pure-Python parts (registering the strategies, ``cpu_offload``, the pipeline schedules) must import
where the C++ extension is missing: a source checkout before ``setup.py build_ext``, or an install made
with another Python (the extension's file name carries its Python's ABI tag, so that Python cannot load
it). So nothing imports ``_C`` at module level: whatever needs the engine calls :func:`load_engine`,
which turns the bare ``ModuleNotFoundError`` into an ``ImportError`` that says which case this is and
which command builds the engine. ``Communicator`` calls it before any collective, so every rank fails
the same way at the same point instead of leaving its peers waiting.

[Note: forcing the reduce kernels]
``HFREDUCE_KERNELS`` (``KERNELS_ENV``) chooses the engine's SIMD reduce kernels: ``generic`` (portable C++,
what a CPU without AVX2 runs), ``avx2``, ``avx512``, or ``best`` (the default: the widest this CPU has). The
engine reads it once, when ``_C`` is imported; a set this CPU cannot run, or an unknown name, fails that
import with a message naming the sets it can run (an ``ImportError`` raised as it is, not explained as a
missing build). Every set gives the same bits (tests/hfreduce/test_kernels.py checks each against torch), so
forcing one shows that a result does not depend on the machine: ``HFREDUCE_KERNELS=generic make test``.
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import ModuleType

ENGINE_MODULE = "lightning_haiscale._C"
KERNELS_ENV = "HFREDUCE_KERNELS"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def load_engine() -> ModuleType:
    """Returns the native engine; without it raises an ``ImportError`` naming the cause and the fix."""
    try:
        return importlib.import_module(ENGINE_MODULE)
    except ImportError as exc:
        if KERNELS_ENV in str(exc):  # built and loadable; the kernel choice was refused with its own message
            raise
        raise ImportError(explain_missing_engine(exc, _PACKAGE_DIR), name=ENGINE_MODULE) from exc


def simd_level() -> str:
    """The reduce kernels' instruction set, chosen at run time: ``"avx512"``, ``"avx2"`` or ``"generic"``."""
    return load_engine().simd_level()


def simd_levels() -> list[str]:
    """The reduce kernel sets this CPU runs, lowest first (``"generic"`` always): what ``HFREDUCE_KERNELS`` takes."""
    return load_engine().simd_levels()


def engine_cpu_seconds() -> float:
    """CPU time this process's engine worker threads have used so far (every communicator's), in seconds.

    What the asynchronous collectives cost, apart from the thread that queued them: hai_ddp's benchmark
    compares it with the step time. Read from ``/proc/self/task/<tid>/schedstat`` (nanoseconds) of each
    thread named ``_C.WORKER_THREAD_NAME``; 0.0 where ``/proc`` has no such file (not Linux).
    """
    name = load_engine().WORKER_THREAD_NAME
    total_ns = 0
    for task in Path("/proc/self/task").glob("*"):
        try:
            if (task / "comm").read_text().strip() == name:
                total_ns += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile, or no schedstat
            continue
    return total_ns / 1e9


def explain_missing_engine(exc: ImportError, package_dir: Path) -> str:
    """Why ``_C`` did not import from ``package_dir`` (the installed ``lightning_haiscale``) and how to build it."""
    built = sorted(p.name for p in package_dir.glob("_C.*so"))
    loadable = [name for name in built if name in {f"_C{suffix}" for suffix in EXTENSION_SUFFIXES}]
    python = f"Python {sys.version_info.major}.{sys.version_info.minor}"
    if built and not loadable:
        cause = (
            f"it was built for another Python ({', '.join(built)}), and {python} ({sys.executable}) "
            f"loads only _C{EXTENSION_SUFFIXES[0]}"
        )
    elif built:
        cause = f"{', '.join(built)} is there but failed to load ({exc})"
    else:
        cause = f"it was not built (no _C*.so in {package_dir})"
    source_tree = package_dir.parent
    if (source_tree / "setup.py").is_file():
        fix = (
            f"in {source_tree} with this Python: `{sys.executable} setup.py build_ext --inplace` "
            f"(or `make install`, or `{sys.executable} -m pip install --no-build-isolation -e .`)"
        )
    else:
        fix = (
            f"by reinstalling lightning-haiscale from its source folder or sdist with this Python: "
            f"`{sys.executable} -m pip install --no-build-isolation --force-reinstall <folder or sdist>`"
        )
    return (
        f"lightning_haiscale's native engine ({ENGINE_MODULE}) cannot be imported: {cause}. "
        f"Build it {fix}; it needs g++ with C++17 (tested: GCC 12) and pybind11 >= 2.12."
    )
