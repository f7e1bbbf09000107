"""Shard arithmetic for one parameter: padding, chunk sizes and owned ranges.

Note [shard layout]: every parameter is flattened and zero-padded to a multiple of ``2W`` (``W`` = world size)
and cut into ``W`` equal chunks; rank ``r`` owns chunk ``r``. Padding is never read by the model (the
parameter is a view of the first ``numel`` elements) and its gradient is always zero, so optimizers keep
it at zero. A gather unit's row on a rank is the concatenation of its chunk of each of the unit's
parameters; gathering rows over a group of ``G`` ranks gives a ``[G, row]`` tensor from which parameter
``i`` is the column block ``[:, off_i : off_i + chunk_i]`` read row-major. The hpZ secondary partition uses
the same layout with ``G = s`` (``W`` is a multiple of ``s``, so the padded size divides by ``s`` too).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of ``numel`` elements is split over ``world`` ranks."""

    numel: int
    shape: torch.Size
    world: int

    # computed once (the hot path reads them per unit and parameter); a frozen dataclass keeps them valid
    @cached_property
    def chunk(self) -> int:
        """Elements per rank, padding included: ceil(numel / world) rounded up to even, at least 2.

        Even chunks keep every row whole bytes when packed two int4 values per byte, whatever the bucket
        composition; a minimum of 2 keeps rows non-empty for parameters smaller than the world.
        """
        return max(2, 2 * -(-self.numel // (2 * self.world)))

    @cached_property
    def padded(self) -> int:
        return self.chunk * self.world

    def chunk_for(self, group_size: int) -> int:
        """Chunk length when the padded parameter is split over ``group_size`` ranks (hpZ)."""
        if self.padded % group_size:
            raise ValueError(f"padded size {self.padded} does not split over {group_size} ranks")
        return self.padded // group_size

    def owned(self, rank: int) -> tuple[int, int]:
        """The [start, stop) range of real (unpadded) elements rank owns; may be empty."""
        start = min(rank * self.chunk, self.numel)
        stop = min(start + self.chunk, self.numel)
        return start, stop


@dataclass(frozen=True)
class RowLayout:
    """Column offsets of each parameter's chunk inside a unit's row, for one group size."""

    chunks: tuple[int, ...]

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for c in self.chunks:
            out.append(acc)
            acc += c
        return tuple(out)

    @cached_property
    def numel(self) -> int:
        return sum(self.chunks)


def take_chunk(full: torch.Tensor, spec: ShardSpec, index: int, group_size: int) -> torch.Tensor:
    """Chunk ``index`` of ``full`` split over ``group_size`` ranks, zero-padded, as a new 1-D tensor."""
    c = spec.chunk_for(group_size)
    flat = full.reshape(-1)
    out = torch.zeros(c, dtype=full.dtype, device=full.device)
    start = min(index * c, spec.numel)
    stop = min(start + c, spec.numel)
    out[: stop - start].copy_(flat[start:stop])
    return out
