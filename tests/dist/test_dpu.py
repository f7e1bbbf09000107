"""Delayed parameter update (ZeRO-Offload's DPU): after the warm-up, step t's update runs in the background
and becomes visible only after step t+1's forward/backward. The engine must follow exactly the trajectory
of a single process that applies the same delay."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import zeropp
from support.models import TiedNet, tied_batch
from support.train import ADAMW, config, param_rel_error, train_reference, train_steps
from support.world import run_world

STEPS, WARMUP, GB = 8, 3, 8


def dpu_config(stage: int, delayed: bool = True) -> dict:
    cfg = config(GB)
    cfg["zero_optimization"]["stage"] = stage
    cfg["zero_optimization"]["offload_optimizer"] = {"delayed_update": delayed,
                                                     "delayed_update_warmup_steps": WARMUP}
    return cfg


def run(rank: int, world: int) -> dict:
    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        engine, *_ = zeropp.initialize(model=TiedNet(), config=dpu_config(stage))
        losses = train_steps(engine, rank, world, STEPS, GB)
        out[stage] = {"losses": losses, "state": engine.consolidated_state_dict()}  # joins the last update
    return out


def delayed_reference() -> dict:
    """One process: gradients at the forward weights; after WARMUP steps, the weights used next are the
    master from before this step's update."""
    torch.manual_seed(0)
    model = TiedNet()
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), **ADAMW["params"])
    losses = []
    for step in range(STEPS):
        idx, tgt = tied_batch(step, GB)
        loss = model(idx, tgt)
        loss.backward()
        for pm, p in zip(master.parameters(), model.parameters()):
            pm.grad, p.grad = p.grad, None
        if step >= WARMUP:
            model.load_state_dict(master.state_dict())  # the previous update becomes visible now
            opt.step()
        else:
            opt.step()
            model.load_state_dict(master.state_dict())
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in master.state_dict().items()}}


@functools.lru_cache(maxsize=None)
def results() -> list:
    return run_world(run, 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_dpu_follows_the_delayed_trajectory(stage):
    ref = delayed_reference()
    for rank_result in results():
        got = rank_result[stage]
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) / b <= 1e-5, f"step {step}: {a} vs {b}"
        assert param_rel_error(got["state"], ref["state"]) <= 1e-4


def test_the_delay_is_real():
    """The delayed trajectory differs from the immediate one once the delay starts (else the test above
    could not tell them apart)."""
    ref = delayed_reference()
    immediate = train_reference(STEPS, GB)["losses"]
    assert immediate[:WARMUP + 1] == pytest.approx(ref["losses"][:WARMUP + 1], rel=1e-6)
    assert abs(immediate[-1] - ref["losses"][-1]) / immediate[-1] > 1e-3
