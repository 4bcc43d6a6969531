"""``two_hosts``: two real hosts on this machine, made of Linux namespaces, for the tests of the cross-host path
without ``HFREDUCE_NODE_ID``.

[Note: two hosts from namespaces]
Each host is a network namespace (a veth pair joins the two, 10.231.0.1 and .2), a mount namespace with a
fresh tmpfs on ``/dev/shm``, a UTS namespace with its own host name and a pid namespace (``kill`` of its first
process ends the whole host at once). One ``torchrun --nnodes 2 --nproc-per-node 2`` runs in each, with
``GLOO_SOCKET_IFNAME`` naming its end of the veth. When the job ends, each host lists what its ``/dev/shm``
still holds. Making namespaces needs root (CI runs as root) and ``unshare``; elsewhere the tests are skipped
with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_ADDRESSES = ("10.231.0.1", "10.231.0.2")
_PORT = 29531
_LAUNCHER_VARIABLES = ("HFREDUCE_NODE_ID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
# an earlier in-process seed_everything() leaves these set: they would reseed the jobs' samplers and initial weights
_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "making network, mount and UTS namespaces needs root"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs `unshare` (util-linux) and `ip` (iproute2)"
    probe = subprocess.run(["unshare", "--mount", "--uts", "--net", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"this machine does not permit namespaces: {probe.stderr.decode().strip()}"
    return None


@dataclass
class Host:
    namespace: str
    interface: str
    address: str
    shm_left: Path  # what /dev/shm holds after the job, one name a line
    process: subprocess.Popen | None = None
    log: list[str] = field(default_factory=list)

    def kill(self) -> None:
        """SIGKILL to the host's first process: the kernel ends every process of its pid namespace."""
        init = _children(self.process.pid) if self.process is not None else []
        for pid in init:
            os.kill(pid, signal.SIGKILL)

    def drop_link(self) -> None:
        """The host goes silent: its end of the veth is down, its sockets stay open (no FIN, no RST)."""
        _sh("ip", "netns", "exec", self.namespace, "ip", "link", "set", self.interface, "down")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@dataclass
class TwoHosts:
    hosts: tuple[Host, Host]
    out: Path

    def start(self, args: Sequence[str], names: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Starts ``torchrun ... tests/hosts/host_job.py <args> <out>`` on both hosts, named ``names``."""
        for rank, (host, name) in enumerate(zip(self.hosts, names, strict=True)):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                        "--node-rank", str(rank), "--master-addr", _ADDRESSES[0], "--master-port", str(_PORT),
                        str(ROOT / "tests/hosts/host_job.py"), *args, str(self.out)]  # fmt: skip
            script = (
                f'mount -t tmpfs -o size=256m tmpfs /dev/shm && hostname "{name}" && "$@"; rc=$?; '
                f'ls -A /dev/shm > "{host.shm_left}"; exit $rc'
            )
            command = ["ip", "netns", "exec", host.namespace, "unshare", "--mount", "--uts", "--pid", "--fork",
                       "--mount-proc", "--propagation", "private", "sh", "-c", script, "sh", *torchrun]  # fmt: skip
            inherited = {k: v for k, v in os.environ.items() if k not in (*_LAUNCHER_VARIABLES, *_SEED_VARIABLES)}
            variables = {**inherited, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                         "GLOO_SOCKET_IFNAME": host.interface, **(env or {})}  # fmt: skip
            host.process = subprocess.Popen(
                command, env=variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )

    def wait(self, timeout: float, hosts: Sequence[int] = (0, 1)) -> list[int | None]:
        """Each of ``hosts``' exit status (None: still running at ``timeout``, then killed)."""
        deadline, codes = time.monotonic() + timeout, []
        for host in (self.hosts[i] for i in hosts):
            try:
                out, _ = host.process.communicate(timeout=max(1.0, deadline - time.monotonic()))
                host.log.append(out)
                codes.append(host.process.returncode)
            except subprocess.TimeoutExpired:
                host.kill()
                host.log.append(host.process.communicate()[0])
                codes.append(None)
        return codes

    def logs(self) -> str:
        return "\n".join(f"--- host {i}:\n{''.join(h.log)[-4000:]}" for i, h in enumerate(self.hosts))

    def wait_for(self, names: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all((self.out / n).exists() for n in names):
            if time.monotonic() > deadline or any(h.process.poll() is not None for h in self.hosts):
                raise AssertionError(f"{names} not all written in {timeout} s\n{self.wait(5)}\n{self.logs()}")
            time.sleep(0.05)


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[TwoHosts]:
    reason = _why_not()
    if reason is not None:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    hosts = tuple(
        Host(f"lhs{tag}{side}", f"lhs{tag}{side}v", address, tmp_path / f"shm_left_{side}")
        for side, address in zip("ab", _ADDRESSES, strict=True)
    )
    a, b = hosts
    try:
        for host in hosts:
            _sh("ip", "netns", "add", host.namespace)
            _sh("ip", "netns", "exec", host.namespace, "ip", "link", "set", "lo", "up")
        _sh("ip", "link", "add", a.interface, "netns", a.namespace, "type", "veth", "peer", "name", b.interface,
            "netns", b.namespace)  # fmt: skip
        for host in hosts:
            _sh("ip", "netns", "exec", host.namespace, "ip", "addr", "add", f"{host.address}/24", "dev", host.interface)
            _sh("ip", "netns", "exec", host.namespace, "ip", "link", "set", host.interface, "up")
        out = tmp_path / "out"
        out.mkdir()
        yield TwoHosts((a, b), out)
    finally:
        for host in hosts:
            if host.process is not None and host.process.poll() is None:
                host.kill()
                host.process.communicate(timeout=30)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=30)
