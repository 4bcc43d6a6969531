"""hai_fsdp in Lightning: ``python -m examples.lightning.fsdp`` (2 CPU processes)."""

from lightning.pytorch import Trainer
from torch import nn

from examples.lightning.common import ToyRegression, toy_loader
from lightning_haiscale import HaiFSDPStrategy

if __name__ == "__main__":
    strategy = HaiFSDPStrategy(auto_wrap_policy={nn.Linear})  # or simply strategy="hai_fsdp"
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, logger=False)
    trainer.fit(ToyRegression(), toy_loader())
