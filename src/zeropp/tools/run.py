"""``python -m zeropp.tools.run script.py [args...]`` (also ``zeropp run script.py [args...]``): run a training
script unchanged with zeropp's DeepSpeed API installed as ``deepspeed`` first.

transformers and accelerate decide when they are imported whether DeepSpeed is there, so the alias must be in
place before the script imports them; this does it in the process that runs the script, and in every Python
process started under it (``tools/boot/sitecustomize.py``, through ``PYTHONPATH``). Under torchrun, put it where
``python`` would go:

    torchrun --nproc-per-node 4 -m zeropp.tools.run train.py --deepspeed ds_config.json

In place of a script, a Python command on ``PATH`` runs the same way, so a launcher and the ranks it spawns all
have the alias:

    zeropp run accelerate launch --use_deepspeed --zero_stage 3 --num_processes 4 train.py

The script runs as ``__main__`` with ``sys.argv`` as it would have it (``sys.argv[0]`` is the script).
"""
from __future__ import annotations

import os
import runpy
import shutil
import sys
from typing import Optional

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")  # its sitecustomize installs the alias


def _script(name: str) -> str:
    """``name`` as a path to a Python script: a file, or a command on ``PATH`` whose first line runs Python."""
    if os.path.isfile(name):
        return name
    # on PATH, or beside this interpreter (a virtual environment's commands, not activated)
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if found is not None:
        with open(found, "rb") as f:
            first = f.readline()
        if first.startswith(b"#!") and b"python" in first:
            return found
        raise SystemExit(f"zeropp run: {found} is not a Python script (its first line: {first[:80]!r})")
    raise SystemExit(f"zeropp run: no script or command {name!r}")


def run(argv: Optional[list[str]] = None) -> None:
    """Install the alias (here and, through the environment, in every Python process started from here), then
    run ``argv[0]`` (a script, or a Python command on ``PATH``) as ``__main__`` with ``argv`` as its argv."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = _script(argv[0])
    from zeropp import install_deepspeed_alias
    install_deepspeed_alias()
    os.environ["ZEROPP_DEEPSPEED_ALIAS"] = "1"
    path = os.environ.get("PYTHONPATH")
    if BOOT not in (path or "").split(os.pathsep):
        os.environ["PYTHONPATH"] = BOOT + (os.pathsep + path if path else "")
    if os.environ.get("RANK", "0") == "0":
        print(f"zeropp run: {argv[0]} with zeropp's DeepSpeed API as `deepspeed`", file=sys.stderr, flush=True)
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` puts it first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run()
