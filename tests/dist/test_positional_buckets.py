"""Stage 2 reduces every gradient by its place in a layout all ranks share (Note [positional buckets]), so ranks
that run different modules train on, exactly as one process stepping on the mean of their gradients; and a
module run more times than the layout knows is reduced at the step, or refused by name when the ranks differ
(Note [extra gradients]).

Until then a rank that left out a trainable block of another size filled its buckets with other sizes, and gloo
aborted the other rank (SIGABRT in its size check; measured with blocks of 64x20000 and 64x30000 weights).
"""
from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeropp
from support.world import run_world
from zeropp.zero.order_check import CollectiveOrderError

STEPS = 4


class Net(nn.Module):
    """Blocks of different widths; ``skip``: blocks left out; ``runs``: how often the shared block runs, each run
    under reentrant checkpointing (each run's backward hands its gradients in on its own, as ALBERT's shared
    layer does under transformers' gradient checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, w), nn.Tanh(), nn.Linear(w, 16)) for w in (24, 40, 8))
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = (), runs: int = 1) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i not in skip:
                h = h + block(h)
        for _ in range(runs):
            h = h + checkpoint(self.shared, h, use_reentrant=True)
        return self.head(h).pow(2).mean()


def path(case: str, step: int, rank: int, micro: int) -> dict:
    if case == "skip_other_sizes":  # each rank leaves out blocks of other widths, and both at step 2
        return {"skip": {0: (1,), 1: (0, 2), 2: (1, 0)}.get(step % 3, ()) if rank == 1 else ((2,) if step == 2 else ())}
    if case == "skip_in_one_micro_step":
        return {"skip": (1,) if rank == micro == 1 else ()}
    if case == "shared_runs_everywhere":  # the same on every rank: one run, then three, then two
        return {"runs": (1, 3, 3, 2)[step]}
    if case == "shared_runs_differ":
        return {"runs": 2 + (rank == 1 and step == 2)}
    if case == "shared_runs_in_first_micro_step":  # the extra run is not in the window's last backward
        return {"runs": 2 if micro == 0 else 1}
    if case == "restart_after_extras":  # step 1's first backward (dropped by restart_accumulation) runs it 3 times
        return {"runs": 1}
    raise ValueError(case)


def batch(step: int, rank: int, micro: int) -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def reference(case: str, gas: int, world: int = 2) -> list[list[float]]:
    """One process: each rank's losses, AdamW on the mean gradient over ranks and micro-steps."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    out: list[list[float]] = [[] for _ in range(world)]
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world):
            for micro in range(gas):
                loss = model(batch(step, rank, micro), **path(case, step, rank, micro))
                (loss / (world * gas)).backward()
                out[rank].append(float(loss.detach()))
        opt.step()
    return out


def train(rank: int, world: int, case: str, gas: int) -> dict:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 1200}}  # several buckets a backward
    engine, *_ = zeropp.initialize(model=Net(), config=cfg)
    losses, error, layouts = [], None, []
    for step in range(STEPS):
        before = engine.consolidated_state_dict()
        if case == "restart_after_extras" and step == 1:  # extra gradients, then the window is dropped
            engine.backward(engine(batch(99, rank, 0), runs=3))
            engine.restart_accumulation()
        for micro in range(gas):
            loss = engine(batch(step, rank, micro), **path(case, step, rank, micro))
            engine.backward(loss)
            losses.append(float(loss.detach()))
            try:
                engine.step()
            except CollectiveOrderError as e:
                error = (step, str(e))
        if error is not None:
            after = engine.consolidated_state_dict()
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            return {"losses": losses, "error": error, "changed": changed}
        layouts.append(len(engine.grads.layout.keys))
    engine.close()
    return {"losses": losses, "error": None, "layouts": layouts}


CASES = [("skip_other_sizes", 1), ("skip_in_one_micro_step", 2), ("shared_runs_everywhere", 1),
         ("shared_runs_differ", 1), ("shared_runs_in_first_micro_step", 2), ("restart_after_extras", 1)]


def run_all(rank: int, world: int) -> dict:
    return {c: train(rank, world, c, gas) for c, gas in CASES}


@pytest.fixture(scope="module")
def results() -> dict:
    out = run_world(run_all, 2, timeout=240)
    return {c: ([r[c] for r in out], gas) for c, gas in CASES}


@pytest.mark.parametrize("case", ["skip_other_sizes", "skip_in_one_micro_step", "shared_runs_everywhere",
                                  "shared_runs_in_first_micro_step", "restart_after_extras"])
def test_ranks_that_run_different_modules_train_as_one_process(results: dict, case: str) -> None:
    ranks, gas = results[case]
    ref = reference(case, gas)
    for rank, res in enumerate(ranks):
        assert res["error"] is None, res["error"]
        assert res["losses"] == pytest.approx(ref[rank], rel=1e-5, abs=1e-7), (rank, res["losses"], ref[rank])


def test_the_layout_follows_the_runs_every_rank_made(results: dict) -> None:
    """The first layout has one place per parameter; after a step with three runs of the shared block (a weight
    and a bias: each run is a gradient of each), two more places each, kept while it runs three times, and one
    fewer each once it runs twice."""
    ranks, _ = results["shared_runs_everywhere"]
    for res in ranks:
        one, three, again, two = res["layouts"]
        assert (three, again, two) == (one + 4, one + 4, one + 2)
    # the most runs of any backward in the window, not the last one's: places for 2 runs from the first step
    for res in results["shared_runs_in_first_micro_step"][0]:
        assert len(set(res["layouts"])) == 1 and res["layouts"][0] == one + 2


def test_extra_runs_on_one_rank_are_refused_by_name(results: dict) -> None:
    ranks, _ = results["shared_runs_differ"]
    for res in ranks:
        assert res["error"] is not None and res["error"][0] == 2 and "number of times" in res["error"][1]
        assert res["changed"] == []  # refused before the optimizer read a gradient
