"""A simulated multi-node cluster on one host: N network namespaces ("nodes") joined by a bridge.

    cluster = Cluster(nodes=2, ranks_per_node=2)
    with cluster:                       # up() ... down(), even when the run fails
        cluster.shape("200mbit")        # every node's link to the switch, both directions
        procs = cluster.launch(argv, log_dir=...)   # R ranks per node, torchrun-style environment
        cluster.wait(procs, timeout_s=600)

Picture (facts in shared/NETSIM.md):

    [<prefix>-n0: lo, eth0 10.77.0.1] --veth-- p0 \
                                                   br0 in <prefix>-sw
    [<prefix>-n1: lo, eth0 10.77.0.2] --veth-- p1 /

- Each node's ranks reach each other on the node's own address, which the kernel routes over ``lo``: intra-node
  traffic never touches the shaped link. Inter-node traffic crosses ``eth0`` -> bridge -> the peer's ``eth0``.
- ``tc tbf`` on the node's ``eth0`` (egress) and on its switch port (the node's ingress) gives a full-duplex
  link of the set rate. The kernel here has no ``netem``: there is no latency emulation (probed and reported).
- ``eth0``'s ``tx_bytes``/``rx_bytes`` inside a node namespace count exactly the bytes that crossed nodes
  (headers and TCP acks included).

Without root (or without network namespaces) the cluster runs in **ledger-only mode**: all ranks in the caller's
namespace over loopback, ranks still grouped into simulated nodes by ``LOCAL_WORLD_SIZE``, no shaping and no wire
counters. Names carry a per-run prefix (``zpb<pid>``), so ``down`` deletes only what this run created and ends
only processes inside those namespaces, by PID.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Optional, Sequence

SUBNET = "10.77.0"  # private to the namespaces: the host's interfaces are not visible inside them
IFACE = "eth0"
# Set in the environment of every rank `launch` starts inside a node namespace: only there is `eth0` the node's
# link. Outside (ledger-only mode, loopback) the name may be the host's own interface, whose counters count
# whatever else the machine sends, so nothing reads them there.
IN_NODE_ENV = "ZEROPP_CLUSTER_NODE"


class ClusterError(RuntimeError):
    """A namespace, link or shaping command failed, or a rank did not finish in time."""


def _run(cmd: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces_available() -> tuple[bool, str]:
    """Whether this process can create network namespaces, and why not when it cannot."""
    if os.geteuid() != 0:
        return False, "not running as root (network namespaces and tc need CAP_NET_ADMIN)"
    try:
        probe = _run(["ip", "netns", "list"], check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"`ip netns` is unavailable: {err}"
    if probe.returncode != 0:
        return False, f"`ip netns list` failed: {probe.stderr.strip()}"
    return True, ""


def rate_label(rate: Optional[str]) -> str:
    return rate or "unlimited"


@dataclass
class Rank:
    """One launched rank: its global rank, its node, and the process (its own session, so its PID is its group)."""

    rank: int
    node: int
    proc: subprocess.Popen
    log: IO


@dataclass
class Cluster:
    """``nodes`` x ``ranks_per_node`` ranks; ``namespaces=False`` (or no root) gives ledger-only mode."""

    nodes: int = 2
    ranks_per_node: int = 2
    namespaces: bool = True
    prefix: str = field(default_factory=lambda: f"zpb{os.getpid()}")
    created: list[str] = field(default_factory=list)
    launched: list[Rank] = field(default_factory=list)
    netem: Optional[bool] = None
    why_local: str = ""

    def __post_init__(self) -> None:
        if self.namespaces:
            ok, why = namespaces_available()
            if not ok:
                self.namespaces, self.why_local = False, why
        else:
            self.why_local = "ledger-only mode requested"

    # ----------------------------------------------------------------------------------------- names
    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def node_ns(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def node_addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    # ------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Create the switch and node namespaces, the bridge and one veth link per node (no shaping yet)."""
        if not self.namespaces:
            return
        try:
            self._add_ns(self.switch)
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for i in range(self.nodes):
                ns, port = self.node_ns(i), f"p{i}"
                self._add_ns(ns)
                _run(["ip", "link", "add", port, "netns", self.switch, "type", "veth", "peer", "name", IFACE,
                      "netns", ns])
                _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", self.switch, "link", "set", port, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.node_addr(i)}/24", "dev", IFACE])
                _run(["ip", "-n", ns, "link", "set", IFACE, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])  # intra-node traffic goes over lo
            self.netem = self._probe_netem()
        except BaseException:
            self.down()
            raise

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)

    def _probe_netem(self) -> bool:
        """Whether the kernel has the netem qdisc (latency emulation); this run only reports the answer."""
        probe = _run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", "br0", "root", "netem",
                      "delay", "1ms"], check=False)
        if probe.returncode == 0:
            _run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", "br0", "root"], check=False)
            return True
        return False

    def shape(self, rate: Optional[str]) -> None:
        """Limit every node's link to ``rate`` (tc syntax, e.g. ``"200mbit"``) both ways; ``None`` removes it."""
        if not self.namespaces:
            return
        for i in range(self.nodes):
            for ns, dev in ((self.node_ns(i), IFACE), (self.switch, f"p{i}")):
                base = ["ip", "netns", "exec", ns, "tc", "qdisc"]
                if rate is None:
                    _run(base + ["del", "dev", dev, "root"], check=False)  # fails harmlessly when none is set
                else:
                    _run(base + ["replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                                 "latency", "200ms"])

    def down(self) -> None:
        """End this run's ranks and any process left inside its namespaces (by PID), then delete the namespaces."""
        for r in self.launched:
            _kill_group(r.proc)
            r.log.close()
        self.launched = []
        for ns in reversed(self.created):
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)
        self.created = []

    # ---------------------------------------------------------------------------------------- ranks
    def launch(self, argv: Sequence[str], log_dir: str, env: Optional[dict[str, str]] = None,
               port: Optional[int] = None) -> list[Rank]:
        """Start ``R`` copies of ``argv`` per node with torchrun's environment; output goes to ``log_dir``."""
        os.makedirs(log_dir, exist_ok=True)
        base = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                             "GROUP_RANK", "NODE_RANK")}
        base.update(env or {})
        master = self.node_addr(0) if self.namespaces else "127.0.0.1"
        port = port or (29500 + os.getpid() % 1000 if self.namespaces else _free_port())
        ranks = []
        for node in range(self.nodes):
            for local in range(self.ranks_per_node):
                rank = node * self.ranks_per_node + local
                rank_env = dict(base, RANK=str(rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(local),
                                LOCAL_WORLD_SIZE=str(self.ranks_per_node), GROUP_RANK=str(node),
                                NODE_RANK=str(node), MASTER_ADDR=master, MASTER_PORT=str(port),
                                GLOO_SOCKET_IFNAME=IFACE if self.namespaces else "lo", OMP_NUM_THREADS="1")
                rank_env.pop(IN_NODE_ENV, None)
                if self.namespaces:
                    rank_env[IN_NODE_ENV] = self.node_ns(node)
                cmd = list(argv)
                if self.namespaces:
                    cmd = ["ip", "netns", "exec", self.node_ns(node), *cmd]
                log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
                proc = subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
                r = Rank(rank, node, proc, log)
                ranks.append(r)
                self.launched.append(r)
        return ranks

    def wait(self, ranks: list[Rank], timeout_s: float, poll: Optional[Callable[[], None]] = None) -> list[int]:
        """Wait for every rank; on a failure or after ``timeout_s`` end them all. Returns the exit codes."""
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                codes = [r.proc.poll() for r in ranks]
                if all(c is not None for c in codes):
                    return codes  # type: ignore[return-value]
                if any(c not in (None, 0) for c in codes):
                    time.sleep(2)  # let the others print their side of the failure
                    return [r.proc.poll() if r.proc.poll() is not None else -9 for r in ranks]
                if time.monotonic() > deadline:
                    raise ClusterError(f"ranks did not finish within {timeout_s:.0f} s")
                if poll is not None:
                    poll()
                time.sleep(0.2)
        finally:
            self.release(ranks)

    def release(self, ranks: list[Rank]) -> None:
        for r in ranks:
            _kill_group(r.proc)
            r.log.close()
        self.launched = [r for r in self.launched if r not in ranks]


def _kill_group(proc: subprocess.Popen) -> None:
    """End a rank we started and its children (it leads its own session, so its PID names the group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_link_counters(iface: str = IFACE) -> Optional[dict[str, int]]:
    """``tx_bytes``/``rx_bytes`` of ``iface`` in this process's node namespace; None in a process the cluster did
    not start inside a node (ledger-only mode: the host's interface of that name counts other traffic), or when
    there is no such link."""
    if not os.environ.get(IN_NODE_ENV):
        return None
    base = f"/sys/class/net/{iface}/statistics"
    try:
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return {"tx": int(tx.read()), "rx": int(rx.read())}
    except OSError:
        return None


def cleanup_prefix(prefix: str) -> list[str]:
    """Delete namespaces ``<prefix>-*`` left by a crashed run (ending processes inside them by PID)."""
    if not prefix or "-" in prefix:
        raise ValueError("give the run's prefix, e.g. zpb12345")
    names = [line.split()[0] for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines() if line]
    mine = [n for n in names if n.startswith(prefix + "-")]
    c = Cluster(namespaces=False, prefix=prefix)
    c.created = mine
    c.down()
    return mine


if __name__ == "__main__":  # python -m zeropp.tools.cluster_bench.cluster down zpb12345
    if len(sys.argv) == 3 and sys.argv[1] == "down":
        print("deleted:", " ".join(cleanup_prefix(sys.argv[2])) or "nothing")
    else:
        print("usage: python -m zeropp.tools.cluster_bench.cluster down PREFIX", file=sys.stderr)
        sys.exit(2)
