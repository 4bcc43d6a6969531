"""Lightning callbacks over the plain-PyTorch layer.

- ``cpu_offload``: ``CPUOffloadCallback``, activation offload around each training forward (or each
  microbatch's, through a pipeline strategy's ``forward_context``).
"""

from lightning_haiscale.callbacks.cpu_offload import CPUOffloadCallback

__all__: list[str] = ["CPUOffloadCallback"]
