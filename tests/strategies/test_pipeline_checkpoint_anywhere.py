"""A pipeline checkpoint is whole: its full file resumes under ``hai_fsdp``, ``hai_ddp``, one device and another
pipeline layout with every stage's momentum, and matches one process trained straight through; and ``hai_ddp``'s
and ``hai_fsdp``'s files resume under a pipeline.

Was: the full file had no optimizer states (only the ``.stage<k>`` files did); ``hai_fsdp`` zipped an empty list,
Lightning logged "Restored all states" and training went on from fresh momentum; ``hai_ddp`` and one device raised
Lightning's ``KeyError`` blaming ``save_weights_only``. Now the full file carries them in torch's index-keyed layout
(``optimizer.state_dict()``'s), and a file that cannot give them raises naming itself and the fix.

``hai_pipedream`` (2 stages, one pipeline) trains the ``Classifier`` 6 steps in float64 with SGD momentum 0.9,
saving at step 3 (the end of the first epoch); each resume trains steps 4-6 on the same rows per step (the
strategies' samplers deal the same permutation: 2 ranks of ``BATCH`` rows hold the pipeline's ``2 * BATCH``), and
must reach the one-process reference to a relative 1e-9 (``FLOAT64_TOLERANCES``: rounding cannot reach it; the
reductions differ in order). A control resume from fresh momentum misses the reference by far more (asserted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

import lightning_haiscale  # noqa: F401  (registers the strategies)
from lightning_haiscale.strategies import HaiFSDPStrategy, Interleaved1F1BStrategy, PipeDreamStrategy
from lightning_haiscale.testing.parity import BATCH, FLOAT64_TOLERANCES, LR, Classifier, data
from tests.distributed import run_distributed

STEPS_PER_EPOCH, ROWS = 3, 3 * 2 * BATCH  # one epoch: 3 steps of 2 * BATCH rows


def _reference(fresh_momentum_at: int | None = None) -> dict[str, torch.Tensor]:
    """One process, 2 epochs of 3 steps on the sampler's permutations; ``fresh_momentum_at``: the control."""
    module = Classifier().double()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
    x, y = data(ROWS).tensors
    sampler = DistributedSampler(data(ROWS), num_replicas=1, rank=0, shuffle=True, seed=0)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for step in range(STEPS_PER_EPOCH):
            if epoch * STEPS_PER_EPOCH + step == fresh_momentum_at:
                optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
            rows = order[step * 2 * BATCH : (step + 1) * 2 * BATCH]
            optimizer.zero_grad()
            F.cross_entropy(module(x[rows].double()), y[rows]).backward()
            optimizer.step()
    return {k: v.detach() for k, v in module.state_dict().items()}


def _fit(strategy: Any, replicas: int, tmp: Path, ckpt_path: Path | None = None, save: bool = False) -> L.Trainer:
    """6 steps; ``replicas`` data-parallel copies of the model share each step's ``2 * BATCH`` rows."""
    saver = ModelCheckpoint(dirpath=tmp, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=6, logger=False,
        precision="64-true", enable_checkpointing=save, callbacks=[saver] if save else [], enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False,
    )  # fmt: skip
    module = Classifier().double()  # one device loads a checkpoint before setup: a float32 module would round it
    rank = dist.get_rank() % replicas
    sampler = DistributedSampler(data(ROWS), num_replicas=replicas, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data(ROWS), batch_size=2 * BATCH // replicas, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def _check(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], label: str) -> None:
    assert state.keys() == expected.keys(), label
    for k, v in expected.items():
        torch.testing.assert_close(state[k].cpu(), v, **FLOAT64_TOLERANCES, msg=f"{label}: {k}")


def _resume_everywhere(rank: int, world: int, tmp: str) -> None:
    tmp_path, expected = Path(tmp), _reference()
    whole = _fit(PipeDreamStrategy(chunks=2), 1, tmp_path, save=True)
    _check(whole.strategy.lightning_module_state_dict(), expected, "straight through")
    path = tmp_path / "step=3.ckpt"
    saved = torch.load(path, weights_only=False)
    assert [sorted(s["state"]) for s in saved["optimizer_states"]] == [list(range(16))]  # 8 layers' weights, biases
    targets = {
        "hai_fsdp": (HaiFSDPStrategy(), 2),
        "hai_ddp": ("hai_ddp", 2),
        "hai_interleaved_1f1b, 4 stages": (Interleaved1F1BStrategy(chunks=2), 1),
        "hai_pipedream, the same layout": (PipeDreamStrategy(chunks=2), 1),
    }
    for label, (strategy, replicas) in targets.items():
        resumed = _fit(strategy, replicas, tmp_path, ckpt_path=path)
        full = resumed.strategy.lightning_module_state_dict()
        if rank == 0:
            _check(full, expected, label)
    _into_a_pipeline(tmp_path, expected)
    _earlier_versions(tmp_path, saved)


def _into_a_pipeline(tmp_path: Path, expected: dict[str, torch.Tensor]) -> None:
    """And back: ``hai_ddp``'s and ``hai_fsdp``'s full files (index-keyed, no parameter names) resume under a
    pipeline of 4 stages, the positions named by the pipeline's parameter order."""
    for name, strategy in (("hai_ddp", "hai_ddp"), ("hai_fsdp", HaiFSDPStrategy())):
        _fit(strategy, 2, tmp_path / name, save=True)
        resumed = _fit(Interleaved1F1BStrategy(chunks=2), 1, tmp_path, ckpt_path=tmp_path / name / "step=3.ckpt")
        full = resumed.strategy.lightning_module_state_dict()
        if dist.get_rank() == 0:
            _check(full, expected, f"{name} -> hai_interleaved_1f1b")


def _earlier_versions(tmp_path: Path, saved: dict[str, Any]) -> None:
    """A full file as earlier builds wrote it (no optimizer states; they are in the stage files): another pipeline
    layout still takes them from the stage files; ``hai_fsdp`` and ``hai_ddp`` raise, naming the file and the fix."""
    old = tmp_path / "old.ckpt"
    if dist.get_rank() == 0:
        layout = {k: v for k, v in saved["pipeline"].items() if k != "param_names"}
        torch.save({**{k: v for k, v in saved.items() if k != "optimizer_states"}, "pipeline": layout}, old)
        for stage in range(2):
            Path(f"{old}.stage{stage}").write_bytes(Path(f"{tmp_path / 'step=3.ckpt'}.stage{stage}").read_bytes())
    dist.barrier()
    resumed = _fit(Interleaved1F1BStrategy(chunks=2), 1, tmp_path, ckpt_path=old)
    full = resumed.strategy.lightning_module_state_dict()
    if dist.get_rank() == 0:
        _check(full, _reference(), "earlier file, 4 stages")
    for strategy in (HaiFSDPStrategy(), "hai_ddp"):
        with pytest.raises(RuntimeError, match=f"{old}.*no optimizer states.*resume it once under the pipeline"):
            _fit(strategy, 2, tmp_path, ckpt_path=old)
    _lightnings_checks(tmp_path, saved)


def _lightnings_checks(tmp_path: Path, saved: dict[str, Any]) -> None:
    """Lightning FSDP's checks on load (``tests_pytorch/strategies/test_fsdp.py``): a checkpoint with 2 optimizer
    states for 1 optimizer raises its message (was: the second silently dropped), and one without optimizer states
    raises the connector's ``KeyError`` under hai_fsdp too (was: a resume from fresh momentum)."""
    two, weights = tmp_path / "two.ckpt", tmp_path / "weights.ckpt"
    plain = {k: v for k, v in saved.items() if k not in ("optimizer_states", "pipeline")}
    if dist.get_rank() == 0:
        torch.save({**plain, "optimizer_states": saved["optimizer_states"] * 2}, two)
        torch.save(plain, weights)
    dist.barrier()
    for strategy in (HaiFSDPStrategy(), "hai_ddp", PipeDreamStrategy(chunks=2)):
        replicas = 1 if isinstance(strategy, PipeDreamStrategy) else 2
        with pytest.raises(RuntimeError, match="configured 1 optimizers but the checkpoint contains 2 optimizers"):
            _fit(strategy, replicas, tmp_path, ckpt_path=two)
    with pytest.raises(KeyError, match="contains only the model"):
        _fit(HaiFSDPStrategy(), 2, tmp_path, ckpt_path=weights)


def _one_device(rank: int, world: int, tmp: str) -> None:
    resumed = _fit("auto", 1, Path(tmp), ckpt_path=Path(tmp, "step=3.ckpt"))
    _check(resumed.lightning_module.state_dict(), _reference(), "one device")


@pytest.mark.slow  # 40-45 s on 2 loaded cores
def test_a_pipeline_checkpoint_resumes_under_every_strategy(tmp_path: Path) -> None:
    run_distributed(_resume_everywhere, 2, str(tmp_path), timeout=400)
    run_distributed(_one_device, 1, str(tmp_path), timeout=120)


def test_the_control_misses() -> None:
    """A resume from fresh momentum at step 3 misses the reference far outside the tolerance: the comparisons
    above would see a dropped optimizer state."""
    expected, control = _reference(), _reference(fresh_momentum_at=3)
    worst = max(float(((control[k] - v).abs() / v.abs().clamp_min(1e-12)).max()) for k, v in expected.items())
    assert worst > 1e-3
