"""``DistributedDataParallel`` against a single-process run on the concatenated batch, and against torch DDP.

Each test spawns its processes once and checks several behaviours in them (the machine has 2 cores).
Every check runs in float64 (``_run_all``: models, data and optimizers built under ``default_dtype``), with
SGD (Adam's normalised step would hide a wrong gradient scale): tolerance relative 1e-9 of each parameter's
norm (``FLOAT64_RTOL``), which another summation order (~1e-15) cannot reach and a real difference exceeds
(lightning_haiscale/testing/parity.py, [Note: parity tolerances]).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from examples.gpt.model import GPT, config, lm_loss
from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.testing.parity import FLOAT64_ATOL, FLOAT64_RTOL, default_dtype
from tests.distributed import run_distributed

# No biases: the key bias of attention gets a gradient that is zero up to rounding (noise that no two
# summation orders share; harmless under SGD, but keep the model free of it).
CFG = config("tiny", n_layer=2, n_embd=32, n_head=2, block_size=16, bias=False)
PER_RANK = 2  # sequences per rank and micro-batch


def _assert_close(model: nn.Module, ref: nn.Module, rel: float = FLOAT64_RTOL) -> None:
    """Relative error of each parameter's norm; float64 (``_run_all``), see the module docstring."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = (p.detach() - q.detach()).norm() / q.detach().norm().clamp_min(1e-12)
        assert err <= rel, f"{name}: relative error {err:.2e} > {rel}"


def _tokens(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, CFG.vocab_size, (rows, CFG.block_size + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _train_gpt(rank: int, world: int, steps: int, accumulate: int, bucket_cap_mb: float) -> None:
    """hai DDP vs one process on the concatenated batch: GPT, SGD, ``accumulate`` micro-batches per step."""
    ref = _gpt(0)
    model = DistributedDataParallel(_gpt(rank), bucket_cap_mb=bucket_cap_mb)  # rank 0's weights win
    assert len(model.reducer.buckets) > 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _tokens(step, world * PER_RANK * accumulate)
        mine = slice(rank * PER_RANK * accumulate, (rank + 1) * PER_RANK * accumulate)
        for micro, (xm, ym) in enumerate(zip(x[mine].chunk(accumulate), y[mine].chunk(accumulate), strict=True)):
            if micro < accumulate - 1:
                with model.no_sync():
                    (lm_loss(model(xm), ym) / accumulate).backward()
            else:
                (lm_loss(model(xm), ym) / accumulate).backward()
        opt.step()
        opt.zero_grad()  # set_to_none=True: the views must come back in the next backward
        lm_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_close(model.module, ref)
    _assert_zero_copy(model)
    model.reducer.stop()


def _assert_zero_copy(model: DistributedDataParallel) -> None:
    """Every packed gradient is a view of the engine's buffer (in-place ones: tests/ddp/test_gradient_homes.py)."""
    packed = [i for i, home in enumerate(model.reducer.in_place) if not home]
    if not packed:
        return
    storage = model.reducer.storage[(torch.get_default_dtype(), torch.device("cpu"))]
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.numel() * storage.element_size()
    for i in packed:
        p = model.reducer.params[i]
        model.reducer.attach_grad(i)
        assert lo <= p.grad.data_ptr() < hi, "a gradient is not a view of the engine's buffer"


class _Branchy(nn.Module):
    """``b`` is used only when asked (data-dependent), ``c`` never."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = self.a(x)
        return out + self.b(x) if use_b else out


def _unused_parameters(rank: int, world: int) -> None:
    ref, model = _Branchy(), DistributedDataParallel(_Branchy(), find_unused_parameters=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    for step in range(6):
        x = torch.randn(world, 4, 8, generator=torch.Generator().manual_seed(step))
        use_b = [step % 2 == 0 and r == 0 for r in range(world)]  # only rank 0, every other step
        model(x[rank], use_b[rank]).square().mean().backward()
        assert model.module.c.weight.grad is None
        assert (model.module.b.weight.grad is None) == (not any(use_b))
        opt.step()
        opt.zero_grad()
        (sum(ref(x[r], use_b[r]).square().mean() for r in range(world)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_close(model.module, ref)
    model.reducer.stop()

    strict = DistributedDataParallel(_Branchy())
    with pytest.raises(RuntimeError, match="find_unused_parameters=True"):
        strict(x[rank], True).sum().backward()
    strict.reducer.stop()


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _buffers_match_torch_ddp(rank: int, world: int) -> None:
    ours = DistributedDataParallel(_bn_model())
    theirs = nn.parallel.DistributedDataParallel(_bn_model())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    for step in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + rank))
        for m, opt in zip((ours, theirs), opts, strict=True):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    _assert_close(ours.module, theirs.module)
    for a, b in zip(ours.module.buffers(), theirs.module.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    state = ours.state_dict()
    assert list(state) == list(theirs.state_dict())  # torch DDP's keys, "module." prefix included
    ours.load_state_dict(theirs.state_dict())  # either wrapper's checkpoint loads into the other
    theirs.load_state_dict(state)
    bare = _bn_model()
    consume_prefix_in_state_dict_if_present(state, "module.")
    bare.load_state_dict(state)
    finalizer = ours.reducer._finalizer
    del ours, m
    gc.collect()
    assert not finalizer.alive, "the engine was not stopped when the wrapper was collected"


def _buffers_follow_torch_rules(rank: int, world: int) -> None:
    """torch broadcasts buffers before a forward only when the previous forward had gradients and was not
    inside no_sync(): a no-grad forward in train mode (BatchNorm updates its statistics) and a no_sync
    microbatch leave each rank's statistics its own until the next synchronized forward. One broadcast per
    forward for all of BatchNorm's buffers (float statistics and the int64 counter)."""
    ours = DistributedDataParallel(_bn_model())
    theirs = nn.parallel.DistributedDataParallel(_bn_model())
    broadcasts = []
    engine_broadcast = ours.reducer.comm.broadcast
    ours.reducer.comm.broadcast = lambda *a, **k: broadcasts.append(1) or engine_broadcast(*a, **k)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step * world + rank))
        for m, opt in zip((ours, theirs), opts, strict=True):
            with torch.no_grad():
                m(x[:4] * (rank + 1))
            with m.no_sync():
                m(x[:4]).square().mean().backward()
            m(x[4:]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        for a, b in zip(ours.module.buffers(), theirs.module.buffers(), strict=True):
            torch.testing.assert_close(a, b, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL, msg=f"step {step}")
    _assert_close(ours.module, theirs.module)
    assert len(broadcasts) == 3, f"{len(broadcasts)} buffer broadcasts in 9 forwards; torch makes 3 (one a step)"
    ours.reducer.stop()


def _device_ids_name_the_module_device(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=r"device_ids=\[0\] names cuda:0, but the module is on \['cpu'\]"):
        DistributedDataParallel(nn.Linear(2, 2), device_ids=[0])
    with pytest.raises(ValueError, match="one device per process"):
        DistributedDataParallel(nn.Linear(2, 2), device_ids=[0, 1])


class _UsedTwice(nn.Module):
    """``shared`` is used inside a reentrant checkpoint and again outside it: its gradient is accumulated
    twice in one backward, the second time (the checkpoint's inner backward) after its bucket was launched."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.shared, x, use_reentrant=True)
        return self.head(self.shared(torch.tanh(h)))


def _double_accumulation_matches_one_process(rank: int, world: int, device: str = "cpu") -> None:
    model = DistributedDataParallel(_UsedTwice().to(device), bucket_cap_mb=1e-6)  # a bucket per parameter
    ref = _UsedTwice().to(device)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    for step in range(4):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step)).to(device).requires_grad_()
        model(x[rank * 4 : (rank + 1) * 4]).square().mean().backward()
        ref(x).square().mean().backward()
        for opt_ in (opt, ref_opt):
            opt_.step()
            opt_.zero_grad()
        _assert_close(model.module, ref)
    model.reducer.stop()


@default_dtype(torch.float64)
def _run_all(rank: int, world: int, checks: list[Callable[[int, int], None]]) -> None:
    for check in checks:
        check(rank, world)
        dist.barrier()


def _gpt_parity(rank: int, world: int) -> None:
    _train_gpt(rank, world, steps=10, accumulate=1, bucket_cap_mb=0.02)


def _gpt_accumulate(rank: int, world: int) -> None:
    _train_gpt(rank, world, steps=3, accumulate=4, bucket_cap_mb=0.02)


def test_two_processes() -> None:
    checks = [
        _gpt_parity,
        _gpt_accumulate,
        _unused_parameters,
        _buffers_match_torch_ddp,
        _buffers_follow_torch_rules,
        _device_ids_name_the_module_device,
        _double_accumulation_matches_one_process,
    ]
    run_distributed(_run_all, 2, checks)


def test_two_hosts_of_two_ranks() -> None:
    run_distributed(_run_all, 4, [_gpt_parity], node_ids=["a", "a", "b", "b"])


@default_dtype(torch.float64)
def _cuda_checks(rank: int, world: int) -> None:
    torch.cuda.set_device(0)
    _double_accumulation_matches_one_process(rank, world, device="cuda")
    model = DistributedDataParallel(nn.Linear(4, 2).cuda(), device_ids=[0])
    assert model(torch.randn(3, 4)).device.type == "cuda", "device_ids=[0]: inputs go to the module's device"
    model.reducer.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_double_accumulation_and_device_ids() -> None:
    """Both ranks on GPU 0 (the engine stages through host memory; gloo for the process group)."""
    run_distributed(_cuda_checks, 2)
