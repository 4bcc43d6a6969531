"""The hfreduce engine on its own: ``torchrun --nproc-per-node 2 -m examples.plain.hfreduce_allreduce``."""

import torch
import torch.distributed as dist

from examples.plain.common import init
from lightning_haiscale.hfreduce import Communicator

rank, world, _ = init()
comm = Communicator()  # ranks on this host share one memory segment
t = torch.full((1 << 20,), float(rank))
comm.all_reduce(t, op="avg")  # in place, synchronous
grads = comm.alloc_buffer(1 << 20)  # lives in shared memory: its all-reduce is zero-copy
grads.fill_(rank + 1)
work = comm.all_reduce(grads, async_op=True)  # returns at once; the engine's thread reduces
work.wait()
if rank == 0:
    print(f"avg of ranks: {t[0].item()}, sum of 1..{world}: {grads[0].item()} ({comm.backend})")
comm.close()
dist.destroy_process_group()
