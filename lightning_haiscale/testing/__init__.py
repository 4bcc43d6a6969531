"""Helpers that the tests, the benchmarks and users' own tests of code built on lightning-haiscale share.

Public, as ``torch.testing`` and Lightning's demos are: ``run_distributed`` runs a function on N local
processes with a gloo group; ``parity`` holds a small LightningModule and its single-process reference.
"""

from lightning_haiscale.testing.distributed import run_distributed

__all__ = ["run_distributed"]
