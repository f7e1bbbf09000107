"""Gather groups (``zeropp_coalesced_prefetch``, on by default; Note [gather groups] in ``zero/budget.py``): on one
node, small units are gathered in groups, one all-gather per group, in the order the last pass ran them. Losses are
those of the same run one unit at a time (an all-gather only moves bytes), the collectives per step fall from one
per unit to one per group, every collective of small units has one length, the buffers stay within their bound, a
unit gathered but not run this time (a block skipped) is drained without harm, and ranks that run a model's small
blocks in different orders are refused by name where one unit at a time ends in gloo's abort."""
from __future__ import annotations

import functools
from typing import Optional

import pytest
import torch
from torch import nn

import zeropp
from support.world import run_world
from zeropp.comm.ledger import Phase
from zeropp.tools.cluster_bench.models import LaunchBound
from zeropp.zero.order_check import CollectiveOrderError

BLOCKS, STEPS = 12, 4


class SkipsABlock(LaunchBound):
    """Skips block 5 on odd steps (a layer drop): a group formed from the last order brings a unit not run."""

    def __init__(self) -> None:
        super().__init__(BLOCKS, 32)
        self.skip = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for i, block in enumerate(self.transformer.h):
            if not (self.skip and i == 5):
                x = block(x)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _gather_tallies(engine: zeropp.ZeroEngine) -> tuple[int, int, int]:
    """Forward gather collectives, backward ones, and the bytes of all of them, in the last step."""
    tallies = engine.ledger.last_step.items()
    forward = sum(t.calls for (phase, _), t in tallies if phase is Phase.FORWARD_GATHER)
    backward = sum(t.calls for (phase, _), t in tallies if phase is Phase.BACKWARD_GATHER)
    nbytes = sum(t.bytes for (phase, _), t in tallies if phase in (Phase.FORWARD_GATHER, Phase.BACKWARD_GATHER))
    return forward, backward, nbytes


def train(rank: int, grouped: bool, skipping: bool) -> dict:
    torch.manual_seed(0)
    model = SkipsABlock() if skipping else LaunchBound(BLOCKS, 32)
    zero = {"stage": 3} if grouped else {"stage": 3, "zeropp_coalesced_prefetch": False}
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zeropp.initialize(model=model, config=cfg)
    losses, forward, backward = [], [], []
    for step in range(STEPS):
        model.skip = skipping and step % 2 == 1
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 256, (2, 17), generator=g)
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        f, b, _ = _gather_tallies(engine)
        forward.append(f)
        backward.append(b)
    buffers = engine.memory_report()["buffers"]
    out = {"losses": losses, "forward_gathers": forward, "backward_gathers": backward, "units": len(engine.units),
           "within": all(b["bytes"] <= b["bound"] for b in buffers.values())}
    engine.close()
    return out


WIDTHS = (2, 3, 4, 5, 6, 7, 8, 9)  # every block's units of another size, all small


class Ladder(nn.Module):
    """Residual blocks of different widths; ``swap`` runs blocks 1 and 5 in each other's place, ``skip`` leaves
    block 3 out; ``frozen``: block 3 trains nothing."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, w), nn.ReLU(), nn.Linear(w, 16)) for w in WIDTHS)
        self.head = nn.Linear(16, 1)
        if frozen:
            self.blocks[3].requires_grad_(False)

    def forward(self, x: torch.Tensor, swap: bool = False, skip: bool = False) -> torch.Tensor:
        order = [i for i in range(len(self.blocks)) if not (skip and i == 3)]
        if swap:
            order[1], order[5] = order[5], order[1]
        h = self.inp(x)
        for i in order:
            h = h + self.blocks[i](h)
        return self.head(h).pow(2).mean()


def skips_frozen(rank: int, step: int) -> bool:
    """Rank 1 leaves the frozen block out on steps 1 and 2 (a layer drop of its own): legal, since the block
    has no gradient to reduce, and the ranks' gathers stay paired (each group is gathered whole)."""
    return rank == 1 and step in (1, 2)


def train_ladder(rank: int, grouped: bool, swap_on: Optional[int], frozen: bool = False) -> dict:
    """Stage 3 on the ladder, groups of at most 600 elements (several groups); rank 1 swaps two blocks of
    different groups at step ``swap_on``; ``frozen``: block 3 is frozen and rank 1 skips it (``skips_frozen``)."""
    torch.manual_seed(0)
    zero = {"stage": 3, "stage3_prefetch_bucket_size": 600, "zeropp_coalesced_prefetch": grouped}
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": zero}
    engine, *_ = zeropp.initialize(model=Ladder(frozen), config=cfg)
    losses, error, changed, gathers = [], None, None, []
    for step in range(STEPS):
        before = engine.consolidated_state_dict()
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(x, swap=rank == 1 and step == swap_on, skip=frozen and skips_frozen(rank, step))
        engine.backward(loss)
        try:
            engine.step()
        except CollectiveOrderError as e:
            error = (step, str(e))
            after = engine.consolidated_state_dict()
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            break
        losses.append(float(loss.detach()))
        gathers.append(_gather_tallies(engine))
    engine.close()
    return {"losses": losses, "error": error, "changed": changed, "gathers": gathers}


def worker(rank: int, world: int) -> dict:
    out: dict = {(grouped, skipping): train(rank, grouped, skipping)
                 for grouped in (True, False) for skipping in (False, True)}
    out["ladder", True] = train_ladder(rank, True, None)
    out["ladder", False] = train_ladder(rank, False, None)
    out["ladder_swapped"] = train_ladder(rank, True, 2)
    out["ladder_skips_frozen"] = train_ladder(rank, True, None, frozen=True)
    return out


def ladder_reference(world: int) -> list[list[float]]:
    """One process: each rank's losses on the frozen ladder with rank 1's skips, SGD on the ranks' mean
    gradient."""
    torch.manual_seed(0)
    model = Ladder(frozen=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out: list[list[float]] = [[] for _ in range(world)]
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = model(x, skip=skips_frozen(rank, step))
            (loss / world).backward()
            out[rank].append(float(loss.detach()))
        opt.step()
    return out


@functools.lru_cache(maxsize=None)
def results() -> list:
    return run_world(worker, 2)


def test_grouped_gathers_give_the_losses_of_gathers_one_at_a_time():
    for res in results():
        for skipping in (False, True):
            assert res[(True, skipping)]["losses"] == res[(False, skipping)]["losses"], skipping
        assert res["ladder", True]["losses"] == res["ladder", False]["losses"]  # several groups, padded


def test_a_step_gathers_its_small_units_in_one_collective_per_group():
    for res in results():
        alone, grouped = res[(False, False)], res[(True, False)]
        assert alone["forward_gathers"][1:] == [alone["units"]] * (STEPS - 1)  # one collective per unit
        assert alone["backward_gathers"][1:] == [alone["units"]] * (STEPS - 1)
        # the first step learns the order; from the second on, the whole model (one group) in one collective
        assert grouped["forward_gathers"][0] == grouped["units"]
        assert grouped["forward_gathers"][1:] == [1] * (STEPS - 1)
        assert grouped["backward_gathers"][1:] == [1] * (STEPS - 1)
        assert grouped["within"] and alone["within"]


def test_every_collective_of_small_units_has_one_length():
    for res in results():
        grouped, alone = res["ladder", True]["gathers"], res["ladder", False]["gathers"]
        forward, backward, nbytes = grouped[-1]
        assert 1 < forward < alone[-1][0] and 1 < backward < alone[-1][1]  # several groups, fewer collectives
        assert nbytes % (forward + backward) == 0  # all of one size: the groups' padded length
        assert nbytes >= alone[-1][2]  # padding costs bytes, never fewer than the units' own


def test_a_grouped_unit_the_model_skips_is_drained():
    for res in results():
        skipped = res[(True, True)]
        assert skipped["within"]
        assert skipped["forward_gathers"][1] == 1


def test_ranks_that_run_small_blocks_in_different_orders_are_refused_by_name():
    # one unit at a time, rank 0 would gather block 1 while rank 1 gathers block 5, of another size, and gloo
    # aborts both processes (SIGABRT in its size check); in groups, padded to one length, the collectives pair
    # up and the order check refuses the step on every rank before the optimizer reads a gradient
    for res in results():
        swapped = res["ladder_swapped"]
        assert swapped["error"] is not None and swapped["error"][0] == 2
        assert "same modules" in swapped["error"][1]
        assert swapped["changed"] == []


def test_a_rank_that_skips_a_frozen_block_trains_on():
    # the groups are formed from gathers the order check found the same on every rank, so a rank that left a
    # unit out still gathers it with its group: the ranks' collectives stay paired in the steps after (formed
    # from each rank's own order, rank 1's groups lacked the block and the next step hung)
    ref = ladder_reference(2)
    for rank, res in enumerate(results()):
        run = res["ladder_skips_frozen"]
        assert run["error"] is None
        assert run["losses"] == pytest.approx(ref[rank], rel=1e-5, abs=1e-7)


def warns_where_nothing_groups(rank: int, world: int) -> dict[str, list[str]]:
    import warnings

    out = {}
    for name, zero in (("asked", {"stage": 3, "zeropp_coalesced_prefetch": True}), ("default", {"stage": 3})):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, *_ = zeropp.initialize(model=LaunchBound(2, 16), config={
                "train_micro_batch_size_per_gpu": 2, "topology": {"ranks_per_node": 2}, "zero_optimization": zero})
        engine.close()
        out[name] = [str(w.message) for w in caught if "zeropp_coalesced_prefetch" in str(w.message)]
    return out


def test_the_switch_says_when_it_has_no_effect():
    # 2 nodes x 2 ranks: the world's gathers take two hops, which are not grouped; the key set to true is not
    # ignored silently, and the default says nothing
    for messages in run_world(warns_where_nothing_groups, 4, ranks_per_node=2):
        assert len(messages["asked"]) == 1 and "no effect" in messages["asked"][0]
        assert "two-hop" in messages["asked"][0]
        assert messages["default"] == []
