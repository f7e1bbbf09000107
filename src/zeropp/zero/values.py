"""Where each unit's first values come from at ``initialize``: one model on every rank.

Note [one model at initialize]: each rank keeps only its chunk of every parameter, so if the ranks built
different models (other seeds, pretrained weights loaded on rank 0 only, zeros elsewhere), the model that
trains is a patchwork of them, and nothing would say so. ``initialize`` therefore agrees first (one small
all-gather) on how the ranks built the model, and takes the values accordingly, unit by unit:

* parameters partitioned at construction (``zero.Init``, ``zero/construction.py``) already hold rank 0's
  values: each rank's chunk is taken as it is;
* every rank built on the meta device: every rank materializes and initializes each unit from rank 0's
  random state (:func:`agreed_rng`), so all compute the same values and keep their chunk;
* otherwise (the default, ``broadcast_rank0_weights: true``): rank 0 scatters each unit's chunks, one
  collective per unit, and broadcasts the buffers. Rank 0 holds one unit's rows beyond its model, every other
  rank one row; ranks other than 0 may even have built on the meta device (then they only allocate);
* with ``broadcast_rank0_weights: false`` each rank keeps its own values, and a digest per unit (three
  float64 sums) is compared at the end: ranks that disagree get a warning naming the first unit.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator, Optional

import torch
from torch import nn

from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm
from zeropp.zero.construction import PARAMS
from zeropp.partition.spec import RowLayout, ShardSpec

log = logging.getLogger("zeropp")


class RankDisagreementWarning(UserWarning):
    """Ranks hold different weights at ``initialize`` and were not asked to take rank 0's."""


@contextlib.contextmanager
def agreed_rng(comm: Comm) -> Iterator[None]:
    """Run the block from rank 0's host random state on every rank (a meta model's initialization). A rank
    whose own state differed gets it back afterwards; ranks seeded alike go on from where the block left."""
    own = torch.get_rng_state()
    state = own.clone()
    comm.broadcast(state, 0, comm.topo.world, Phase.OTHER)
    differed = not torch.equal(state, own)
    torch.set_rng_state(state)
    try:
        yield
    finally:
        if differed:
            torch.set_rng_state(own)


class Plan:
    """How this initialize takes values (Note [one model at initialize]), agreed by every rank."""

    def __init__(self, meta_init: bool, meta_alloc: bool, from_rank0: bool) -> None:
        self.meta_init = meta_init  # every rank built on meta: materialize and initialize alike
        self.meta_alloc = meta_alloc  # this rank built on meta and rank 0 did not: allocate, values from rank 0
        self.from_rank0 = from_rank0

    @staticmethod
    def agree(comm: Comm, module: nn.Module, meta_here: bool, broadcast: bool) -> "Plan":
        """One all-gather of (built on meta, parameters partitioned at construction) from every rank."""
        held = sum(1 for p in module.parameters() if PARAMS.get(p) is not None)
        mine = torch.tensor([float(meta_here), float(held)])
        everyone = torch.empty(comm.topo.world_size, 2)
        comm.all_gather(everyone, mine, comm.topo.world, Phase.OTHER)
        metas = [bool(m) for m in everyone[:, 0].tolist()]
        counts = [int(c) for c in everyone[:, 1].tolist()]
        if len(set(counts)) > 1:
            raise ValueError(f"initialize: the ranks hold different numbers of parameters partitioned at "
                             f"construction (zero.Init): {counts} by rank; build the model the same way on every "
                             "rank (all under zero.Init, or none)")
        if all(metas):
            return Plan(meta_init=True, meta_alloc=False, from_rank0=False)
        if metas[0]:
            raise ValueError(f"initialize: rank 0 built the model on the meta device and ranks "
                             f"{[r for r, m in enumerate(metas) if not m]} did not; the values are taken from "
                             "rank 0, so rank 0 must hold real weights (or every rank build on meta)")
        if any(metas) and not broadcast:
            warnings.warn("initialize: ranks built on the meta device take their values from rank 0 although "
                          "broadcast_rank0_weights is false (they have no values of their own)", stacklevel=3)
        return Plan(meta_init=False, meta_alloc=meta_here, from_rank0=broadcast or any(metas))


class UnitValues:
    """Each unit's chunks as the agreed :class:`Plan` says; :meth:`finish` checks buffers and digests."""

    def __init__(self, comm: Comm, plan: Plan) -> None:
        self.comm = comm
        self.plan = plan
        self.digests: list[tuple[str, torch.Tensor]] = []

    def chunks(self, unit_name: str, params: list[tuple[str, nn.Parameter]], world: int,
               rank: int) -> list[Optional[torch.Tensor]]:
        """This rank's chunk of each parameter over ``world`` (None: the unit cuts it from the parameter)."""
        out: list[Optional[torch.Tensor]] = [None] * len(params)
        for i, (_, p) in enumerate(params):
            if PARAMS.get(p) is not None:
                out[i] = PARAMS.chunk(p, ShardSpec(p.numel(), p.shape, world), rank)
        rest = [i for i in range(len(params)) if out[i] is None]
        if not rest:
            return out
        if self.plan.from_rank0:
            for i, chunk in zip(rest, self._from_rank0([params[i][1] for i in rest], world)):
                out[i] = chunk
        elif not self.plan.meta_init:
            self.digests.append((unit_name, _digest([params[i][1] for i in rest])))
        return out

    def _from_rank0(self, params: list[nn.Parameter], world: int) -> list[torch.Tensor]:
        """Rank 0's chunks of ``params`` (fp32, what the master keeps): scattered, or broadcast whole when every
        rank keeps the whole parameter (``world`` 1, stage 0)."""
        comm = self.comm
        specs = [ShardSpec(p.numel(), p.shape, world) for p in params]
        row = RowLayout(tuple(s.chunk for s in specs))
        device = params[0].device if params[0].device.type != "meta" else torch.device("cpu")
        source = None
        if comm.topo.rank == 0:
            source = torch.zeros(world, row.numel, dtype=torch.float32, device=device)
            for p, s, off in zip(params, specs, row.offsets):
                flat = p.detach().reshape(-1)
                for r in range(world):  # rank r's chunk of p (Note [shard layout]): no padded copy of p
                    start, stop = s.owned(r)
                    source[r, off : off + stop - start].copy_(flat[start:stop])
        if world == comm.topo.world_size:
            mine = torch.empty(row.numel, dtype=torch.float32, device=device)
            comm.scatter(mine, source, 0, comm.topo.world)
        else:
            mine = source[0] if source is not None else torch.empty(row.numel, dtype=torch.float32, device=device)
            comm.broadcast(mine, 0, comm.topo.world)
        return [mine[off : off + c] for off, c in zip(row.offsets, row.chunks)]

    def finish(self, module: nn.Module) -> None:
        """Buffers from rank 0 (when values are); compare the digests of ranks that kept their own."""
        if self.plan.from_rank0:
            for owner in module.modules():
                for name, buf in list(owner._buffers.items()):
                    if buf is None:
                        continue
                    flat = buf.contiguous()  # an expanded buffer (position ids) cannot be written in place
                    self.comm.broadcast(flat, 0, self.comm.topo.world)
                    if flat is not buf:
                        owner._buffers[name] = flat
        elif not self.plan.meta_init:
            self.digests.append(("<buffers>", _digest(list(module.buffers()))))
            self._compare()

    def _compare(self) -> None:
        comm = self.comm
        mine = torch.stack([d for _, d in self.digests]) if self.digests else torch.zeros(0, 3, dtype=torch.float64)
        raw = mine.contiguous().view(torch.uint8)
        everyone = torch.empty(comm.topo.world_size, raw.numel(), dtype=torch.uint8)
        comm.all_gather(everyone, raw.reshape(-1), comm.topo.world, Phase.OTHER)
        rows = everyone.view(torch.float64).view(comm.topo.world_size, -1, 3)
        for r in range(1, comm.topo.world_size):
            differ = [i for i in range(rows.shape[1]) if not torch.equal(rows[r, i], rows[0, i])]
            if differ:
                name = self.digests[differ[0]][0] or "<root>"
                warnings.warn(
                    f"initialize: rank {r} holds other values than rank 0 in unit {name!r}"
                    f"{f' and {len(differ) - 1} more' if len(differ) > 1 else ''}, and broadcast_rank0_weights is "
                    "false: each rank keeps its chunk of its own copy, so the model that trains mixes them. Set "
                    "broadcast_rank0_weights to true (the default), or seed and load alike on every rank",
                    RankDisagreementWarning, stacklevel=4)
                return


def _digest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Three float64 sums over ``tensors`` (all, absolute, every seventh element): equal on ranks holding
    equal values, almost surely different where the values differ."""
    out = torch.zeros(3, dtype=torch.float64)
    for t in tensors:
        if t.numel() == 0 or t.is_meta:
            continue
        flat = t.detach().reshape(-1)
        if not (flat.is_floating_point() or flat.is_complex()):
            flat = flat.double()
        out[0] += flat.sum(dtype=torch.float64).cpu()
        out[1] += flat.abs().sum(dtype=torch.float64).cpu()
        out[2] += flat[::7].sum(dtype=torch.float64).cpu()
    return out
