"""Helpers that the tests, the benchmarks and users' own tests of code built on lightning-haiscale share.

Public, as ``torch.testing`` and Lightning's demos are.

- ``distributed``: ``run_distributed``, a function on N local processes with a gloo group.
- ``parity``: a small LightningModule, its single-process reference, and the parity tolerances.
"""

from lightning_haiscale.testing.distributed import run_distributed

__all__ = ["run_distributed"]
