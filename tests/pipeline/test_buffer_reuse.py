"""Receive buffers are reused from step to step, and never while anything else still holds them.

See [Note: buffer reuse] in ``lightning_haiscale.pipeline.p2p``. The parity tests in ``test_pipelines``
fail if two messages of one step shared a buffer (a later microbatch's activation would overwrite one
autograd saved); here: the pool's rule alone, and two ways a buffer outlives its step in user code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_haiscale.pipeline import GPipe, Interleaved1F1B, PipeDream, p2p, partition
from lightning_haiscale.testing.parity import FLOAT64_TOLERANCES, default_dtype
from tests.distributed import run_distributed

META = [p2p.TensorMeta((4, 6), torch.float32, True)]
CPU = torch.device("cpu")


def test_the_pool_hands_a_buffer_out_again_only_when_nothing_else_holds_it() -> None:
    pool = p2p.BufferPool()
    first = pool.get(("a",), META, CPU)
    address = first.data_ptr()
    assert pool.get(("b",), META, CPU).data_ptr() != address  # every message of a step has its own buffer
    assert pool.get(("a",), META, CPU).data_ptr() != address  # still held (a pending receive, autograd...)
    saved = first[1:]  # a view of what was handed out holds the memory too
    del first
    assert pool.get(("a",), META, CPU).data_ptr() != address
    del saved
    second = pool.get(("a",), META, CPU)
    address = second.data_ptr()
    del second
    assert pool.get(("a",), META, CPU).data_ptr() == address  # nothing holds it: the same memory again
    assert pool.get(("a",), [p2p.TensorMeta((2, 6), torch.float32, True)], CPU).shape == (2, 6)  # new layout
    packed = [p2p.TensorMeta((3,), torch.float32, False), p2p.TensorMeta((5,), torch.int64, False)]
    buffer = pool.get(("c",), packed, CPU)
    address = buffer.data_ptr()
    assert buffer.dtype == torch.uint8 and buffer.numel() == 16 + 48
    del buffer
    assert pool.get(("c",), packed, CPU).data_ptr() == address


class Stage0(nn.Module):
    """``linear(x) + p.view(...)``: ``p``'s gradient is a view of the received output gradient, which
    autograd's AccumulateGrad takes as ``p.grad`` without a copy."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 6)
        self.p = nn.Parameter(torch.randn(rows * 6) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.p.view(x.size(0), 6)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


@default_dtype(torch.float64)  # then FLOAT64_TOLERANCES: rounding cannot decide it ([Note: parity tolerances])
def _held_past_their_step(rank: int, world: int) -> None:
    """Two accumulated steps (no zero_grad) of stage 0 = ``Stage0``, stage 1 = identity, keeping step 1's
    outputs: a reused buffer would overwrite ``p.grad`` (rank 0) and the kept outputs (rank 1)."""
    stage = Stage0(rows=4) if rank == 0 else nn.Identity()
    pipe = PipeDream(stage, chunks=2)
    kept = []
    for step in range(2):
        x, y = _data(step)
        batches = [(part,) for part in x.chunk(2)] if rank == 0 else None
        result = pipe.run_microbatches(
            batches, lambda m, out, y=y: F.mse_loss(out, y.chunk(2)[m]), loss_scale=0.5, keep_outputs=True
        )
        kept.append(result.outputs)
    reference = Stage0(rows=4)
    outputs = []
    for step in range(2):
        x, y = _data(step)
        outs = [reference(part) for part in x.chunk(2)]
        outputs.append([o.detach() for o in outs])
        (sum(F.mse_loss(o, t) for o, t in zip(outs, y.chunk(2), strict=True)) * 0.5).backward()
    if rank == 0:
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad, reference.get_parameter(name).grad, **FLOAT64_TOLERANCES, msg=name)
    else:
        for step in range(2):
            for m in range(2):
                torch.testing.assert_close(
                    kept[step][m], outputs[step][m], **FLOAT64_TOLERANCES, msg=f"step {step} microbatch {m}"
                )


def test_without_torchs_use_count_every_message_gets_a_fresh_buffer(monkeypatch) -> None:
    """The count is private to torch: a torch without it loses the reuse, never the correctness."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    pool = p2p.BufferPool()
    first = pool.get(("a",), META, CPU)
    address = first.data_ptr()
    del first
    kept = pool.get(("a",), META, CPU)  # nothing holds the first buffer, but nothing can tell
    assert kept.data_ptr() != address


def test_a_stolen_gradient_and_a_kept_output_are_not_overwritten_by_the_next_step() -> None:
    run_distributed(_held_past_their_step, 2)


def _allocations(rank: int, world: int) -> dict[str, list[int]]:
    """Receive buffers allocated per step by each schedule, counted at ``p2p.empty_buffer``."""
    calls = []
    allocate = p2p.empty_buffer

    def counted(metas: list[p2p.TensorMeta], device: torch.device) -> torch.Tensor:
        calls.append(1)
        return allocate(metas, device)

    p2p.empty_buffer = counted
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)])
    pipes = {
        "gpipe": GPipe(partition(model, rank, world), 4),
        "pipedream": PipeDream(partition(model, rank, world), 4),
        "interleaved": Interleaved1F1B(partition(model, rank, world, num_model_chunks=2), 4),
    }
    counts = {}
    x, y = _data(0)
    for name, pipe in pipes.items():
        counts[name] = []
        for _ in range(3):
            before = len(calls)
            pipe.forward_backward(x, criterion=F.mse_loss, labels=(y,))
            counts[name].append(len(calls) - before)
    return counts


def test_steps_after_the_first_allocate_no_receive_buffer() -> None:
    for rank, counts in enumerate(run_distributed(_allocations, 2)):
        for name, per_step in counts.items():
            assert per_step[0] > 0 and per_step[1:] == [0, 0], (rank, name, per_step)
