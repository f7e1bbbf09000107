"""Wire counters are read only inside a node namespace the emulated cluster made (never the host's interface)."""
from __future__ import annotations

import os
import socket
import sys
import threading

import pytest

from zeropp.tools.cluster_bench import cluster


def _send_on_loopback(stop: threading.Event) -> None:
    """Another process's traffic, as a busy machine has: UDP datagrams to a loopback port, until ``stop``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while not stop.is_set():
            s.sendto(b"x" * 1400, ("127.0.0.1", 9))


def test_no_counter_is_read_outside_a_node_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    # `lo` exists on every host and counts the sender's traffic: it plays the host's busy `eth0`
    monkeypatch.delenv(cluster.IN_NODE_ENV, raising=False)
    stop = threading.Event()
    sender = threading.Thread(target=_send_on_loopback, args=(stop,), daemon=True)
    sender.start()
    try:
        assert cluster.read_link_counters("lo") is None
        assert cluster.read_link_counters() is None
        # the same call where the cluster says this process is a node's: it does read, and sees the traffic
        monkeypatch.setenv(cluster.IN_NODE_ENV, "node-0")
        first = cluster.read_link_counters("lo")
        assert first is not None
        while True:
            later = cluster.read_link_counters("lo")
            assert later is not None
            if later["tx"] > first["tx"]:
                break
    finally:
        stop.set()
        sender.join()


def test_launch_marks_ranks_only_inside_namespaces(tmp_path: "os.PathLike[str]") -> None:
    c = cluster.Cluster(nodes=1, ranks_per_node=1, namespaces=False)
    marker = tmp_path / "env.txt"
    code = f"import os; open({str(marker)!r}, 'w').write(os.environ.get({cluster.IN_NODE_ENV!r}, '<unset>'))"
    os.environ[cluster.IN_NODE_ENV] = "inherited"  # a parent's marker does not leak into ledger-only ranks
    try:
        ranks = c.launch([sys.executable, "-c", code], str(tmp_path / "logs"))
        assert c.wait(ranks, 60) == [0]
    finally:
        del os.environ[cluster.IN_NODE_ENV]
    assert marker.read_text() == "<unset>"
