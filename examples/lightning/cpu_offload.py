"""CPUOffloadCallback in Lightning: ``python -m examples.lightning.cpu_offload`` (2 CPU processes)."""

from lightning.pytorch import Trainer

from examples.lightning.common import ToyRegression, toy_loader
from lightning_haiscale import CPUOffloadCallback

if __name__ == "__main__":
    # On CPU the callback leaves CPU tensors alone unless force_copy=True exercises the copy path.
    offload = CPUOffloadCallback(0.3, min_bytes=0, force_copy=True)
    trainer = Trainer(strategy="hai_ddp", accelerator="cpu", devices=2, max_epochs=1, callbacks=[offload])
    trainer.fit(ToyRegression(), toy_loader())
