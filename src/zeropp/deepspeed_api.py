"""The module-level part of DeepSpeed's API that training scripts call, so ``import zeropp as deepspeed`` works.

``zeropp.initialize`` takes DeepSpeed's arguments; this module adds ``add_config_arguments`` and
``init_distributed``, and the list of DeepSpeed names zeropp does not provide, which ``zeropp.__getattr__``
turns into an error that names them (instead of a bare AttributeError deep in a script).
"""
from __future__ import annotations

import argparse
import datetime
import os
from typing import Any, Optional

from zeropp.topology import ensure_process_group

# deepspeed.<name> that scripts use and zeropp does not implement (yet)
MISSING_MODULE_API = frozenset({
    "init_inference", "PipelineModule", "pipe", "ops", "moe", "profiling",
    "accelerator", "get_accelerator", "compression", "inference", "module_inject",
    "monitor", "elasticity", "autotuning", "sequence", "linear", "tp_model_init", "add_tuning_arguments",
    "DeepSpeedConfig", "InferenceEngine", "is_compile_supported",
})


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line switches: ``--deepspeed``, ``--deepspeed_config`` (and the older
    ``--deepscale``/``--deepscale_config``); ``initialize(args=...)`` reads ``args.deepspeed_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by zeropp)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a no-op flag for zeropp: initialize always partitions)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: Optional[int] = None, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Create the default process group as torchrun describes it (a no-op when it exists; a lone process
    without torchrun forms a world of one, as in ``initialize``).

    ``dist_backend``: "gloo", "nccl" or None (gloo for host tensors, NCCL for CUDA ones where available).
    ``rank``/``world_size``/``init_method``/``timeout`` are passed to ``torch.distributed`` when given; MPI
    discovery and ``config`` are DeepSpeed's and have no effect here (torchrun's environment is read instead).
    """
    if distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0 and world_size > 0:
        kwargs.update(rank=rank, world_size=world_size)
    ensure_process_group(dist_backend, **kwargs)


def missing(name: str) -> NotImplementedError:
    """The error for a DeepSpeed module-level name zeropp lacks."""
    from zeropp.zero.deepspeed_surface import DeepSpeedAPIError
    return DeepSpeedAPIError(f"DeepSpeed's deepspeed.{name} is not implemented by zeropp yet")
