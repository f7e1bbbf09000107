"""The bucket layout of stages 0-2 (Note [positional buckets] in ``zero/buckets.py``): cut as buckets were cut
when filled in arrival order, one place per run of a parameter."""
from __future__ import annotations

import torch
from torch import nn

from zeropp.partition.unit import Unit
from zeropp.zero.buckets import BucketLayout


def _unit(index: int, *sizes: int, world: int = 2) -> Unit:
    params = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    return Unit(index, f"u{index}", params, world, 0, torch.float32)


def test_buckets_close_before_a_gradient_would_pass_the_capacity() -> None:
    a, b = _unit(0, 10, 6), _unit(1, 30)
    # padded to a multiple of 2W = 4: 12, 8, 32; capacity 20: [12 + 8] is full, 32 is one larger parameter alone
    layout = BucketLayout([(a, 0), (a, 1), (b, 0)], capacity=20)
    assert [[(p.unit.index, p.slot) for p in plan.places] for plan in layout.plans] == [[(0, 0), (0, 1)], [(1, 0)]]
    assert [plan.length for plan in layout.plans] == [6 + 4, 16]  # columns: chunks of W = 2 rows
    assert [p.offset for p in layout.plans[0].places] == [0, 6]
    # 12 + 32 would pass 20: the first bucket closes before b's gradient
    assert len(BucketLayout([(a, 0), (b, 0)], capacity=20).plans) == 2


def test_each_run_of_a_parameter_has_its_own_place() -> None:
    a, b = _unit(0, 4), _unit(1, 4)
    layout = BucketLayout([(a, 0), (b, 0), (a, 0)], capacity=8)
    assert layout.index[(0, 0)] == [(0, 0), (1, 0)] and layout.index[(1, 0)] == [(0, 1)]
    assert layout.keys == ((0, 0), (1, 0), (0, 0))
    assert layout.plans[1].lone  # one unpadded gradient: reduced as it is, no copy
    assert not layout.plans[0].lone
