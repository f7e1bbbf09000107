"""Analytic per-step communication volumes and model-state memory, to check the ledger and tensors against.

All volumes are the bytes ONE rank receives in one optimizer step without gradient accumulation, split
into intra-node and inter-node. Sources: ZeRO (Rajbhandari et al., SC'20, arXiv 1910.02054) section 7:
stage 3 moves the parameters once in an all-gather for forward, once for backward, and the gradients once in a
reduce-scatter, each rank receiving (P-1)/P of the model per collective (on several nodes of several ranks the
all-gathers run in two hops, so that only (n-1)/n of the model reaches a rank from other nodes). ZeRO++ (Wang et
al., ICLR'24, arXiv 2306.10209) section 3: qwZ halves the forward gather with int8 (plus one fp32 scale per block),
hpZ's backward gather stays inside the group of s ranks, and qgZ's two-hop int4 all-to-all receives (D-1)/D x M/2
bytes inside the node and (n-1)/n x M/(2D) across nodes. Padding and scales are counted exactly, following
Note [shard layout] in ``partition/spec.py`` and the quantizer's block layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from zeropp.partition.spec import ShardSpec
from zeropp.quant import BlockLayout, payload_bytes
from zeropp.topology import Layout


@dataclass(frozen=True)
class Volume:
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0

    def __add__(self, other: "Volume") -> "Volume":
        return Volume(self.intra_node_bytes + other.intra_node_bytes, self.inter_node_bytes + other.inter_node_bytes)

    def as_dict(self) -> dict[str, int]:
        return {"intra_node_bytes": self.intra_node_bytes, "inter_node_bytes": self.inter_node_bytes}


def _peers(layout: Layout, rank: int, ranks: Sequence[int]) -> tuple[int, int]:
    """How many other members of ``ranks`` sit on ``rank``'s node, and how many elsewhere."""
    node = layout.node_of(rank)
    intra = sum(1 for r in ranks if r != rank and layout.node_of(r) == node)
    inter = sum(1 for r in ranks if layout.node_of(r) != node)
    return intra, inter


def _per_peer(bytes_per_peer: int, peers: tuple[int, int]) -> Volume:
    return Volume(peers[0] * bytes_per_peer, peers[1] * bytes_per_peer)


def _chunks(numels: Sequence[int], world: int) -> list[int]:
    return [ShardSpec(n, (n,), world).chunk for n in numels]  # type: ignore[arg-type]


def world_gather_volume(row_bytes: int, layout: Layout, rank: int) -> Volume:
    """A row of ``row_bytes`` from every rank of the world (Note [two-hop gather] in ``comm/gather.py``): on
    several nodes of several ranks in two hops, ``n - 1`` rows from other nodes, then the ``n`` rows of each
    other rank of the node; else one all-gather, a row from every other rank."""
    d, n = layout.ranks_per_node, layout.num_nodes
    if n > 1 and d > 1:
        return Volume(intra_node_bytes=(d - 1) * n * row_bytes, inter_node_bytes=(n - 1) * row_bytes)
    return _per_peer(row_bytes, _peers(layout, rank, range(layout.world_size)))


def gather_volume(numels: Sequence[int], layout: Layout, rank: int, elem_bytes: int) -> Volume:
    """Plain all-gather of every parameter's 16-bit (or fp32) chunks over the world."""
    return world_gather_volume(sum(_chunks(numels, layout.world_size)) * elem_bytes, layout, rank)


def quantized_gather_volume(numels: Sequence[int], layout: Layout, rank: int, bits: int, block: int) -> Volume:
    """qwZ: quantized payload plus 4 bytes per block, blocks cut per parameter chunk."""
    q = BlockLayout(tuple(_chunks(numels, layout.world_size)), block)
    return world_gather_volume(payload_bytes(q, bits) + 4 * q.num_blocks, layout, rank)


def hpz_gather_volume(numels: Sequence[int], layout: Layout, rank: int, group_size: int, elem_bytes: int) -> Volume:
    """hpZ: gather of the secondary slices (padded/s per parameter) over this rank's group of s ranks."""
    padded = [c * layout.world_size for c in _chunks(numels, layout.world_size)]
    first = rank // group_size * group_size
    group = range(first, first + group_size)
    return _per_peer(sum(p // group_size for p in padded) * elem_bytes, _peers(layout, rank, group))


def reduce_scatter_volume(numels: Sequence[int], layout: Layout, rank: int, elem_bytes: int) -> Volume:
    """Plain reduce-scatter as an all-to-all: one chunk row from every other rank."""
    row = sum(_chunks(numels, layout.world_size))
    return _per_peer(row * elem_bytes, _peers(layout, rank, range(layout.world_size)))


def qgz_volume(numels: Sequence[int], layout: Layout, rank: int, bits: int, block: int) -> Volume:
    """qgZ: hop 1 receives ``n`` quantized rows from each other rank of the node, hop 2 one row per other node."""
    q = BlockLayout(tuple(_chunks(numels, layout.world_size)), block)
    row = payload_bytes(q, bits) + 4 * q.num_blocks
    d, n = layout.ranks_per_node, layout.num_nodes
    return Volume(intra_node_bytes=(d - 1) * n * row, inter_node_bytes=(n - 1) * row)


NORM_VALUES = 13  # the squared norm and three groups of four collective-order values (Note [collective order])


def grad_norm_volume(layout: Layout, rank: int) -> Volume:
    """The global-norm all-reduce of thirteen float64 (the squared norm and the collective-order digests),
    counted as a ring all-reduce (see ``comm/ops.py``)."""
    return _per_peer(2 * 8 * NORM_VALUES // layout.world_size, _peers(layout, rank, range(layout.world_size)))


def model_state_bytes(numels: Sequence[int], world: int, grad_bytes: int = 2, optimizer_bytes: int = 12,
                      shard_bytes: int = 2, hpz_group: int = 1) -> int:
    """ZeRO-3 model states per rank: (2 + 2 + K) x M / P (ZeRO section 5), with our padding, + 2M/s for hpZ.

    ``optimizer_bytes`` K = 12 for mixed-precision Adam: fp32 master, momentum and variance.
    """
    chunks = _chunks(numels, world)
    total = sum(chunks) * (shard_bytes + grad_bytes + optimizer_bytes)
    if hpz_group > 1:
        total += sum(c * world // hpz_group for c in chunks) * shard_bytes
    return total


def stage_model_state_bytes(numels: Sequence[int], world: int, stage: int, grads_pending: bool,
                            elem_bytes: int = 2, optimizer_bytes: int = 12) -> int:
    """Model states per rank for each ZeRO stage (ZeRO section 5.1), with our padding, fp32 masters.

    stage 0: 2M + 2M + 12M; stage 1: 2M + 2M + 12M/P; stage 2: 2M + (2 + 12)M/P; stage 3: (2 + 2 + 12)M/P.
    ``grads_pending``: measured between backward and the step, when stages 0-1 hold whole gradients (their
    ``2M`` term; those stages hold no gradient at all right after a step).
    """
    shard_world = world if stage >= 1 else 1
    chunks = _chunks(numels, shard_world)
    weights = sum(c * shard_world for c in chunks) * elem_bytes  # resident full weights, padded
    whole_grads = sum(numels) * elem_bytes if grads_pending else 0
    if stage == 3:
        return model_state_bytes(numels, world, elem_bytes, optimizer_bytes, elem_bytes)
    grad_shards = sum(chunks) * elem_bytes if stage == 2 else 0
    return weights + (whole_grads if stage < 2 else grad_shards) + sum(chunks) * optimizer_bytes
