"""``python -m zeropp.tools.run script.py [args...]`` (also ``zeropp run script.py [args...]``): run a training
script unchanged with zeropp's DeepSpeed API installed as ``deepspeed`` first.

transformers and accelerate decide when they are imported whether DeepSpeed is there, so the alias must be in
place before the script imports them; this does it in the process that runs the script. Under a launcher, put it
where ``python`` would go, so that every rank's process installs it:

    torchrun --nproc-per-node 4 -m zeropp.tools.run train.py --deepspeed ds_config.json

The script runs as ``__main__`` with ``sys.argv`` as it would have it (``sys.argv[0]`` is the script).
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import Optional


def run(argv: Optional[list[str]] = None) -> None:
    """Install the alias, then run ``argv[0]`` (a path to a script) as ``__main__`` with ``argv`` as its argv."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"zeropp run: no script at {script!r}")
    from zeropp import install_deepspeed_alias
    install_deepspeed_alias()
    if os.environ.get("RANK", "0") == "0":
        print(f"zeropp run: {script} with zeropp's DeepSpeed API as `deepspeed`", file=sys.stderr, flush=True)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` puts it first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run()
