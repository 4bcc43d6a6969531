"""``hai_fsdp`` builds only the engines its sharding strategy uses, each with the strategy's deadline: hybrid
sharding, one over each host's ranks and one over the replicas (before: a third, over every rank of every
host, built and closed unused)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from lightning_haiscale.adapter.fsdp_options import hai_fsdp_options, wrap_hai_fsdp
from lightning_haiscale.hfreduce import communicator
from lightning_haiscale.testing import run_distributed

_TIMEOUT = timedelta(seconds=77)


def _engines(rank: int, world: int, sharding: str) -> list:
    built = []
    original = communicator.Communicator.__init__

    def counting(self: communicator.Communicator, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        built.append((self.world_size, self.timeout))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(communicator.Communicator, "__init__", counting)
        options = hai_fsdp_options(sharding_strategy=sharding)
        model = wrap_hai_fsdp(nn.Linear(4, 4), torch.device("cpu"), _TIMEOUT, "32-true", options)
    model.close()
    return built


def test_each_strategy_builds_the_engines_it_uses() -> None:
    hybrid = run_distributed(_engines, 4, "HYBRID_SHARD", node_ids=["a", "a", "b", "b"], timeout=180)
    assert hybrid == [[(2, _TIMEOUT), (2, _TIMEOUT)]] * 4  # replicas across hosts, then shards within a host
    assert run_distributed(_engines, 2, "FULL_SHARD", timeout=120) == [[(2, _TIMEOUT)]] * 2
