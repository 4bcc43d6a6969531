"""lightning-haiscale: haiscale's parallel-training techniques for PyTorch and PyTorch Lightning."""

__version__ = "0.1.0"
