"""The side-by-side cluster benchmark (issue 6); the same as ``zeropp bench``.

    sudo .venv/bin/python bench/run_bench.py [--bandwidths unlimited,200mbit] [--steps 8] [--systems ...]

See ``zeropp bench --help`` and docs/benchmarks.md. The code lives in ``src/zeropp/cluster_bench/``.
"""
import sys

from zeropp.tools.cluster_bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
