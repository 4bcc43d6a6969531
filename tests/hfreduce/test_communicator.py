"""Communicator collectives against torch.distributed's own, on 2-4 processes."""

import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce import Communicator
from tests.distributed import run_distributed


def _all_reduce_matches_gloo(rank: int, world: int) -> None:
    comm = Communicator()
    for n in (0, 1, 7, 4097, 300_001):
        t = torch.randn(n, generator=torch.Generator().manual_seed(rank * 7919 + n))
        expected = t.clone()
        dist.all_reduce(expected)
        comm.all_reduce(t)
        torch.testing.assert_close(t, expected)
    comm.close()


def test_all_reduce_matches_gloo() -> None:
    run_distributed(_all_reduce_matches_gloo, 2)
