"""Stage-to-stage transfers across hosts: a host that goes silent is named within seconds (issue 32).

[Note: a silent host in a pipeline]
A pipeline whose stages span hosts sends activations and gradients with gloo's point-to-point operations, which
wait on a frozen or unplugged host for the process group's timeout and then name nobody. A job with an engine
across hosts learns of it from the engine's heartbeats (see [Note: a silent host] in hfreduce/liveness.py);
a pipeline alone has no engine. So a pipeline finds the ranks of its group on other hosts when it is built
(``Topology.discover``: the engine's own rule for telling hosts apart), joins the heartbeats for them, and
waits for a transfer by polling it: the wait ends as soon as the watcher declares a peer lost (or another host
posts an abort) with that reason, which the executor turns into a ``PipelineCommunicationError`` naming the
stage, the action and the peer. The process group's timeout stays the outer bound. Stages on one host wait
as before.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from lightning_haiscale.hfreduce.abort import forget_other_hosts, job_failure, watch_other_hosts
from lightning_haiscale.hfreduce.liveness import SILENT_S
from lightning_haiscale.hfreduce.topology import Topology

__all__ = ["HostWatch"]

_POLL_S = 0.05  # how often a wait across hosts checks the job (the transfer's end wakes it at once)


class HostWatch:
    """The ranks of a pipeline's group on other hosts, watched while the pipeline lives (see [Note: a silent
    host in a pipeline]). Collective over ``group`` to build."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        group = group if group is not None else dist.group.WORLD
        topology = Topology.discover(group, 0)
        mine = set(topology.local_ranks)
        self.peers = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)) if r not in mine]
        if self.peers:
            watch_other_hosts(self.peers, SILENT_S)

    def wait(self, work: Any) -> None:
        """Waits for ``work``; raises ``RuntimeError`` with the reason once the job is known to be failing.

        gloo's point-to-point work reports completion only from ``wait()``, and a ``wait(timeout)`` that
        expires closes the connection: so a thread of its own waits, and this one watches it and the job.
        Left waiting on a lost host, that thread is a daemon, and a process that lost a host exits at once
        at its end (see [Note: a silent host] in hfreduce/liveness.py)."""
        if not self.peers:
            work.wait()
            return
        done, failed = threading.Event(), []

        def wait() -> None:
            try:
                work.wait()
            except RuntimeError as error:
                failed.append(error)
            finally:
                done.set()

        threading.Thread(target=wait, name="pipeline-transfer", daemon=True).start()
        while not done.wait(_POLL_S):
            failure = job_failure()
            if failure is not None:
                raise RuntimeError(failure)
        if failed:
            raise failed[0]

    def close(self) -> None:
        """The pipeline is done: its peers are no longer watched (this rank tells them it left). Idempotent."""
        if self.peers:
            forget_other_hosts(self.peers)
            self.peers = []
