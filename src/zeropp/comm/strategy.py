"""The interfaces a stage-3 engine is handed: how to gather a unit's weights and how to reduce gradients.

The engine never asks which ZeRO++ technique is on; ``zeropp.api.initialize`` picks the strategies.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from zeropp.comm.ledger import Phase
from zeropp.partition.spec import RowLayout
from zeropp.partition.unit import Unit


class PendingGather(Protocol):
    def finish(self) -> tuple[torch.Tensor, RowLayout]:
        """Wait; return the gathered ``[G, layout.numel]`` rows (compute dtype) and their layout."""


class GatherStrategy(Protocol):
    def start(self, unit: Unit, phase: Phase) -> PendingGather:
        """Issue the collectives that gather ``unit`` (asynchronously where possible)."""

    def on_release(self, unit: Unit) -> None:
        """Called while ``unit`` is still gathered, just before its full weights are freed."""

    def held_tensors(self) -> list[torch.Tensor]:
        """Model-state tensors the strategy keeps between steps (hpZ's secondary copies), for accounting."""


class PendingReduce(Protocol):
    def finish(self) -> torch.Tensor:
        """Wait; return this rank's fp32 row of the bucket, holding the mean over all ranks."""


class ReduceStrategy(Protocol):
    def start(self, bucket: torch.Tensor, segments: Sequence[int]) -> PendingReduce:
        """Reduce a ``[W, L]`` bucket whose row ``r`` is destined for rank ``r``.

        ``segments`` are the per-parameter chunk lengths that make up ``L`` (quantization blocks never
        cross them).
        """
