"""``zeropp bench``: ZeRO++ against DDP, FSDP2, DeepSpeed and plain ZeRO-3 on a simulated slow-network cluster.

- ``cluster.py``: N network namespaces on a bridge, links shaped with ``tc tbf`` (or ledger-only on loopback).
- ``systems.py``: the compared systems behind one small interface, built inside each rank.
- ``worker.py``: one rank: every bandwidth phase in turn, timed steps, link counters, ledger, memory, loss.
- ``run.py``: the driver (``zeropp bench``): launches each system, shapes links between phases, shows progress.
- ``report.py``: JSON rows, a markdown table with the target ratios, PNG plots.

Not the repository's top-level ``bench/`` folder, which holds single-machine micro-benchmark scripts
(``bench/run_bench.py`` is only a shortcut to this package).
"""
from __future__ import annotations

from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``zeropp bench`` with these command-line arguments."""
    from zeropp.tools.cluster_bench.run import main as run_main

    return run_main(argv)


__all__ = ["main"]
