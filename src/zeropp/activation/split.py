"""``partition_activations: "node"``: each saved checkpoint input split across the data-parallel ranks of a node.

Note [node-split checkpoints]: DeepSpeed's ``partition_activations`` splits a checkpoint across the
model-parallel group, whose ranks hold the same activations; zeropp has no model parallelism, and its
data-parallel ranks hold different ones. Asked with ``"node"``, each rank cuts every checkpoint input it keeps
for a rerun into ``D`` equal pieces (``D`` ranks per node) and sends piece ``j`` to the node's rank ``j``
(an all-to-all inside the node, never across nodes); each rank keeps one piece of every node peer's input
until backward reruns the function, when the pieces go back (the reverse all-to-all) and the input is rebuilt
with its shape and strides. A rank then holds the node's mean of the checkpoint bytes instead of its own: the
same bytes when the ranks' micro-batches are alike, less on the rank with the largest ones when they differ
(sequences of varying length), at the price of sending ``(D - 1) / D`` of every input over the node's link
twice per step. Ranks may keep inputs of different sizes: the sizes are exchanged first (an all-gather of one
number) and each input is cut into ``D`` pieces of its own (an uneven all-to-all).

Every rank of a node must save and rerun the same checkpoints in the same order (the same model: true of data
parallelism). The collectives go through :class:`~zeropp.comm.ops.Comm` (ledger phase "other").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm


@dataclass
class SplitInput:
    """What a rank keeps of one node-wide split: one piece of every node rank's input (``pieces``, in rank
    order), and what it needs to get its own input back."""

    pieces: torch.Tensor  # 1-D
    numels: list[int]  # every node rank's input size
    shape: torch.Size
    stride: tuple[int, ...]
    dense: bool


def piece_sizes(numel: int, d: int) -> list[int]:
    """Sizes of the ``d`` consecutive pieces an input of ``numel`` elements is cut into (as ``tensor_split``)."""
    return [numel // d + (1 if j < numel % d else 0) for j in range(d)]


class NodeSplit:
    """Splits tensors across the intra-node group of ``comm`` and joins them back (Note [node-split
    checkpoints]); every call is a collective over the node."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.group = comm.topo.intra_node
        self.index = self.group.index_of(comm.topo.rank)

    @property
    def size(self) -> int:
        return self.group.size

    def split(self, t: torch.Tensor, dense: bool) -> SplitInput:
        """Send piece ``j`` of ``t`` to the node's rank ``j``; keep the piece every rank sends here."""
        d, me = self.group.size, self.index
        flat = t.detach().reshape(-1)
        numels = self._sizes(flat.numel(), t.device)
        incoming = [piece_sizes(n, d)[me] for n in numels]
        kept = torch.empty(sum(incoming), dtype=t.dtype, device=t.device)
        self.comm.all_to_all_v(kept, flat, incoming, piece_sizes(flat.numel(), d), self.group, Phase.OTHER)
        return SplitInput(kept, numels, t.shape, t.stride(), dense)

    def join(self, s: SplitInput) -> torch.Tensor:
        """Bring this rank's pieces back from the node and rebuild its input (the reverse of :meth:`split`)."""
        d, me = self.group.size, self.index
        mine = piece_sizes(s.numels[me], d)
        whole = torch.empty(s.numels[me], dtype=s.pieces.dtype, device=s.pieces.device)
        self.comm.all_to_all_v(whole, s.pieces, mine, [piece_sizes(n, d)[me] for n in s.numels], self.group,
                               Phase.OTHER)
        whole = whole.view(s.shape)
        if s.dense and whole.stride() != s.stride:  # the rerun sees the layout the forward saw
            whole = torch.empty_strided(s.shape, s.stride, dtype=whole.dtype, device=whole.device).copy_(whole)
        return whole

    def _sizes(self, numel: int, device: torch.device) -> list[int]:
        """Every node rank's element count, exchanged as 8 raw bytes each (gloo gathers uint8 everywhere)."""
        mine = torch.tensor([numel], dtype=torch.int64, device=device).view(torch.uint8)
        every = torch.empty(self.group.size * 8, dtype=torch.uint8, device=device)
        self.comm.all_gather(every, mine, self.group, Phase.OTHER)
        return [int(v) for v in every.view(torch.int64).tolist()]
