"""Lightning callbacks over the plain-PyTorch layer."""

__all__: list[str] = []
