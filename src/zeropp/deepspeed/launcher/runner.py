"""``deepspeed.launcher.runner``: the names accelerate's DeepSpeed launcher imports.

``accelerate launch --use_deepspeed`` imports ``DEEPSPEED_ENVIRONMENT_NAME`` in the launching process. On one
node it then starts the ranks with ``torch.distributed.run``; on several with its ``standard`` multinode launcher
it does the same. Its other multinode launchers (pdsh, openmpi, mvapich...) run DeepSpeed's own ``deepspeed``
command, which zeropp does not provide: ``main`` says so.
"""
from __future__ import annotations

from typing import Any

from zeropp.deepspeed.missing import DeepSpeedAPIError

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # the file DeepSpeed's multinode runner reads extra variables from


def main(args: Any = None) -> None:
    """DeepSpeed's ``deepspeed`` command (its multinode runner over pdsh, MPI...): not provided."""
    raise DeepSpeedAPIError("deepspeed.launcher.runner.main (the `deepspeed` command) is not provided by zeropp: "
                            "launch the ranks with `torchrun ... -m zeropp.tools.run script.py`, or `zeropp run "
                            "accelerate launch ...` with --deepspeed_multinode_launcher standard on several nodes")
