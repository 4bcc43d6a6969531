"""The SIMD reduce kernels against torch, bit for bit (16-bit types: fp32 sum, one rounding), on every kernel set
this CPU runs (``kernels``: generic, avx2, avx512), and ``HFREDUCE_KERNELS``, which forces one."""

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from lightning_haiscale import _C
from lightning_haiscale.hfreduce import supports_dtype
from lightning_haiscale.hfreduce.dtypes import engine_dtype

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
SIZES = [0, 1, 7, 15, 16, 17, 1000, 4097]
LEVELS = ["generic", "avx2", "avx512"]


@pytest.fixture(params=LEVELS)
def kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Dispatches to one kernel set for the test (skipped where this CPU cannot run it), then back."""
    if request.param not in _C.simd_levels():
        pytest.skip(f"this CPU runs {_C.simd_levels()}, not {request.param}")
    before = _C.simd_level()
    _C.set_simd_level(request.param)
    try:
        yield request.param
    finally:
        _C.set_simd_level(before)


def _random(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(-(2**20), 2**20, (n,), generator=g, dtype=dtype)


def _reference(srcs: list[torch.Tensor], divisor: float) -> torch.Tensor:
    dtype = srcs[0].dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = srcs[0].to(wide).clone()
    for s in srcs[1:]:
        acc += s.to(wide)
    if divisor != 1.0:
        acc /= divisor
    return acc.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4])
def test_reduce_matches_torch(dtype: torch.dtype, n: int, nsrc: int, kernels: str) -> None:
    srcs = [_random(n, dtype, seed) for seed in range(nsrc)]
    dst = torch.empty(n, dtype=dtype)
    _C.reduce(engine_dtype(dtype), dst.data_ptr(), [s.data_ptr() for s in srcs], n, 1.0)
    assert torch.equal(dst, _reference(srcs, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_average_divides_once(dtype: torch.dtype, kernels: str) -> None:
    srcs = [_random(1031, dtype, seed) for seed in range(3)]
    dst = torch.empty(1031, dtype=dtype)
    _C.reduce(engine_dtype(dtype), dst.data_ptr(), [s.data_ptr() for s in srcs], 1031, 3.0)
    assert torch.equal(dst, _reference(srcs, 3.0))


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan(kernels: str) -> None:
    # 1 + 2^-8 is halfway between two bf16 values: it rounds to the even one (1.0).
    a = torch.tensor([1.0, float("nan"), 1.0], dtype=torch.bfloat16)
    b = torch.tensor([2.0**-8, 1.0, 3 * 2.0**-8], dtype=torch.bfloat16)
    dst = torch.empty(3, dtype=torch.bfloat16)
    _C.reduce(engine_dtype(torch.bfloat16), dst.data_ptr(), [a.data_ptr(), b.data_ptr()], 3, 1.0)
    assert dst[0].item() == 1.0
    assert torch.isnan(dst[1])
    assert dst[2].item() == 1.0 + 2 * 2.0**-7


def test_bad_arguments_raise_instead_of_crashing() -> None:
    with pytest.raises(TypeError, match="DType"):  # a dtype is the engine's enum, never a bare integer
        _C.reduce(0, 1, [1], 1, 1.0)
    with pytest.raises(ValueError, match="null"):
        _C.reduce(_C.DType.FLOAT32, 0, [0], 4, 1.0)
    with pytest.raises(ValueError, match="avg"):
        x = torch.zeros(4, dtype=torch.int32)
        _C.reduce(engine_dtype(torch.int32), x.data_ptr(), [x.data_ptr()], 4, 2.0)


def test_simd_level_is_reported() -> None:
    assert _C.simd_level() in _C.simd_levels()
    assert _C.simd_levels() == LEVELS[: len(_C.simd_levels())]  # lowest first, generic always


def _engine_in_a_process(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HFREDUCE_KERNELS": value}
    code = "from lightning_haiscale.hfreduce import simd_level; print(simd_level())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("level", [*LEVELS, "best"])
def test_the_environment_variable_forces_a_kernel_set(level: str) -> None:
    """What a user sets (``HFREDUCE_KERNELS=generic make test``): read when the engine is imported."""
    best = _C.simd_levels()[-1]
    done = _engine_in_a_process(level)
    if level in _C.simd_levels() or level == "best":
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == (best if level == "best" else level)
    else:  # a set this CPU lacks: the import fails, naming what it runs
        assert f"HFREDUCE_KERNELS={level} asks for the {level} reduce kernels" in done.stderr
        assert f"it runs: {', '.join(_C.simd_levels())}" in done.stderr


def test_a_bad_kernel_name_fails_at_import_and_at_set() -> None:
    done = _engine_in_a_process("sse4")
    assert done.returncode != 0
    assert "HFREDUCE_KERNELS=sse4 is not a kernel set; choose one of: generic, avx2, avx512, best" in done.stderr
    with pytest.raises(ValueError, match="'avx9' is not a kernel set"):
        _C.set_simd_level("avx9")


@pytest.mark.parametrize("dtype", DTYPES)
def test_destination_may_alias_any_source(dtype: torch.dtype, kernels: str) -> None:
    srcs = [_random(3001, dtype, seed) for seed in range(3)]
    expected = _reference(srcs, 1.0)
    _C.reduce(engine_dtype(dtype), srcs[2].data_ptr(), [s.data_ptr() for s in srcs], 3001, 1.0)
    assert torch.equal(srcs[2], expected)


def test_engine_dtypes_are_torch_dtypes() -> None:
    """The engine's DType enum is the one list of supported dtypes; each member names a torch dtype."""
    assert [supports_dtype(d) for d in DTYPES] == [True] * len(DTYPES)
    assert not supports_dtype(torch.bool) and not supports_dtype(torch.complex64)
    assert [engine_dtype(d).name for d in DTYPES] == ["FLOAT32", "FLOAT64", "FLOAT16", "BFLOAT16", "INT32", "INT64"]
    assert len(_C.DType.__members__) == len(DTYPES)
    with pytest.raises(TypeError, match=r"does not support dtype torch\.bool; supported: float32, float64"):
        engine_dtype(torch.bool)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [1.0, 3.0])
def test_every_destination_gets_the_result_in_one_pass(dtype: torch.dtype, divisor: float, kernels: str) -> None:
    """The all-reduce writes its slice into the tensor and the peers' copy (or every rank's region) in one
    pass; each destination, aliasing a source or not, holds the whole result (the tail past the last SIMD
    vector included)."""
    if not dtype.is_floating_point and divisor != 1.0:
        pytest.skip("integers are summed only")
    srcs = [_random(4103, dtype, seed) for seed in range(3)]
    expected = _reference(srcs, divisor)
    spare = torch.zeros(4103, dtype=dtype)
    dsts = [srcs[0], spare, srcs[2]]
    _C.reduce(engine_dtype(dtype), [d.data_ptr() for d in dsts], [s.data_ptr() for s in srcs], 4103, divisor)
    for d in dsts:
        assert torch.equal(d, expected)
