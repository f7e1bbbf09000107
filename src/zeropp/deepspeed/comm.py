"""``deepspeed.comm``: DeepSpeed's communication functions over ``zeropp.comm.script`` (each call tallied).

The collectives take DeepSpeed's signatures, which are ``torch.distributed``'s plus logging labels (``prof``,
``log_name``, ``debug``) that are accepted and not needed: every call is counted anyway.
:func:`log_summary` prints, and with ``return_dict=True`` returns, the calls and message bytes per operation;
there are no per-call latencies (DeepSpeed's logger measures them only when profiling is switched on).
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from zeropp.comm import script
from zeropp.comm.script import (
    ReduceOp,
    all_gather_object,
    broadcast_object_list,
    destroy_process_group,
    get_all_ranks_from_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_size,
    is_available,
    is_initialized,
    new_group,
)
from zeropp.deepspeed.module_api import init_distributed

_LABELS = ("prof", "log_name", "debug")


def _labelled(fn: Callable) -> Callable:
    """``fn`` accepting DeepSpeed's logging labels as keywords."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        for label in _LABELS:
            kwargs.pop(label, None)
        return fn(*args, **kwargs)
    return call


barrier = _labelled(script.barrier)
broadcast = _labelled(script.broadcast)
all_reduce = _labelled(script.all_reduce)
inference_all_reduce = all_reduce
reduce = _labelled(script.reduce)
all_gather = _labelled(script.all_gather)
all_gather_into_tensor = _labelled(script.all_gather_into_tensor)
reduce_scatter_tensor = _labelled(script.reduce_scatter_tensor)
all_to_all_single = _labelled(script.all_to_all_single)
gather = _labelled(script.gather)
scatter = _labelled(script.scatter)
send = _labelled(script.send)
recv = _labelled(script.recv)
isend = _labelled(script.isend)
irecv = _labelled(script.irecv)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, debug: Any = None) -> Any:
    return script.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                      async_op: bool = False, prof: bool = False, debug: Any = None) -> Any:
    return script.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def monitored_barrier(group: Any = None, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False,
                      **labels: Any) -> Any:
    """A barrier (gloo's monitored barrier names the late ranks; other backends wait like a barrier)."""
    return script.barrier(group=group)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def configure(config: Any = None, enabled: Optional[bool] = None, prof_all: Optional[bool] = None,
              prof_ops: Any = None, verbose: Optional[bool] = None, debug: Optional[bool] = None) -> None:
    """DeepSpeed's communication-logger switches: zeropp always counts calls and bytes, so they change nothing."""


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Optional[dict[str, dict[str, int]]]:
    """Print (rank 0) the calls and message bytes per operation of this rank; return them if asked."""
    table = script.summary()
    if get_rank() == 0:
        rows = [f"{op:<26}{cell['calls']:>8}{cell['bytes'] / 2**20:>14.2f}" for op, cell in table.items()]
        print("\n".join([f"{'operation':<26}{'calls':>8}{'message MiB':>14}", *rows]), flush=True)
    return table if return_dict else None


def reset_log() -> None:
    script.reset()


def has_comm_data() -> bool:
    return bool(script.summary())


def get_comm_operation_count() -> int:
    return sum(cell["calls"] for cell in script.summary().values())


def get_logged_comm_ops() -> list[str]:
    return list(script.summary())


__all__ = [
    "ReduceOp", "init_distributed", "is_initialized", "is_available", "destroy_process_group", "new_group",
    "get_rank", "get_world_size", "get_local_rank", "get_global_rank", "get_all_ranks_from_group", "barrier",
    "monitored_barrier", "broadcast", "all_reduce", "inference_all_reduce", "reduce", "all_gather",
    "all_gather_into_tensor", "allgather_fn", "reduce_scatter_tensor", "reduce_scatter_fn", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list",
    "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "configure", "log_summary", "reset_log",
    "has_comm_data", "get_comm_operation_count", "get_logged_comm_ops",
]
