"""What the engine is handed instead of switches: how weights are gathered in each pass, how gradients are
reduced, and how units of frozen parameters are built (``zeropp.api.build_strategies`` picks them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import nn

from zeropp.comm.strategy import GatherStrategy, ReduceStrategy, SecondaryCopy
from zeropp.partition.unit import Unit


class FrozenUnits(Protocol):
    """Builds the units of parameters frozen at ``initialize`` (``plus/frozen.py``: kept as int8 only)."""

    def make_unit(self, index: int, module_name: str, named_params: list[tuple[str, nn.Parameter]], world: int,
                  rank: int, compute_dtype: torch.dtype, chunks: Optional[list[Optional[torch.Tensor]]] = None
                  ) -> Unit: ...


@dataclass(frozen=True)
class Strategies:
    """How weights are gathered in each pass and how gradients are reduced."""

    forward_gather: GatherStrategy
    backward_gather: GatherStrategy
    reduce: ReduceStrategy
    frozen_units: Optional[FrozenUnits] = None  # stage 3: units for frozen parameters (None: plain units)
    secondary: Optional[SecondaryCopy] = None  # hpZ's secondary partition, for readers of a parameter's slice
