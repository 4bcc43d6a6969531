"""``Fabric(strategy="hai_ddp")`` and ``Fabric(strategy="hai_fsdp")`` as Fabric's documentation uses a strategy,
against one process with SGD (momentum, so the optimizer has state) on the same rows.

Each step: two microbatches, the first inside ``fabric.no_backward_sync``, then ``fabric.clip_gradients``: the
gradient norms are 2.40, 1.33 and 1.07, so a clip at 2.0 acts on the first step and not on the others (where a
wrong gradient scale cannot be normalised away, as a clip at every step would). In float64
(``Fabric(precision="64-true")``, the reference in float64; both under ``default_dtype(torch.float64)``, since
Fabric casts a module's outputs to the default dtype, which would round them to float32 before the loss), to a
relative 1e-9 per parameter (``FLOAT64_RTOL``, which rounding cannot reach: [Note: parity tolerances] in
lightning_haiscale/testing/parity.py). Checkpoints: a ``fabric.save``d state loads into a fresh setup, and one
more step from each is bit-for-bit the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import lightning_haiscale  # noqa: F401  (registers the Fabric names)
from lightning_haiscale.fabric import HaiDDPStrategy, HaiFSDPStrategy
from lightning_haiscale.testing.parity import FLOAT64_RTOL, default_dtype
from tests.distributed import run_distributed

STEPS, ROWS, CLIP = 3, 4, 2.0  # ROWS per rank and microbatch; CLIP: the module docstring


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _rows(step: int, micro: int, world: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The microbatch of ``rank`` (``None``: every rank's rows, as one process sees them)."""
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(world * ROWS, 8, generator=g)
    y = x[:, :2].sum(dim=1, keepdim=True)
    return (x, y) if rank is None else (x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS])


def _reference(world: int) -> dict[str, torch.Tensor]:
    model = _model().double()  # what "64-true" makes of it; the rows as its forward converts them
    optimizer = _optimizer(model)
    for step in range(STEPS):
        for micro in range(2):
            x, y = _rows(step, micro, world, None)
            (F.mse_loss(model(x.double()), y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _step(fabric: Fabric, model: Any, optimizer: Any, step: int) -> None:
    rank, world = fabric.global_rank, fabric.world_size
    with fabric.no_backward_sync(model, enabled=True):
        x, y = _rows(step, 0, world, rank)
        fabric.backward(F.mse_loss(model(x), y) / 2)
    x, y = _rows(step, 1, world, rank)
    fabric.backward(F.mse_loss(model(x), y) / 2)
    fabric.clip_gradients(model, optimizer, max_norm=CLIP)
    optimizer.step()
    optimizer.zero_grad()


def _saved_weights(fabric: Fabric, model: Any, path: Path) -> dict[str, list]:
    """The model's full weights, through a full fabric.save (rank 0 reads them back; plain lists travel back
    from the process safely, tensors do not)."""
    kind = getattr(fabric.strategy, "state_dict_type", "full")
    fabric.strategy.state_dict_type = "full"
    fabric.save(path, {"model": model})
    fabric.strategy.state_dict_type = kind
    fabric.barrier()
    saved = torch.load(path, weights_only=True)["model"] if fabric.global_rank == 0 else {}
    return {k: v.tolist() for k, v in saved.items()}


@default_dtype(torch.float64)  # the module docstring
def _train(rank: int, world: int, name: str, tmp: str, kinds: list[str]) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=world, strategy=name, precision="64-true")
    fabric.launch()
    model, optimizer = fabric.setup(*_joint())  # model and optimizer together
    for step in range(STEPS):
        _step(fabric, model, optimizer, step)
    result: dict[str, Any] = {"weights": _saved_weights(fabric, model, Path(tmp, f"{name}-weights.ckpt"))}
    result["all_reduce"] = float(fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum"))
    result["broadcast"] = fabric.broadcast(f"from {rank}")
    fabric.barrier()
    for kind in kinds:
        fabric.strategy.state_dict_type = kind  # hai_fsdp: "full" or "sharded"; hai_ddp saves full anyway
        path = Path(tmp, f"{name}-{kind}.ckpt")
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})
        assert path.is_dir() == (kind == "sharded") and Path(path, ".metadata").exists() == (kind == "sharded")
        module = fabric.setup_module(_model())  # separate setup, as Fabric's FSDP docs order it
        fresh = fabric.setup_optimizers(_optimizer(module))
        remainder = fabric.load(path, {"model": module, "optimizer": fresh})
        assert remainder == {"step": STEPS}, remainder
        _step(fabric, module, fresh, STEPS)
        result[kind] = _saved_weights(fabric, module, Path(tmp, f"{name}-{kind}-after.ckpt"))
    if name == "hai_fsdp":  # deferred init: built on the meta device, materialized while sharded
        with fabric.init_module(empty_init=True):
            deferred = _model()
        assert all(p.is_meta for p in deferred.parameters())
        assert not any(p.is_meta for p in fabric.setup_module(deferred).parameters())
    _step(fabric, model, optimizer, STEPS)
    result["continued"] = _saved_weights(fabric, model, Path(tmp, f"{name}-continued.ckpt"))
    return result


def _joint() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    return model, _optimizer(model)


def _check(name: str, kinds: list[str], tmp_path: Path) -> None:
    result = run_distributed(_train, 2, name, str(tmp_path), kinds, timeout=180)[0]
    assert result["all_reduce"] == 3.0 and result["broadcast"] == "from 0"
    with default_dtype(torch.float64):
        reference = _reference(2)
    for key, expected in reference.items():
        got = torch.tensor(result["weights"][key], dtype=expected.dtype)
        err = (got - expected).norm() / expected.norm()
        assert err <= FLOAT64_RTOL, f"{key}: relative error {err:.2e}"
    for kind in kinds:
        for key, value in result["continued"].items():
            assert result[kind][key] == value, (kind, key)


def test_fabric_hai_ddp_matches_one_process(tmp_path: Path) -> None:
    _check("hai_ddp", ["full"], tmp_path)


def test_fabric_hai_fsdp_matches_one_process(tmp_path: Path) -> None:
    _check("hai_fsdp", ["full", "sharded"], tmp_path)


def test_registered_under_the_trainer_names() -> None:
    assert isinstance(Fabric(strategy="hai_ddp", accelerator="cpu", devices=2).strategy, HaiDDPStrategy)
    assert isinstance(Fabric(strategy="hai_fsdp", accelerator="cpu", devices=2).strategy, HaiFSDPStrategy)
    unused = Fabric(strategy="hai_ddp_find_unused_parameters_true", accelerator="cpu", devices=2).strategy
    assert unused._hai_kwargs["find_unused_parameters"] is True


def _fp16_inf_on_one_rank(rank: int, world: int, tmp: str) -> tuple[float, bool]:
    """As CUDA builds it (CPU Lightning turns 16-mixed into bf16): fp16 autocast with a loss scaler."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    fabric = Fabric(
        accelerator="cpu", devices=world, strategy="hai_fsdp", plugins=[MixedPrecision("16-mixed", "cpu", scaler)]
    )
    fabric.launch()
    assert isinstance(fabric.strategy.precision.scaler, ShardedGradScaler)
    model, optimizer = fabric.setup(*_joint())
    before = _saved_weights(fabric, model, Path(tmp, "before.ckpt"))
    x, y = _rows(0, 0, world, rank)
    fabric.backward(F.mse_loss(model(x), y))
    if rank == 1:
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")
    optimizer.step()
    after = _saved_weights(fabric, model, Path(tmp, "after.ckpt"))
    return fabric.strategy.precision.scaler.get_scale(), before == after


def test_fabric_hai_fsdp_fp16_skips_on_every_rank(tmp_path: Path) -> None:
    """An inf in one rank's shard: every rank skips the step and halves the scale alike."""
    results = run_distributed(_fp16_inf_on_one_rank, 2, str(tmp_path), timeout=120)
    assert [scale for scale, _ in results] == [512.0, 512.0]
    assert results[0][1], "the parameters changed despite the inf"
