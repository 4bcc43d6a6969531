"""hai_pipedream in Lightning: ``python -m examples.lightning.pipeline`` (2 CPU processes, 2 stages)."""

from lightning.pytorch import Trainer

from examples.lightning.common import ToyRegression, toy_loader
from lightning_haiscale import PipeDreamStrategy

if __name__ == "__main__":
    # The module is unchanged: its one nn.Sequential is cut into 2 stages; each batch into 4 microbatches.
    strategy = PipeDreamStrategy(chunks=4)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, logger=False)
    trainer.fit(ToyRegression(), toy_loader())
