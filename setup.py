"""Builds the native collective engine `lightning_haiscale._C` (C++17, pybind11, no libtorch)."""

import platform
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

SOURCES = [
    "csrc/shm_segment.cpp",
    "csrc/communicator.cpp",
    "csrc/reduce_kernels.cpp",
    "csrc/bindings.cpp",
]

extra_compile_args = ["-O3", "-fvisibility=hidden", "-Wno-maybe-uninitialized"]  # GCC 12 misreports _mm512_undefined
if platform.machine() in ("x86_64", "AMD64"):
    # Baseline x86-64 code; the reduce kernels are compiled per instruction set (`#pragma GCC target`)
    # and picked at run time with __builtin_cpu_supports.
    extra_compile_args += ["-mtune=generic"]

setup(
    ext_modules=[
        Pybind11Extension(
            "lightning_haiscale._C",
            SOURCES,
            include_dirs=["csrc"],
            depends=sorted(glob("csrc/*.h")),  # rebuild when a header changes
            cxx_std=17,
            extra_compile_args=extra_compile_args,
            libraries=["rt"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
