"""A small LightningModule and its single-process reference: what the pipeline parity tests and the GPU
check compare every strategy with, and the tolerances every parity test states.

``Classifier`` is an 8-layer MLP in an ``nn.Sequential`` (so every pipeline can split it) written in the
form Lightning documents; ``reference`` trains it in plain PyTorch on the rows Lightning's sampler gives
each data-parallel replica, with SGD (Adam's normalised step would hide a wrong gradient scale).

[Note: parity tolerances]
A parity test asks whether a distributed computation is the same mathematics as one process. Rounding must
not decide its verdict, on any CPU (AVX-512, AVX2 or the portable kernels) and for any summation order:

* **float64** (model, data and optimizer; :func:`default_dtype`): summing the same terms in another order
  moves a result by about 1e-16 relative; a few SGD steps with momentum amplify that by 1e2-1e4 in these
  tests, so runs agree to ~1e-12. ``FLOAT64_RTOL, FLOAT64_ATOL = 1e-9, 1e-10`` cannot be reached by rounding,
  while a real difference is far above it: a gradient scaled by 1 + 1e-6 moves the weights by ~1e-7 after one
  step (``tests/test_parity_mutations.py`` shows each family fails on such mutations).
* **float32**, where float64 is not the question (a float32 path, a mixed-precision run): measure the
  reference's own noise, the same one-process training with its batch summed in other orders (microbatch by
  microbatch, :func:`measure_noise`), and allow ``NOISE_MULTIPLE`` times it (:func:`noise_tolerance`). A bare
  float32 tolerance is a guess that holds on the machine it was written on and fails on another.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

__all__ = [
    "BATCH",
    "FLOAT64_ATOL",
    "FLOAT64_RTOL",
    "FLOAT64_TOLERANCES",
    "LR",
    "NOISE_MULTIPLE",
    "STEPS",
    "Classifier",
    "assert_parity",
    "data",
    "default_dtype",
    "max_difference",
    "measure_noise",
    "noise_tolerance",
    "reference",
]

BATCH, STEPS, LR = 8, 5, 0.1
# float64: another summation order moves results by ~1e-12 here; any real difference is >= ~1e-8 (the Note).
FLOAT64_RTOL, FLOAT64_ATOL = 1e-9, 1e-10
FLOAT64_TOLERANCES = {"rtol": FLOAT64_RTOL, "atol": FLOAT64_ATOL}  # torch.testing.assert_close(a, b, **these)
# float32: how many times the reference's own reordering noise a distributed run may differ by. The reference's
# reorderings sample the noise; the distributed run sums in yet another order, hence a margin of 10.
NOISE_MULTIPLE = 10.0


class Classifier(L.LightningModule):
    """The supported form, verbatim: the strategy must train it with no edit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        widths = [6, 16, 16, 16, 16, 16, 16, 16]
        self.net = nn.Sequential(
            *(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(widths)), nn.Linear(16, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.cross_entropy(out, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def data(n: int = BATCH * STEPS * 2) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g))


def reference(
    steps: int,
    batch: int,
    accumulate: int = 1,
    dp: int = 1,
    clip: float | None = None,
    rows: int = BATCH * STEPS * 2,
    dtype: torch.dtype = torch.float32,
    microbatches: int = 1,
    model: Callable[[], nn.Module] = Classifier,
) -> tuple[dict[str, torch.Tensor], float]:
    """Plain PyTorch on the batches Lightning's sampler gives (shuffled, sharded by data-parallel rank): each
    optimizer step's samples from every replica, their mean loss, gradients clipped to norm ``clip``.

    ``dtype``: the model's and the inputs' (``torch.float64`` is what a Trainer with ``precision="64-true"``
    trains). ``microbatches``: backpropagate each step's batch in that many pieces (the same mean loss, summed
    in another order): what :func:`measure_noise` varies. ``model``: builds the module (a variant of
    :class:`Classifier`).
    """
    module = model().to(dtype)
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
    x, y = data(rows).tensors
    x = x.to(dtype)
    orders = [list(DistributedSampler(data(rows), num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    per_step = batch * accumulate
    for step in range(steps):
        rows = [i for order in orders for i in order[step * per_step : (step + 1) * per_step]]
        opt.zero_grad()
        if microbatches == 1:
            loss = F.cross_entropy(module(x[rows]), y[rows])
        else:
            pieces = torch.tensor(rows).tensor_split(microbatches)
            loss = sum(F.cross_entropy(module(x[p]), y[p], reduction="sum") for p in pieces) / len(rows)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
    return {k: v.detach() for k, v in module.state_dict().items()}, float(loss.detach())


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Builds models and data in ``dtype`` inside the block (``torch.set_default_dtype``), restored after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def max_difference(actual: Mapping[str, Any], expected: Mapping[str, Any]) -> float:
    """The largest absolute element difference between same-named tensors (or nested lists) of two states."""
    worst = 0.0
    for name, want in expected.items():
        got = torch.as_tensor(actual[name], dtype=torch.float64)
        want = torch.as_tensor(want, dtype=torch.float64)
        if want.numel():
            worst = max(worst, (got - want).abs().max().item())
    return worst


def measure_noise(train: Callable[[int], Mapping[str, Any]], microbatches: Sequence[int] = (2, 4)) -> float:
    """The float32 noise of a one-process training: the largest difference between ``train(1)`` and
    ``train(k)`` for ``k`` in ``microbatches``, where ``train(k)`` sums each step's batch in ``k`` pieces."""
    base = train(1)
    return max(max_difference(train(k), base) for k in microbatches)


def noise_tolerance(noise: float, scale: float, multiple: float = NOISE_MULTIPLE) -> float:
    """The absolute tolerance for a float32 comparison: ``multiple`` times the measured ``noise``, and never
    under ``multiple`` float32 ulps of ``scale`` (the largest magnitude compared): a reference whose
    reorderings happen to agree bit for bit measures no noise, yet a third order still rounds."""
    return multiple * max(noise, torch.finfo(torch.float32).eps * scale)


def assert_parity(
    actual: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    atol: float | None = None,
    label: str = "",
) -> None:
    """Every tensor of ``expected`` equals ``actual``'s of the same name (tensors or nested lists).

    Without ``atol``, the float64 tolerances (``FLOAT64_RTOL``, ``FLOAT64_ATOL``: see [Note: parity
    tolerances]); for float32 pass ``atol=noise_tolerance(measure_noise(...), ...)``.
    """
    rtol, atol = (FLOAT64_RTOL, FLOAT64_ATOL) if atol is None else (0.0, atol)
    for name, want in expected.items():
        got = torch.as_tensor(actual[name], dtype=torch.float64)
        want = torch.as_tensor(want, dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{label} {n}: {m}")
