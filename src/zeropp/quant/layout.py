"""Block structure shared by every row handed to the quantizers.

A *row* is the flat concatenation of several parameter chunks (segments). Quantization blocks are cut per
segment, so a block never straddles two parameters: a LayerNorm gain of magnitude 1 never shares a scale with
a projection weight of magnitude 1e-3 (a known fault of the public ZeRO++ kernels, see ZEROPP_NOTES.md).

Because blocks are cut segment by segment and segments are concatenated, the blocks of a row tile
``[0, numel)`` contiguously: block ``b`` covers ``[starts[b], starts[b + 1])``. Every kernel works from that
boundary array; the spec additionally uses a zero-padded ``[num_blocks, block_size]`` scratch view.

Index tensors depend only on the layout, which is reused every training step, so they are built once and
cached (``functools.lru_cache`` keyed by the frozen, hashable layout).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["BlockLayout", "LayoutIndex", "layout_index", "payload_bytes"]


@dataclass(frozen=True)
class BlockLayout:
    """Block structure of ONE row.

    The row is the concatenation of ``segments`` (one per parameter chunk, in order); each segment is cut into
    blocks of ``block_size`` elements, its last block possibly short; a block never straddles two segments.
    Zero-length segments are allowed and contribute no block. All rows quantized together share the layout.

    Attributes:
        segments: segment lengths, each ``>= 0``.
        block_size: elements per full block, ``>= 2`` and even (so int4 pairs of a full block share a byte).
    """

    segments: tuple[int, ...]
    block_size: int

    def __post_init__(self) -> None:
        # Accept any iterable of ints (a list is convenient) but store a tuple so the layout stays hashable.
        segs = tuple(int(s) for s in self.segments)
        object.__setattr__(self, "segments", segs)
        if any(s < 0 for s in segs):
            raise ValueError(f"BlockLayout: segment lengths must be >= 0, got {segs}")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 2 or bs % 2:
            raise ValueError(f"BlockLayout: block_size must be an even int >= 2, got {bs!r}")

    # cached_property writes the instance __dict__ directly, which a frozen dataclass allows; the values are
    # read on every call and a bucket layout can hold thousands of segments.
    @functools.cached_property
    def numel(self) -> int:
        """Elements in one row (sum of the segment lengths)."""
        return sum(self.segments)

    @functools.cached_property
    def num_blocks(self) -> int:
        """Blocks in one row: sum over segments of ceil(length / block_size)."""
        bs = self.block_size
        return sum(-(-s // bs) for s in self.segments)

    @functools.cached_property
    def aligned(self) -> bool:
        """True when every segment is a multiple of block_size: the row is then a plain [num_blocks, block_size]
        reshape (no scatter into a padded scratch needed)."""
        return all(s % self.block_size == 0 for s in self.segments)

    def block_segment(self) -> torch.Tensor:
        """int64 tensor [num_blocks]: index (into ``segments``) of the segment each block belongs to."""
        return layout_index(self, torch.device("cpu")).block_segment

    def block_starts(self) -> torch.Tensor:
        """int64 tensor [num_blocks + 1]: block b covers row elements [starts[b], starts[b + 1])."""
        return layout_index(self, torch.device("cpu")).block_starts


def payload_bytes(layout: BlockLayout, bits: int) -> int:
    """Bytes of quantized data for one row: int8 -> numel, int4 -> ceil(numel / 2) (two nibbles a byte),
    int2 -> ceil(numel / 4) (four 2-bit codes a byte)."""
    if bits in (8, 4, 2):
        return -(-layout.numel * bits // 8)
    raise ValueError(f"bits must be 8, 4 or 2, got {bits!r}")


class LayoutIndex(NamedTuple):
    """Index tensors derived from a layout (all int64, on one device).

    block_starts: [num_blocks + 1] block boundaries within the row.
    block_segment: [num_blocks] segment index of each block.
    scratch_pos: [numel] position of each row element in the zero-padded [num_blocks * block_size] scratch,
        or None when the layout is aligned (the scratch is then the row itself).
    """

    block_starts: torch.Tensor
    block_segment: torch.Tensor
    scratch_pos: torch.Tensor | None


@functools.lru_cache(maxsize=64)
def layout_index(layout: BlockLayout, device: torch.device) -> LayoutIndex:
    """Build (once per layout and device) the index tensors the quantizers need. Not to be mutated."""
    bs = layout.block_size
    segs = torch.tensor(layout.segments, dtype=torch.int64)
    blocks_per_seg = (segs + bs - 1) // bs
    nb = int(blocks_per_seg.sum())
    block_segment = torch.repeat_interleave(torch.arange(len(layout.segments)), blocks_per_seg)
    seg_start = torch.cumsum(segs, 0) - segs  # row offset of each segment
    # Block k-th within its segment starts at seg_start + k * bs.
    first_block = torch.cumsum(blocks_per_seg, 0) - blocks_per_seg
    k_in_seg = torch.arange(nb) - first_block[block_segment]
    starts = torch.empty(nb + 1, dtype=torch.int64)
    starts[:nb] = seg_start[block_segment] + k_in_seg * bs
    starts[nb] = layout.numel
    scratch_pos = None
    if not layout.aligned:
        lengths = starts[1:] - starts[:-1]
        elem_block = torch.repeat_interleave(torch.arange(nb), lengths)
        scratch_pos = elem_block * bs + (torch.arange(layout.numel) - starts[:-1][elem_block])
        scratch_pos = scratch_pos.to(device)
    return LayoutIndex(starts.to(device), block_segment.to(device), scratch_pos)
