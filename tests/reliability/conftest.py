"""The ``long`` marker: reliability runs of minutes (restarts under torchrun, kills during saves, the soak),
skipped unless ``LHS_LONG_TESTS=1``, so that ``make test`` stays within CI's budget while one case of each
kind still runs there. Run them all with ``LHS_LONG_TESTS=1 pytest tests/reliability``."""

from __future__ import annotations

import os

import pytest

LONG_ENV = "LHS_LONG_TESTS"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"long: a reliability run of minutes, skipped unless {LONG_ENV}=1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(LONG_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"a run of minutes: set {LONG_ENV}=1 to run it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
