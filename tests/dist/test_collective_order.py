"""Ranks that run different sub-modules in a step are refused at stage 3, not silently mixed (Note [collective
order]), and trained on at stages 1-2, whose reductions pair whatever each rank ran (Note [positional buckets]:
until they did, stage 2 refused these steps, or gloo aborted the process where the buckets' sizes differed).

Without the check, the model below trained on wrong values with no error: a different expert skipped on each
rank (an MoE expert that got no tokens there) handed one expert's weights to another under stage 3, and two
same-sized blocks run in a different order on each rank swapped their weights. (When the ranks issue different
numbers of collectives, the first unpaired one fails instead, with PeerLostError.) A legal change of order, the
same on every rank, must still train exactly.
"""
from __future__ import annotations

import functools
from typing import Optional

import pytest
import torch
from torch import nn

import zeropp
from support.world import run_world
from zeropp.zero.order_check import CollectiveOrder, CollectiveOrderError

STEPS = 3


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor, skip: Optional[int]) -> torch.Tensor:
        return sum(e(x) for i, e in enumerate(self.experts) if i != skip)


class Net(nn.Module):
    """``skip``: an expert left out; ``swap``: the two middle blocks run in the other order."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.moe = Experts()

    def forward(self, x: torch.Tensor, skip: Optional[int] = None, swap: bool = False) -> torch.Tensor:
        h = self.inp(x)
        h = self.a(self.b(h)) if swap else self.b(self.a(h))
        return self.head(self.moe(h, skip)).pow(2).mean()


def path(rank: int, step: int, case: str) -> dict:
    if case == "skip_differs":  # each rank has an expert that got no tokens, a different one
        return {"skip": rank}
    if case == "swap_on_one_rank":
        return {"swap": rank == 1 and step > 0}
    return {"swap": step % 2 == 1}  # "swap_everywhere": legal, the same on every rank


def train(rank: int, world: int, stage: int, case: str) -> dict:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zeropp.initialize(model=Net(), config=cfg)
    losses, error = [], None
    for step in range(STEPS):
        before = engine.consolidated_state_dict()
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(x, **path(rank, step, case))
        engine.backward(loss)
        try:
            engine.step()
        except CollectiveOrderError as e:
            error = (step, str(e))
            break
        losses.append(float(loss.detach()))
    after = engine.consolidated_state_dict() if error is not None else None
    changed = None if after is None else [k for k in before if not torch.equal(before[k], after[k])]
    return {"losses": losses, "error": error, "changed": changed}


def reference(world: int, case: str) -> list[list[float]]:
    """One process: each rank's loss per step, SGD on the mean of the ranks' gradients."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: list[list[float]] = [[] for _ in range(world)]
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = model(x, **path(rank, step, case))
            (loss / world).backward()
            out[rank].append(float(loss.detach()))
        opt.step()
    return out


@pytest.mark.parametrize("stage,case,step", [(3, "skip_differs", 0), (3, "swap_on_one_rank", 1)])
def test_ranks_that_ran_different_modules_are_refused(stage: int, case: str, step: int) -> None:
    out = run_world(functools.partial(train, stage=stage, case=case), 2)
    for rank, res in enumerate(out):
        assert res["error"] is not None, (rank, res["losses"])  # every rank sees it, in the same step
        assert res["error"][0] == step and "same modules" in res["error"][1]
        assert res["changed"] == [], res["changed"]  # refused before the optimizer read a gradient of that step


@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_that_swaps_two_blocks_trains_at_stages_1_and_2(stage: int) -> None:
    """Gradients reduce by place: what order a rank ran its modules in does not matter."""
    out = run_world(functools.partial(train, stage=stage, case="swap_on_one_rank"), 2)
    ref = reference(2, "swap_on_one_rank")
    for rank, res in enumerate(out):
        assert res["error"] is None and res["losses"] == pytest.approx(ref[rank], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_same_change_of_order_on_every_rank_trains_exactly(stage: int) -> None:
    out = run_world(functools.partial(train, stage=stage, case="swap_everywhere"), 2)
    ref = reference(2, "swap_everywhere")
    for rank, res in enumerate(out):
        assert res["error"] is None
        assert res["losses"] == pytest.approx(ref[rank], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_train_ranks_that_skip_different_experts(stage: int) -> None:
    """The reductions have a place for every gradient on every rank, zeros for a skipped expert (until the stage 2
    reductions were positional, this step was refused)."""
    out = run_world(functools.partial(train, stage=stage, case="skip_differs"), 2)
    ref = reference(2, "skip_differs")
    for rank, res in enumerate(out):
        assert res["error"] is None and res["losses"] == pytest.approx(ref[rank], rel=1e-5, abs=1e-7)


def test_digests_agree_only_when_every_rank_noted_the_same() -> None:
    def payload(notes: list[tuple[int, int, int]]) -> list[float]:
        order = CollectiveOrder()
        for note in notes:
            order.note(*note)
        return order.payload()

    same = [(1, 0, 0), (1, 1, 0), (2, 1, 0), (2, 1, 1)]
    interleaved = [(1, 0, 0), (2, 1, 0), (1, 1, 0), (2, 1, 1)]  # only the order within a kind matters
    swapped = [(1, 1, 0), (1, 0, 0), (2, 1, 0), (2, 1, 1)]
    world = 1 << 20  # sums stay exact in float64 at a million ranks
    assert payload(same) == payload(interleaved)

    def summed(payloads: list[list[float]]) -> list[float]:
        return [float(sum(p[i] for p in payloads)) for i in range(12)]

    assert CollectiveOrder().check(summed([payload(same)] * 3), 3)
    with pytest.raises(CollectiveOrderError, match="same modules"):
        CollectiveOrder().check(summed([payload(same), payload(same), payload(swapped)]), 3)
    CollectiveOrder().check([v * world for v in payload(same)], world)
    with pytest.raises(CollectiveOrderError):
        CollectiveOrder().check([a * (world - 1) + b for a, b in zip(payload(same), payload(swapped))], world)
    # arrival orders that differ at stages 0-2 only say so (the layout stays); extra gradients that differ: refused
    arrivals = [(5, 1, 0), (5, 2, 0)]  # ARRIVE: stages 0-2
    assert not CollectiveOrder().check(summed([payload(same + arrivals), payload(same + arrivals[::-1])]), 2)
    with pytest.raises(CollectiveOrderError, match="number of times"):
        CollectiveOrder().check(summed([payload(same + [(4, 1, 0)]), payload(same)]), 2)
