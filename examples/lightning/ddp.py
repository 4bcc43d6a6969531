"""hai_ddp in Lightning: ``python -m examples.lightning.ddp`` (2 CPU processes)."""

from lightning.pytorch import Trainer

import lightning_haiscale  # noqa: F401  (registers "hai_ddp")
from examples.lightning.common import ToyRegression, toy_loader

if __name__ == "__main__":
    trainer = Trainer(strategy="hai_ddp", accelerator="cpu", devices=2, max_epochs=2, logger=False)
    trainer.fit(ToyRegression(), toy_loader())
