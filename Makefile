# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build is installed only when no torch is importable; a GPU user's torch is kept.
# Elsewhere than here, add the CPU wheel index: make TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.installed
NATIVE := $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: install demo test test-portable test-min bench lint check-sdist clean

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py $(NATIVE)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install -q "setuptools>=77" wheel "pybind11>=2.12"
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m examples.gpt.train --config examples/gpt/demo.yaml

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

# The engine's portable reduce kernels forced (HFREDUCE_KERNELS, see docs/troubleshooting.md) on the tests that
# run the engine: what a CPU without AVX2 computes. `HFREDUCE_KERNELS=generic make test` runs the whole suite so.
PORTABLE_TESTS ?= tests/hfreduce tests/ddp tests/test_parity_mutations.py  # about 4-5 min on 2 quiet cores
test-portable: $(STAMP)
	HFREDUCE_KERNELS=generic OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PORTABLE_TESTS)

# The lowest supported versions (pyproject's floors) on the lowest supported Python: a smoke subset. The
# first run downloads torch 2.6.0's CUDA build (about 3 GB; PyPI has no CPU build of it for Linux x86-64).
MIN_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python) python3.10)  # pyenv's, if any
MIN_VENV ?= .venv-min
MIN_PINS := "torch==2.6.0" "lightning==2.6.0" "typing_extensions==4.10.0"
MIN_TESTS := tests/hfreduce/test_kernels.py tests/hfreduce/test_native.py tests/ddp/test_buckets.py \
	tests/pipeline/test_schedule.py tests/pipeline/test_buffer_reuse.py tests/cpu_offload/test_selection.py \
	tests/cpu_offload/test_region.py \
	tests/ddp/test_distributed.py::test_two_processes tests/strategies/test_hai_ddp.py::test_hai_ddp_on_two_processes \
	tests/strategies/test_hai_fsdp.py::test_hai_fsdp_strategy \
	tests/strategies/test_pipeline_strategies.py::test_strategies_train_like_one_process

test-min:
	test -x $(MIN_VENV)/bin/python || $(MIN_PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q $(MIN_PINS) "setuptools>=77" wheel "pybind11>=2.12" "pytest>=8"
	$(MIN_VENV)/bin/python -m pip install -q --no-build-isolation -e .
	$(MIN_VENV)/bin/python -c "import torch, lightning; print('test-min on torch', torch.__version__, 'lightning', lightning.__version__)"
	cd /tmp && OMP_NUM_THREADS=1 $(CURDIR)/$(MIN_VENV)/bin/python -m torch.distributed.run --nproc-per-node 2 \
		$(CURDIR)/.ci/sdist_smoke.py allreduce --editable
	cd /tmp && OMP_NUM_THREADS=1 $(CURDIR)/$(MIN_VENV)/bin/python $(CURDIR)/.ci/sdist_smoke.py fit --editable
	OMP_NUM_THREADS=1 $(MIN_VENV)/bin/python -m pytest -q -p no:cacheprovider $(MIN_TESTS)

bench: $(STAMP)
	$(PIP) install -q --no-build-isolation -e ".[bench]" || echo "the [bench] extra did not install: the chart or DeepSpeed's column is skipped"
	$(PY) -m benchmarks.report

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# sdist and wheel build; the sdist installs into a fresh environment and trains from outside the tree.
check-sdist: $(STAMP)
	.ci/sdist_check $(PY)

clean:
	rm -rf build dist *.egg-info lightning_haiscale/_C*.so $(VENV) $(MIN_VENV)
