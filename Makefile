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

.PHONY: install demo test bench lint check-sdist clean

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

bench: $(STAMP)
	$(PIP) install -q "matplotlib>=3.7" || echo "matplotlib unavailable: the chart is skipped"
	$(PY) -m benchmarks.report

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# sdist and wheel build; the sdist installs into a fresh environment and trains from outside the tree.
check-sdist: $(STAMP)
	.ci/sdist_check $(PY)

clean:
	rm -rf build dist *.egg-info lightning_haiscale/_C*.so $(VENV)
