"""Memory-centric tiling (ZeRO-Infinity, section 5.1.3): a huge Linear as a grid of smaller ones.

``TiledLinear`` keeps DeepSpeed's name and arguments. Its weight is cut into ``out_splits x in_splits`` tiles,
each an ``nn.Linear`` (or ``linear_cls``) of its own; the forward runs them one after another and adds the
partial products of each output split. Under stage 3 every tile is its own gather unit, even inside a block
that is otherwise gathered whole (:func:`zeropp.partition.assign.set_own_unit`), so a rank never gathers more
of the operator than one tile (and the one prefetched after it), forward and backward.

Values: the tile ``(o, i)`` holds ``W[o_rows, i_cols]``; the last input split's tile of each output split
carries that split's bias, as in DeepSpeed. Each output element is the same dot product as the untiled
Linear's, with the partial sums of the input splits added in split order; that order, and the one the BLAS
picks for each shape, change the rounding within the usual bound of a dot product (derived in
tests/dist/test_tiled_linear.py), so the values are the untiled Linear's up to fp32 rounding.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from zeropp.partition.assign import set_own_unit


def split_sizes(total: int, parts: int) -> list[int]:
    """``parts`` sizes that add up to ``total``: equal, the last one taking the remainder (DeepSpeed's cut)."""
    if parts < 1:
        raise ValueError(f"TiledLinear: splits must be >= 1, got {parts}")
    if parts > total:
        raise ValueError(f"TiledLinear: {parts} splits of {total} features leave some empty")
    base = total // parts
    return [base] * (parts - 1) + [total - base * (parts - 1)]


class TiledLinear(nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` computed as ``out_splits x in_splits`` tiles.

    ``input_is_already_split``: the input is a list of ``in_splits`` tensors (the previous TiledLinear's
    output with ``combine_out_splits=False``); ``combine_out_splits=False`` returns the output splits as a
    list instead of concatenating them. ``init_linear``: an existing Linear (weights readable here, e.g.
    inside ``GatheredParameters`` under stage 3) whose weight and bias are copied into the tiles. Extra
    keyword arguments go to ``linear_cls``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type = nn.Linear, init_linear: Optional[nn.Module] = None, **kwargs: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_splits, self.out_splits = in_splits, out_splits
        self.use_bias = bias
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_sizes = split_sizes(in_features, in_splits)
        self.out_sizes = split_sizes(out_features, out_splits)
        self.linears = nn.ModuleList()
        for o, out_size in enumerate(self.out_sizes):
            row = nn.ModuleList()
            for i, in_size in enumerate(self.in_sizes):
                tile = linear_cls(in_size, out_size, bias=bias and i == in_splits - 1, **kwargs)
                set_own_unit(tile)
                row.append(tile)
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Union[torch.Tensor, Sequence[torch.Tensor]]) -> Any:
        if self.input_is_already_split:
            inputs = list(input_)  # type: ignore[arg-type]
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: input_is_already_split expects {self.in_splits} inputs, got "
                                 f"{len(inputs)}")
        else:
            assert isinstance(input_, torch.Tensor)
            if input_.shape[-1] != self.in_features:
                raise ValueError(f"TiledLinear: the input's last dimension is {input_.shape[-1]}, expected "
                                 f"{self.in_features}")
            inputs = list(torch.split(input_, self.in_sizes, dim=-1))
        outputs = []
        for row in self.linears:
            out = None
            for tile, x in zip(row, inputs):
                part = tile(x)
                out = part if out is None else out + part
            outputs.append(out)
        return torch.cat(outputs, dim=-1) if self.combine_out_splits else outputs

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy ``other.weight`` (``[out_features, in_features]``) and ``other.bias`` into the tiles."""
        weight = getattr(other, "weight", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"TiledLinear.copy_params_from: expected a weight of shape "
                             f"{(self.out_features, self.in_features)}, got "
                             f"{None if weight is None else tuple(weight.shape)}")
        bias = getattr(other, "bias", None)
        if self.use_bias and bias is None:
            raise ValueError("TiledLinear.copy_params_from: this TiledLinear has a bias, the source has none")
        rows = torch.split(weight, self.out_sizes, dim=0)
        biases = torch.split(bias, self.out_sizes) if self.use_bias else [None] * self.out_splits
        for row, w_rows, b in zip(self.linears, rows, biases):
            for tile, w in zip(row, torch.split(w_rows, self.in_sizes, dim=1)):
                tile.weight.copy_(w)
                if tile.bias is not None:
                    tile.bias.copy_(b)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"in_splits={self.in_splits}, out_splits={self.out_splits}")


__all__ = ["TiledLinear", "split_sizes"]
