"""Plain gradient reductions: reduce-scatter (stages 1-3) and all-reduce (stage 0).

The reduce-scatter is built from one all-to-all plus a local fp32 sum.

gloo's own reduce_scatter moves as many bytes as an all-reduce (twice the ring optimum; see
shared/NETSIM.md), which would handicap the ZeRO-3 baseline. An all-to-all sends each rank exactly the
rows it owns, (W-1)/W of the bucket per rank, and summing in fp32 avoids 16-bit accumulation error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm, Handle


@dataclass
class _PendingSum:
    received: torch.Tensor
    handle: Handle
    world: int

    def finish(self) -> torch.Tensor:
        self.handle.wait()
        return self.received.float().sum(dim=0).div_(self.world)


class AllToAllReduceScatter:
    """Mean-reduce a ``[W, L]`` bucket so that rank ``r`` ends with row ``r`` averaged over all ranks."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def start(self, bucket: torch.Tensor, segments: Sequence[int]) -> _PendingSum:
        world = self.comm.topo.world
        received = torch.empty_like(bucket)
        handle = self.comm.all_to_all(received, bucket, world, Phase.GRAD_REDUCE, async_op=True)
        return _PendingSum(received, handle, world.size)


@dataclass
class _PendingMean:
    summed: torch.Tensor
    handle: Handle
    world: int

    def finish(self) -> torch.Tensor:
        self.handle.wait()
        return self.summed[0].div_(self.world)


class AllReduceMean:
    """Stage 0: every rank keeps whole gradients, so a ``[1, L]`` bucket is all-reduced (in fp32) and averaged.

    Summing in fp32 costs twice the bytes of a 16-bit all-reduce but matches the fp32 sum of the other
    reductions; stage 0 is the plain-data-parallel reference point, not a bandwidth saver.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def start(self, bucket: torch.Tensor, segments: Sequence[int]) -> _PendingMean:
        summed = bucket.float()
        handle = self.comm.all_reduce(summed, self.comm.topo.world, Phase.GRAD_REDUCE, async_op=True)
        return _PendingMean(summed, handle, self.comm.topo.world_size)
