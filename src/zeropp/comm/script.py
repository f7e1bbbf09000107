"""Collectives a training script issues itself, beside the engine: the default world or groups it made.

The engine's collectives go through :class:`zeropp.comm.ops.Comm`, per phase and link. A script that
averages a metric over the ranks, or broadcasts a decision from rank 0, calls these instead (through the
DeepSpeed alias they are ``deepspeed.comm``'s functions), and each call is tallied by operation: calls and
message bytes (the tensor handed in, as DeepSpeed's communication logger counts a message), so
:func:`summary` answers "what did my script send?". Signatures follow ``torch.distributed``'s; ``async_op``
returns the work handle.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

_LOCK = threading.Lock()
_TALLY: dict[str, list[int]] = {}  # operation -> [calls, message bytes]


def _count(op: str, *tensors: Optional[torch.Tensor]) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    with _LOCK:
        cell = _TALLY.setdefault(op, [0, 0])
        cell[0] += 1
        cell[1] += nbytes


def summary() -> dict[str, dict[str, int]]:
    """Calls and message bytes per operation since the start or the last :func:`reset`, on this rank."""
    with _LOCK:
        return {op: {"calls": c, "bytes": b} for op, (c, b) in sorted(_TALLY.items())}


def reset() -> None:
    with _LOCK:
        _TALLY.clear()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks: Sequence[int]) -> Any:
    return dist.new_group(list(ranks))


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher (torchrun) set it."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(get_world_size()))


def barrier(group: Any = None, async_op: bool = False) -> Any:
    _count("barrier")
    return dist.barrier(group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    _count("broadcast", tensor)
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    _count("all_reduce", tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    _count("reduce", tensor)
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    _count("all_gather", tensor)
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    _count("all_gather_into_tensor", input_tensor)
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    _count("reduce_scatter_tensor", input_tensor)
    return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None, group: Any = None,
                      async_op: bool = False) -> Any:
    _count("all_to_all_single", input)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]] = None, dst: int = 0, group: Any = None,
           async_op: bool = False) -> Any:
    _count("gather", tensor)
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]] = None, src: int = 0,
            group: Any = None, async_op: bool = False) -> Any:
    _count("scatter", *(scatter_list or [tensor]))
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    _count("send", tensor)
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0) -> int:
    _count("recv", tensor)
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    _count("isend", tensor)
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0) -> Any:
    _count("irecv", tensor)
    return dist.irecv(tensor, src, group=group, tag=tag)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    _count("all_gather_object")
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    _count("broadcast_object_list")
    dist.broadcast_object_list(object_list, src, group=group, device=device)
