"""Put first on ``PYTHONPATH`` by ``zeropp run`` for every Python process started under it (the ranks a launcher
such as ``accelerate launch`` or ``torchrun`` spawns): installs zeropp's DeepSpeed API as ``deepspeed`` when the
interpreter starts, before the process's script imports transformers or accelerate, then runs the
``sitecustomize`` this one shadows, if there is one.
"""
import importlib
import os
import sys


def _boot() -> None:
    if os.environ.get("ZEROPP_DEEPSPEED_ALIAS") == "1":
        from zeropp import install_deepspeed_alias
        install_deepspeed_alias()
    here = os.path.dirname(os.path.abspath(__file__))
    saved, ours = list(sys.path), sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        importlib.import_module("sitecustomize")  # the one this file shadows
    except ImportError:
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


_boot()
