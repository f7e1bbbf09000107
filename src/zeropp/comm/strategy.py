"""The interfaces a stage-3 engine is handed: how to gather a unit's weights and how to reduce gradients.

The engine never asks which ZeRO++ technique is on; ``zeropp.api.build`` picks the strategies.

Buffers a strategy hands out (the gathered rows, the reduced row) belong to it and are reused for later
units once the caller says it is done with them (``recycle``; Note [buffer pool] in ``comm/buffers.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import torch

from zeropp.comm.ledger import Phase
from zeropp.partition.spec import RowLayout
from zeropp.partition.unit import Unit

if TYPE_CHECKING:
    from zeropp.topology import Group


class PendingGather(Protocol):
    def finish(self) -> tuple[torch.Tensor, RowLayout]:
        """Wait; return the gathered ``[G, layout.numel]`` rows (compute dtype) and their layout.

        The rows stay valid until :meth:`recycle`; copy out what must live longer.
        """

    def advance(self) -> None:
        """Move a two-hop gather on (Note [two-hop gather] in ``comm/gather.py``): wait for its first hop and
        issue its second without waiting for it; nothing for a one-hop gather. The engine calls it at the same
        point of the program on every rank, a unit before it needs the rows."""

    def recycle(self) -> None:
        """The caller is done with the rows ``finish`` returned: the strategy may reuse their memory.

        Never calling it is safe (the buffer is then never reused). Called before ``finish``, it waits for the
        collective and gives the buffer back; rows are not to be read after it.
        """


class GatherStrategy(Protocol):
    #: whether ``on_release`` keeps copies that later gathers read (hpZ's secondary slices); the engine then
    #: makes them at initialize (Note [hpZ slices at initialize] in ``plus/hpz.py``)
    keeps_copies: bool

    def start(self, unit: Unit, phase: Phase) -> PendingGather:
        """Issue the collectives that gather ``unit`` (asynchronously where possible)."""

    def two_hop(self, unit: Unit) -> bool:
        """Whether gathering ``unit`` now takes two hops, the first of which the engine starts a unit earlier
        than other gathers (Note [two-hop gather] in ``comm/gather.py``)."""

    def on_release(self, unit: Unit) -> None:
        """Called while ``unit`` is still gathered, just before its full weights are freed."""

    def check_deferred(self) -> None:
        """Raise what the gathers since the last call found wrong but did not raise at once: qwZ's inf/nan
        weights on CUDA, checked once per pass instead of once per unit (Note [deferred weight checks] in
        ``plus/qwz.py``). The engine calls it at the end of each forward and backward (and after stages 0-2
        rebuild their weights), on every rank."""

    def held_tensors(self) -> list[torch.Tensor]:
        """Model-state tensors the strategy keeps between steps (hpZ's secondary copies), for accounting."""

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of the temporary buffers (wire, receive, output rows) the strategy owns now, by name."""


class SecondaryCopy(Protocol):
    """hpZ's secondary partition as readers outside the gathers see it (a parameter's slice, the group)."""

    group: Group

    def slice(self, unit: Unit, index: int) -> Optional[torch.Tensor]:
        """This rank's slice of ``unit``'s parameter ``index`` (a copy, padding included), or None while the
        unit has no current slice (Note [secondary staleness] in ``plus/hpz.py``)."""


class PendingReduce(Protocol):
    def finish(self) -> torch.Tensor:
        """Wait; return this rank's fp32 row of the bucket, holding the mean over all ranks.

        The row stays valid until :meth:`recycle`.
        """

    def progress(self) -> None:
        """Advance without blocking: start any later stage whose inputs have arrived (qgZ's second hop).

        Called as backward produces gradients, so later stages overlap it; values do not depend on when.
        """

    def recycle(self) -> None:
        """The caller is done with the row ``finish`` returned: the strategy may reuse its memory."""


class ReduceStrategy(Protocol):
    def start(self, bucket: torch.Tensor, segments: Sequence[int], names: Sequence[str] = ()) -> PendingReduce:
        """Reduce a ``[W, L]`` bucket whose row ``r`` is destined for rank ``r``.

        ``segments`` are the per-parameter chunk lengths that make up ``L`` (quantization blocks never
        cross them); ``names`` the parameters they belong to (state kept per parameter, e.g. LoCo's errors).
        """

    def end_step(self, grad_scale: float = 1.0) -> None:
        """Called after every optimizer step (LoCo counts steps to its reset); ``grad_scale``: how much larger
        the next step's gradients are scaled than this one's (the fp16 loss scale's change, else 1)."""

    def state_dict(self) -> dict:
        """Training state the strategy keeps between steps (LoCo's errors), saved in checkpoints; {} if none."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (on the same topology)."""

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of the temporary buffers (wire, receive, partial-sum, result rows) the strategy owns now."""

    def buffer_bound(self, elements: int, segments: int, itemsize: int) -> int:
        """Most bytes of buffers one bucket in flight needs: ``elements`` padded elements of ``itemsize`` bytes
        in at most ``segments`` parameters (Note [buffer bounds] in ``zero/reports.py``)."""
