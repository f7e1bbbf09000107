"""``TiledLinear`` without an engine: its cut, its errors, chained split inputs and outputs, and how its tiles
become gather units (tests/dist/test_tiled_linear.py runs it under stage 3)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zeropp.partition.assign import plan_units, set_leaf
from zeropp.zero import TiledLinear
from zeropp.zero.tiling import split_sizes


def test_the_cut_is_deepspeeds_and_bad_splits_are_refused() -> None:
    assert split_sizes(70, 3) == [23, 23, 24] and split_sizes(8, 8) == [1] * 8
    with pytest.raises(ValueError, match="splits must be >= 1"):
        TiledLinear(8, 8, in_splits=0)
    with pytest.raises(ValueError, match="9 splits of 8 features"):
        TiledLinear(8, 8, out_splits=9)
    with pytest.raises(ValueError, match=r"expected a weight of shape \(6, 8\), got \(8, 6\)"):
        TiledLinear(8, 6, init_linear=nn.Linear(6, 8))
    with pytest.raises(ValueError, match="has a bias, the source has none"):
        TiledLinear(8, 6, init_linear=nn.Linear(8, 6, bias=False))
    with pytest.raises(ValueError, match="last dimension is 7, expected 8"):
        TiledLinear(8, 6)(torch.zeros(2, 7))


def test_split_outputs_feed_the_next_tiled_layer_as_split_inputs() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(12, 10), nn.Linear(10, 5, bias=False)
    first = TiledLinear(12, 10, in_splits=2, out_splits=3, combine_out_splits=False, init_linear=a)
    second = TiledLinear(10, 5, bias=False, in_splits=3, input_is_already_split=True, init_linear=b)
    x = torch.randn(4, 7, 12)
    parts = first(x)
    assert [p.shape[-1] for p in parts] == [3, 3, 4]
    torch.testing.assert_close(second(parts), b(a(x)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expects 3 inputs, got 2"):
        second(parts[:2])


def test_each_tile_is_its_own_unit_inside_a_block_unless_a_leaf_holds_it() -> None:
    model = nn.Sequential(nn.ModuleList([nn.Sequential(nn.LayerNorm(6), TiledLinear(6, 4, in_splits=2,
                                                                                     out_splits=2))]))
    units = {u.module_name: sorted(n for n, _ in u.params) for u in plan_units(model, "block")}
    assert units["0.0"] == ["0.0.0.bias", "0.0.0.weight"]  # the block keeps its norm
    assert units["0.0.1.linears.1.1"] == ["0.0.1.linears.1.1.bias", "0.0.1.linears.1.1.weight"]
    assert len(units) == 5
    set_leaf(model[0][0])
    try:
        assert [u.module_name for u in plan_units(model, "block")] == ["0.0"]  # a leaf is gathered whole
    finally:
        set_leaf(model[0][0], False)
