"""Frozen weights kept quantized (DeepSpeed's ``zero_quantized_nontrainable_weights``).

Note [quantized frozen weights]: a parameter with ``requires_grad=False`` at ``initialize`` is never stepped,
so it needs neither an fp32 master nor a 16-bit shard: each rank keeps its chunk only as block-quantized int8
plus fp32 scales, in exactly qwZ's wire format (``plus/wire.py``), quantized once from the fp32 values. A
gather sends that stored row as it is (no quantization in the step), and every receiver dequantizes the rows
into the compute dtype, so all ranks, forward and backward, see the same weights: ``deq(q(w))``. Per element
and rank that is ``1 + 4 / block`` bytes instead of 2 (bf16 shard) + 4 (fp32 master).

* Units: a unit holds frozen or trainable parameters, never both (the engine splits a module's parameters
  in two units, gathered by the same hooks: Note [frozen units] in ``partition/unit.py``), so the trainable
  unit's rows keep their layout and the frozen unit holds only its int8 row (:class:`QuantizedFrozenUnit`).
* hpZ: the secondary copy of a frozen unit is its slice of the received int8 rows (``W / s`` whole rows),
  not a re-quantization of the dequantized weights, so a gather from it yields the very same bytes. The
  weights never change in a step, so the copy stays current across steps: after the first forward, every
  gather of a frozen unit stays inside the node.
* Writes (a state-dict or checkpoint load, ``GatheredParameters(modifier_rank=...)``) go through
  :meth:`QuantizedFrozenUnit.master_views`, fp32 views of a dequantized copy made for the write, and are
  re-quantized by ``refresh_shard_from_master`` (which the engine calls after every such write); unchanged
  values leave the int8 row and its version alone.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from zeropp.comm.buffers import BufferPools
from zeropp.comm.gather import Arrival, WorldRoute
from zeropp.comm.ledger import Phase
from zeropp.comm.ops import Comm
from zeropp.comm.strategy import GatherStrategy, PendingGather
from zeropp.partition.unit import FrozenUnit, Unit
from zeropp.plus.hpz import SecondaryStore
from zeropp.plus.qwz import PendingQuantized, WeightChecks
from zeropp.plus.wire import WireFormat, decode_rows, encode_rows
from zeropp.quant import BlockLayout
from zeropp.topology import Group


class QuantizedFrozenUnit(FrozenUnit):
    """A unit of frozen parameters whose only state on this rank is ``qrow``: its chunk as int8 + scales."""

    holds_master = False

    def __init__(self, index: int, module_name: str, named_params: list[tuple[str, nn.Parameter]], world: int,
                 rank: int, compute_dtype: torch.dtype, bits: int, block: int,
                 device: Optional[torch.device] = None, chunks: Optional[list[Optional[torch.Tensor]]] = None) -> None:
        self._dense: Optional[torch.Tensor] = None
        # the base class cuts the fp32 chunk into `master` (here: the transient dense row) and frees the weights
        super().__init__(index, module_name, named_params, world, rank, compute_dtype, keep_shard=False,
                         device=device, chunks=chunks)
        self.fmt = WireFormat(BlockLayout(self.row.chunks, block), bits)
        self.qrow = torch.empty(self.fmt.row_bytes, dtype=torch.uint8, device=self.device)
        dense, self._dense, self._master_views = self._dense, None, []
        assert dense is not None
        self._encode(dense)

    # the base class assigns `self.master` once; here it is the transient fp32 row of a write (or of __init__)
    @property
    def master(self) -> torch.Tensor:  # type: ignore[override]
        """The fp32 row being written (see :meth:`master_views`), else a dequantized copy made for the caller."""
        return self._dense if self._dense is not None else self.dequantized()

    @master.setter
    def master(self, row: torch.Tensor) -> None:
        self._dense = row

    def _encode(self, dense: torch.Tensor) -> None:
        scales = torch.empty(1, self.fmt.layout.num_blocks, dtype=torch.float32, device=self.device)
        encode_rows(self.fmt, [dense.to(self.device)], self.qrow.view(1, -1), scales)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's row dequantized (a new tensor; non-finite blocks come out NaN)."""
        out = torch.empty(1, self.fmt.layout.numel, dtype=dtype, device=self.device)
        scales = torch.empty(1, self.fmt.layout.num_blocks, dtype=torch.float32, device=self.device)
        decode_rows(self.fmt, self.qrow.view(1, -1), dtype, out, scales)
        return out[0]

    def master_views(self) -> list[torch.Tensor]:
        """fp32 views of a dequantized copy, for writing; :meth:`refresh_shard_from_master` re-quantizes it."""
        if self._dense is None:
            self._dense = self.dequantized()
            self._master_views = self._split(self._dense)
        return self._master_views

    def master_values(self) -> list[torch.Tensor]:
        return self._split(self.master)

    def shard_row(self) -> torch.Tensor:
        raise RuntimeError(f"unit {self.module_name!r} keeps its frozen weights as int8 only; gather its `qrow` "
                           "(FrozenGather), not a 16-bit shard")

    def quantized_state(self) -> Optional[torch.Tensor]:
        return self.qrow

    def load_quantized_state(self, row: torch.Tensor) -> None:
        if not torch.equal(row.to(self.device), self.qrow):
            self.qrow.copy_(row)
            self.version += 1

    def refresh_shard_from_master(self, recast: bool = True) -> None:
        """After a write through :meth:`master_views`: re-quantize (and bump the version) if values changed."""
        if self._dense is None:
            return
        dense, self._dense, self._master_views = self._dense, None, []
        if torch.equal(dense.to(self.device), self.dequantized()):
            return
        self._encode(dense)
        self.version += 1


@dataclass(frozen=True)
class QuantizedFrozenUnits:
    """How the engine builds units for frozen parameters: int8 rows at ``block`` elements per scale."""

    bits: int = 8
    block: int = 2048

    def make_unit(self, index: int, module_name: str, named_params: list[tuple[str, nn.Parameter]], world: int,
                  rank: int, compute_dtype: torch.dtype,
                  chunks: Optional[list[Optional[torch.Tensor]]] = None) -> QuantizedFrozenUnit:
        return QuantizedFrozenUnit(index, module_name, named_params, world, rank, compute_dtype, self.bits,
                                   self.block, chunks=chunks)


class FrozenGather:
    """Gather a :class:`QuantizedFrozenUnit`'s stored int8 rows over the world, or over the hpZ group from the
    slices kept at the last world gather (Note [quantized frozen weights])."""

    keeps_copies = False  # its slices are kept as a world gather arrives, not on release

    def __init__(self, comm: Comm, hpz: Optional[Group] = None) -> None:
        self.comm = comm
        self.world = WorldRoute(comm)  # Note [two-hop gather] in comm/gather.py
        self.hpz = hpz if hpz is not None and hpz.size > 1 else None
        self.store = SecondaryStore()  # its rows are int8 wire rows here, W / s of them per unit
        self.pools = BufferPools("frozen", "recv", "hop1", "out", "scales")
        self.checks = WeightChecks()  # Note [deferred weight checks] in qwz.py

    def start(self, unit: Unit, phase: Phase) -> PendingGather:
        if not isinstance(unit, QuantizedFrozenUnit):
            raise TypeError(f"unit {unit.module_name!r} holds no quantized frozen row")
        keep = None
        if self.hpz is not None and self.store.is_current(unit):
            rb, w = unit.fmt.row_bytes, self.world.size
            received = self.pools["recv"].take(w * rb, torch.uint8, unit.device).view(w, rb)
            arrival = Arrival(received, [self.comm.all_gather(received, self.store.rows[unit.index], self.hpz, phase,
                                                              async_op=True)])
        else:
            arrival = self.world.start(unit.qrow, self.pools["recv"], self.pools["hop1"], phase)
            if self.hpz is not None:
                keep = functools.partial(self._keep, unit.index, unit.version)
        return PendingQuantized(self.pools, unit.fmt, None, arrival, unit, self.checks, keep)

    def two_hop(self, unit: Unit) -> bool:
        return not (self.hpz is not None and self.store.is_current(unit)) and self.world.two_hop

    def _keep(self, index: int, version: int, received: torch.Tensor) -> None:
        """Keep this rank's ``W / s`` consecutive rows: the hpZ group's slices concatenate to all W rows."""
        assert self.hpz is not None
        per = received.shape[0] // self.hpz.size
        i = self.hpz.index_of(self.comm.topo.rank)
        self.store.put(index, version, received[i * per : (i + 1) * per].reshape(-1))

    def on_release(self, unit: Unit) -> None:
        pass

    def check_deferred(self) -> None:
        self.checks.raise_first()

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.store.rows.values())

    def buffer_bytes(self) -> dict[str, int]:
        return self.pools.buffer_bytes()


class FrozenApart:
    """A gather strategy that sends quantized frozen units to ``frozen`` and every other unit to ``trainable``.

    Both passes share one ``frozen``; only the one built with ``reports_frozen`` lists its buffers, so the
    memory report counts them once.
    """

    def __init__(self, trainable: GatherStrategy, frozen: FrozenGather, reports_frozen: bool = True) -> None:
        self.keeps_copies = trainable.keeps_copies
        self.trainable = trainable
        self.frozen = frozen
        self.reports_frozen = reports_frozen

    def _pick(self, unit: Unit) -> GatherStrategy:
        return self.frozen if isinstance(unit, QuantizedFrozenUnit) else self.trainable

    def start(self, unit: Unit, phase: Phase) -> PendingGather:
        return self._pick(unit).start(unit, phase)

    def two_hop(self, unit: Unit) -> bool:
        return self._pick(unit).two_hop(unit)

    def on_release(self, unit: Unit) -> None:
        self._pick(unit).on_release(unit)

    def check_deferred(self) -> None:
        self.trainable.check_deferred()
        self.frozen.check_deferred()

    def held_tensors(self) -> list[torch.Tensor]:
        return self.trainable.held_tensors() + self.frozen.held_tensors()

    def buffer_bytes(self) -> dict[str, int]:
        own = self.frozen.buffer_bytes() if self.reports_frozen else {}
        return {**self.trainable.buffer_bytes(), **own}
