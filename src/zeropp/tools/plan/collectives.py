"""Every collective the engine issues, with its bytes from ``accounting.py`` and its time on a :class:`Hardware`.

Bytes are the ledger's (what one rank receives, split intra-/inter-node), computed by the same formulas the
tests match against the ledger exactly. Time needs what crosses each physical link, which depends on the
collective's pattern (gloo's, as the ledger counts them; NCCL's rings behave alike):

* ring (``all_gather``, ``all_reduce``; groups are node-contiguous): every ring edge carries what one rank
  receives, and one edge leaves each node, so a node's link carries the per-rank total (intra + inter).
* all-to-all, and the first hop of a two-hop world gather (``all_gather_inter``: one rank per node, a group per
  local index): every rank sends its own rows to every member, so a node's link carries (members on the node) x
  (what one rank receives from other nodes); calibrated by probes of both over the inter-node group (a profile
  without the gather's uses the all-to-all's: between two nodes the two are the same exchange). The plain
  reduce-scatter is one all-to-all over the world (``comm/reduce.py``): with D ranks per node it puts D x (W - D) /
  (W - 1) times a ring's bytes on the link.

Time of one collective: ``max(host, alpha + inter wire / (rate x efficiency), intra wire / intra rate)``, where
``host`` is its alpha-beta time on the unshaped link (CPU ranks: copying through the kernel is the cost) and
the efficiency on a shaped link comes from the profile (the link's streaming efficiency, Note [streaming link
efficiency] in ``hardware.py``; else ``GPU_DEFAULTS``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from zeropp import accounting
from zeropp.accounting import Volume
from zeropp.partition.spec import ShardSpec
from zeropp.tools.plan.choices import Choice
from zeropp.tools.plan.hardware import Hardware
from zeropp.topology import Layout

RING = ("all_gather", "all_reduce", "intra_all_gather", "ring_reduce_scatter")


@dataclass(frozen=True)
class Collective:
    """One collective as rank 0 sees it: the ledger phase, the pattern, and the bytes it receives."""

    phase: str
    pattern: str  # all_gather | all_gather_inter | all_to_all | all_to_all_inter | all_reduce | intra_all_gather |
    # intra_all_to_all | ring_reduce_scatter
    volume: Volume
    group_size: int
    members_per_node: int  # senders sharing one node's link at once

    @property
    def received(self) -> int:
        return self.volume.intra_node_bytes + self.volume.inter_node_bytes


def wire_bytes_per_node(pattern: str, received: float, nodes: int, ranks_per_node: int) -> float:
    """Bytes one node's link carries (one direction) for a collective whose ranks each receive ``received``
    bytes in all, for the patterns the calibration probes (over the world, or one rank per node)."""
    if nodes < 2:
        return 0.0
    w, d = nodes * ranks_per_node, ranks_per_node
    if pattern in ("all_gather", "all_reduce"):
        return received
    if pattern == "all_to_all":
        return d * received * (w - d) / (w - 1)
    if pattern in ("all_to_all_inter", "all_gather_inter"):  # every local index's group at once
        return d * received
    return 0.0


def inter_wire(c: Collective) -> float:
    if c.volume.inter_node_bytes == 0:
        return 0.0
    if c.pattern in RING:
        return float(c.received)
    return float(c.members_per_node * c.volume.inter_node_bytes)


def intra_wire(c: Collective) -> float:
    if c.pattern in RING:
        return float(c.received)
    return float(c.volume.intra_node_bytes)


def _host_pattern(c: Collective, hw: Hardware) -> str:
    """Which measured host fit times ``c``: the world's fits, or the node's when the world is one node; a
    two-hop gather's first hop by its own fits, or (profiles made before it was probed) the all-to-all's
    among the same ranks."""
    pattern = {"ring_reduce_scatter": "all_gather"}.get(c.pattern, c.pattern)
    if pattern == "all_gather_inter" and pattern not in hw.host_fits and pattern not in hw.shaped_fits:
        pattern = "all_to_all_inter"
    if hw.nodes == 1 and pattern in ("all_gather", "all_to_all"):
        return "intra_" + pattern
    return pattern


def duration(c: Collective, hw: Hardware) -> tuple[float, float]:
    """``(seconds, host seconds)`` of ``c`` on ``hw``; host seconds are what it costs the rank's processors."""
    if c.received == 0:
        return 0.0, 0.0
    host = 0.0
    fit = hw.host_fits.get(_host_pattern(c, hw))
    if fit is not None:
        host = fit.seconds(c.received)
    wire = 0.0
    if hw.inter_bytes_per_s and c.volume.inter_node_bytes:
        pattern = _host_pattern(c, hw)
        shaped = hw.shaped_fits.get(pattern)
        alpha = shaped.alpha_s if shaped is not None else (c.group_size - 1) * hw.inter_latency_s
        wire = alpha + inter_wire(c) / (hw.inter_bytes_per_s * hw.efficiency(pattern))
    intra = 0.0
    if hw.intra_bytes_per_s and c.volume.intra_node_bytes:
        intra = (c.group_size - 1) * hw.intra_latency_s + intra_wire(c) / hw.intra_bytes_per_s
    return max(host, wire, intra), host


# ---- the engine's collectives -------------------------------------------------------------------------------
def _elem(choice: Choice, bf16: bool) -> int:
    return 2 if bf16 else 4


def world_gather(phase: str, v: Volume, layout: Layout) -> list[Collective]:
    """An all-gather over the world as the engine routes it (Note [two-hop gather] in ``comm/gather.py``):
    one ring, or on several nodes of several ranks a gather among the ranks of one local index (each node's
    link carries one such group per local index at once) followed by one inside the node. The engine issues
    the second hop when the first has arrived."""
    w, d, n = layout.world_size, layout.ranks_per_node, layout.num_nodes
    if n > 1 and d > 1:
        return [Collective(phase, "all_gather_inter", Volume(0, v.inter_node_bytes), n, d),
                Collective(phase, "intra_all_gather", Volume(v.intra_node_bytes, 0), d, d)]
    return [Collective(phase, "all_gather", v, w, d)]


def forward_gather(numels: Sequence[int], choice: Choice, layout: Layout, bf16: bool, block: int,
                   secondary_current: bool) -> list[Collective]:
    """A unit's forward gather: qwZ's quantized rows or plain 16-bit rows over the world; from the hpZ slices
    over the hpZ group when they are current (a later micro-step of the same optimizer step)."""
    if choice.hpz > 1 and secondary_current:
        return [_hpz(numels, choice, layout, bf16, "forward_gather")]
    if choice.qwz_bits:
        v = accounting.quantized_gather_volume(numels, layout, 0, choice.qwz_bits, block)
    else:
        v = accounting.gather_volume(numels, layout, 0, _elem(choice, bf16))
    return world_gather("forward_gather", v, layout)


def _hpz(numels: Sequence[int], choice: Choice, layout: Layout, bf16: bool, phase: str) -> Collective:
    v = accounting.hpz_gather_volume(numels, layout, 0, choice.hpz, _elem(choice, bf16))
    pattern = "intra_all_gather" if choice.hpz <= layout.ranks_per_node else "all_gather"
    return Collective(phase, pattern, v, choice.hpz, min(choice.hpz, layout.ranks_per_node))


def backward_gather(numels: Sequence[int], choice: Choice, layout: Layout, bf16: bool) -> list[Collective]:
    """A unit's backward gather: from the hpZ slices (cut when forward released the unit) or plain 16-bit."""
    if choice.hpz > 1:
        return [_hpz(numels, choice, layout, bf16, "backward_gather")]
    return world_gather("backward_gather", accounting.gather_volume(numels, layout, 0, _elem(choice, bf16)), layout)


def resident_gather(numels: Sequence[int], layout: Layout, bf16: bool, stage: int) -> list[Collective]:
    """Stages 1-2 after an optimizer step: the full 16-bit weights rebuilt from the shards (stage 0: local)."""
    if stage == 0 or layout.world_size == 1:
        return []
    return world_gather("forward_gather", accounting.gather_volume(numels, layout, 0, 2 if bf16 else 4), layout)


def allreduce_volume(numels: Sequence[int], layout: Layout, rank: int, elem_bytes: int) -> Volume:
    """Stage 0's gradient all-reduce of one ``[1, L]`` fp32 bucket, as ``Comm.all_reduce`` counts a ring:
    ``2 L e // W`` bytes from each other rank (accounting.py has the norm's case, not this one)."""
    row = sum(ShardSpec(n, (n,), 1).chunk for n in numels)
    per_peer = 2 * row * elem_bytes // layout.world_size
    node = layout.node_of(rank)
    intra = sum(1 for r in range(layout.world_size) if r != rank and layout.node_of(r) == node)
    return Volume(intra * per_peer, (layout.world_size - 1 - intra) * per_peer)


def reduce(numels: Sequence[int], choice: Choice, layout: Layout, bf16: bool, block: int,
           ring: bool = False) -> list[Collective]:
    """One gradient bucket's reduction: stage 0's fp32 all-reduce, the plain all-to-all reduce-scatter (``ring``:
    a ring reduce-scatter instead, as NCCL's under DeepSpeed; the same bytes per rank, a ring's on the wire), or
    qgZ's two hops (inside the node, then among the ranks with the same local index)."""
    w, d, n = layout.world_size, layout.ranks_per_node, layout.num_nodes
    if w == 1:
        return []
    if choice.stage == 0:
        return [Collective("grad_reduce", "all_reduce", allreduce_volume(numels, layout, 0, 4), w, d)]
    if not choice.qgz_bits:
        v = accounting.reduce_scatter_volume(numels, layout, 0, _elem(choice, bf16))
        return [Collective("grad_reduce", "ring_reduce_scatter" if ring else "all_to_all", v, w, d)]
    both = accounting.qgz_volume(numels, layout, 0, choice.qgz_bits, block)
    hops = []
    if d > 1:
        hops.append(Collective("grad_reduce", "intra_all_to_all", Volume(both.intra_node_bytes, 0), d, d))
    if n > 1:
        hops.append(Collective("grad_reduce", "all_to_all_inter", Volume(0, both.inter_node_bytes), n, d))
    return hops


def grad_norm(layout: Layout) -> Collective:
    return Collective("other", "all_reduce", accounting.grad_norm_volume(layout, 0), layout.world_size,
                      layout.ranks_per_node)
