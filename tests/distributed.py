"""The tests' import point for the multi-rank harness, which lives in :mod:`lightning_haiscale.testing`."""

from lightning_haiscale.testing import run_distributed

__all__ = ["run_distributed"]
