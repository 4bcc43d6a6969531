"""Lightning callbacks over the plain-PyTorch layer."""

from lightning_haiscale.callbacks.cpu_offload import CPUOffloadCallback

__all__: list[str] = ["CPUOffloadCallback"]
