"""Plain gradient reductions: reduce-scatter (stages 1-3), all-reduce (stage 0), and all-reduce keeping one row
(stages 1-3 with DeepSpeed's ``reduce_scatter: false``).

The reduce-scatter is built from one all-to-all plus a local fp32 sum.

gloo's own reduce_scatter moves as many bytes as an all-reduce (twice the ring optimum; see
shared/NETSIM.md), which would handicap the ZeRO-3 baseline. An all-to-all sends each rank exactly the
rows it owns, (W-1)/W of the bucket per rank, and summing in fp32 avoids 16-bit accumulation error.
The receive rows and the fp32 result row come from pools (Note [buffer pool] in
``comm/buffers.py``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from zeropp.comm.buffers import BufferPools
from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm, Handle


class _PendingSum:
    def __init__(self, pools: BufferPools, received: torch.Tensor, handle: Handle, world: int) -> None:
        self.pools, self.received, self.handle, self.world = pools, received, handle, world
        self.result: Optional[torch.Tensor] = None

    def finish(self) -> torch.Tensor:
        if self.result is not None:
            return self.result
        self.handle.wait()
        length = self.received.shape[1]
        # cast to fp32 inside the reduction: the bits of an fp32 copy summed over dim 0, without that copy
        # (4 bytes per bucket element)
        self.result = self.pools["result"].take(length, torch.float32, self.received.device)
        torch.sum(self.received, dim=0, dtype=torch.float32, out=self.result).div_(self.world)
        self.pools["recv"].give(self.received)
        return self.result

    def progress(self) -> None:
        pass

    def recycle(self) -> None:
        if self.result is not None:
            self.pools["result"].give(self.result)
            self.result = None


class Stateless:
    """The step hooks and (empty) state of a reduction that keeps nothing between steps."""

    def end_step(self, grad_scale: float = 1.0) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class AllToAllReduceScatter(Stateless):
    """Mean-reduce a ``[W, L]`` bucket so that rank ``r`` ends with row ``r`` averaged over all ranks."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.pools = BufferPools("reduce", "recv", "result")

    def start(self, bucket: torch.Tensor, segments: Sequence[int], names: Sequence[str] = ()) -> _PendingSum:
        world = self.comm.topo.world
        received = self.pools["recv"].take(bucket.numel(), bucket.dtype, bucket.device).view(bucket.shape)
        handle = self.comm.all_to_all(received, bucket, world, Phase.GRAD_REDUCE, async_op=True)
        return _PendingSum(self.pools, received, handle, world.size)

    def buffer_bytes(self) -> dict[str, int]:
        return self.pools.buffer_bytes()

    def buffer_bound(self, elements: int, segments: int, itemsize: int) -> int:
        """The receive rows (the bucket's size) and the fp32 result row (this rank's share)."""
        return elements * itemsize + 4 * -(-elements // self.comm.topo.world_size)


class _PendingMean:
    def __init__(self, summed: torch.Tensor, handle: Handle, world: int) -> None:
        self.summed, self.handle, self.world = summed, handle, world

    def finish(self) -> torch.Tensor:
        self.handle.wait()
        if self.world:  # divide once, however often finish is called
            self.summed[0].div_(self.world)
            self.world = 0
        return self.summed[0]

    def progress(self) -> None:
        pass

    def recycle(self) -> None:
        pass


class AllReduceMean(Stateless):
    """Stage 0: every rank keeps whole gradients, so a ``[1, L]`` bucket is all-reduced (in fp32) and averaged.

    Summing in fp32 costs twice the bytes of a 16-bit all-reduce but matches the fp32 sum of the other
    reductions; stage 0 is the plain-data-parallel reference point, not a bandwidth saver. It reduces in
    place in the bucket (or its fp32 copy) and owns no buffer.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def start(self, bucket: torch.Tensor, segments: Sequence[int], names: Sequence[str] = ()) -> _PendingMean:
        summed = bucket.float()
        handle = self.comm.all_reduce(summed, self.comm.topo.world, Phase.GRAD_REDUCE, async_op=True)
        return _PendingMean(summed, handle, self.comm.topo.world_size)

    def buffer_bytes(self) -> dict[str, int]:
        return {}

    def buffer_bound(self, elements: int, segments: int, itemsize: int) -> int:
        return 0


class _PendingRow:
    def __init__(self, summed: torch.Tensor, handle: Handle, world: int, row: int) -> None:
        self.summed, self.handle, self.world, self.row = summed, handle, world, row

    def finish(self) -> torch.Tensor:
        self.handle.wait()
        if self.world:  # divide once, however often finish is called
            self.summed[self.row].div_(self.world)
            self.world = 0
        return self.summed[self.row]

    def progress(self) -> None:
        pass

    def recycle(self) -> None:
        pass


class AllReduceKeepRow(Stateless):
    """DeepSpeed's ``reduce_scatter: false`` at stages 1-3: the whole ``[W, L]`` bucket is all-reduced (in fp32)
    and averaged, and this rank keeps its row, the same mean a reduce-scatter gives (summed in the backend's order
    instead of a local sum), for twice the bytes."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def start(self, bucket: torch.Tensor, segments: Sequence[int], names: Sequence[str] = ()) -> _PendingRow:
        world = self.comm.topo.world
        summed = bucket.float()
        handle = self.comm.all_reduce(summed, world, Phase.GRAD_REDUCE, async_op=True)
        return _PendingRow(summed, handle, world.size, world.index_of(self.comm.topo.rank))

    def buffer_bytes(self) -> dict[str, int]:
        return {}

    def buffer_bound(self, elements: int, segments: int, itemsize: int) -> int:
        return 0
