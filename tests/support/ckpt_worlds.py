"""Worker functions for tests/dist/test_checkpoint.py: each runs on every rank of one world of processes.

The worlds, in the order the tests need them:
- ``first_run`` (4 ranks, 2 nodes x 2): N steps, save, M more steps, for each variant: the uninterrupted run.
- ``resume`` (4 new processes): load each variant's checkpoint, M steps; plus the errors an engine raises.
- ``elastic`` (2 and 3 ranks): load the 4-rank checkpoint, report params/moments, take one step.
- ``crash_run`` (2 ranks): save a good tag, then SIGKILL one rank in the middle of writing the next one.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

import zeropp
from support.models import TiedNet, rank_slice, tied_batch
from support.train import config, error_of
from zeropp.checkpoint.format import CRASH_ENV

N, M = 3, 3  # steps before the save, steps after it
GB = 12  # global batch per step, divisible by 2, 3 and 4
SCHED = {"type": "WarmupLR",
         "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10, "warmup_type": "linear"}}
TWO_NODES = {"topology": {"ranks_per_node": 2}}
VARIANTS = {
    "zero3": {**config(GB), "scheduler": SCHED, **TWO_NODES},
    "zeropp": {**config(GB, zero_quantized_weights=True, zero_hpz_partition_size=2, zero_quantized_gradients=True,
                        stage3_gather_16bit_weights_on_model_save=True),
               "bf16": {"enabled": True}, "scheduler": SCHED, **TWO_NODES},
    # saved between accumulation boundaries: the partly accumulated gradient shards travel too
    "gas2": {**config(16), "gradient_accumulation_steps": 2, "scheduler": SCHED, **TWO_NODES},
    "stage1": {**config(GB), "scheduler": SCHED, **TWO_NODES},
    "stage2": {**config(GB), "bf16": {"enabled": True}, "scheduler": SCHED, **TWO_NODES},
    # every rank holds the whole state and writes it (Note [stage 0 checkpoints])
    "stage0": {**config(GB, stage=0), "scheduler": SCHED, **TWO_NODES},
    # a high initial scale overflows and is halved before the save: the resume must continue from it
    "fp16": {**config(GB), "scheduler": SCHED, **TWO_NODES,
             "fp16": {"enabled": True, "initial_scale_power": 22, "hysteresis": 1}},
}
VARIANTS["stage1"]["zero_optimization"] = {**VARIANTS["stage1"]["zero_optimization"], "stage": 1}
VARIANTS["stage2"]["zero_optimization"] = {**VARIANTS["stage2"]["zero_optimization"], "stage": 2}
MICRO_GLOBAL = {"zero3": GB, "zeropp": GB, "gas2": 8, "stage1": GB, "stage2": GB, "stage0": GB, "fp16": GB}
MICRO_STEPS = {"zero3": (N, M), "zeropp": (N, M), "gas2": (3, 3),  # gas2 saves after 1.5 optimizer steps
               "stage1": (N, M), "stage2": (N, M), "stage0": (N, M), "fp16": (N, M)}


def run_steps(engine: Any, rank: int, world: int, start: int, count: int, micro_global: int,
              rng_noise: bool = True) -> list[float]:
    """``count`` micro-steps from batch ``start``; the loss is scaled by a draw from torch's RNG so that a
    resume that did not restore the RNG state would not match bit for bit."""
    losses = []
    for step in range(start, start + count):
        idx, tgt = tied_batch(step, micro_global)
        loss = engine(rank_slice(idx, rank, world), rank_slice(tgt, rank, world))
        if rng_noise:
            loss = loss * (1 + 0.01 * torch.rand(()))
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item())
    return losses


def _engine(cfg: dict, seed: int, **model_kwargs: int) -> Any:
    torch.manual_seed(seed)
    engine, *_ = zeropp.initialize(model=TiedNet(**model_kwargs), config=copy.deepcopy(cfg))
    return engine


def first_run(rank: int, world: int, root: str) -> dict:
    out: dict[str, Any] = {}
    for name, cfg in VARIANTS.items():
        engine = _engine(cfg, seed=0)
        before, after = MICRO_STEPS[name]
        losses = run_steps(engine, rank, world, 0, before, MICRO_GLOBAL[name])
        path = engine.save_checkpoint(os.path.join(root, name), client_state={"rank": rank, "next": before})
        saved = engine.consolidated_state_dict()
        scale_at_save = engine.loss_scale
        if name == "zeropp":
            engine.save_16bit_model(os.path.join(root, "16bit"))
        losses += run_steps(engine, rank, world, before, after, MICRO_GLOBAL[name])
        out[name] = {"losses": losses, "path": path, "saved_state": saved if rank == 0 else None,
                     "scale": scale_at_save}
    resave = os.path.join(root, "resave")  # the same tag twice: the second replaces the first
    engine.save_checkpoint(resave, tag="t", client_state="first")
    engine.save_checkpoint(resave, tag="t", client_state="second")
    return out


def resume(rank: int, world: int, root: str) -> dict:
    out: dict[str, Any] = {}
    for name, cfg in VARIANTS.items():
        engine = _engine(cfg, seed=123)  # different initial weights: the load must replace all of them
        torch.manual_seed(999)  # and a different RNG state
        path, client_state = engine.load_checkpoint(os.path.join(root, name))
        scale_after_load = engine.loss_scale
        before, after = MICRO_STEPS[name]
        losses = run_steps(engine, rank, world, before, after, MICRO_GLOBAL[name])
        out[name] = {"losses": losses, "path": path, "client_state": client_state, "scale": scale_after_load}
        if name == "zeropp":  # load again into the same, trained engine: its hpZ slices must not be used
            idx, tgt = tied_batch(0, GB)
            with torch.no_grad():  # a forward after the last step leaves current secondary slices behind
                engine(rank_slice(idx, rank, world), rank_slice(tgt, rank, world))
            engine.load_checkpoint(os.path.join(root, name))
            out[name]["reloaded_losses"] = run_steps(engine, rank, world, before, after, MICRO_GLOBAL[name])
    weights_only = _engine(VARIANTS["zero3"], seed=321)
    weights_only.load_checkpoint(os.path.join(root, "zero3"), load_module_only=True)
    state = weights_only.consolidated_state_dict()
    out["module_only"] = {"state": state if rank == 0 else None, "optimizer_state": len(weights_only.optimizer.state),
                          "global_steps": weights_only.global_steps}
    out["errors"] = engine_errors(rank, world, root)
    return out


def engine_errors(rank: int, world: int, root: str) -> dict:
    """Errors raised through the engine on every rank (none may hang the others)."""
    cfg = VARIANTS["zero3"]
    wrong = _engine(cfg, seed=0, hidden=12)
    engine = _engine(cfg, seed=0)
    before = engine.consolidated_state_dict()
    errors = {
        "mismatch": error_of(lambda: wrong.load_checkpoint(os.path.join(root, "zero3"))),
        "missing_tag": error_of(lambda: engine.load_checkpoint(os.path.join(root, "zero3"), tag="nope")),
        "one_rank_corrupt": error_of(lambda: engine.load_checkpoint(os.path.join(root, "corrupt"))),
    }
    after = engine.consolidated_state_dict()
    errors["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    return errors


def gather_full(engine: Any, pick: Any) -> dict[str, torch.Tensor]:
    """Each parameter's full tensor from ``pick(master_view)`` on every rank (all-gather of the chunks)."""
    out = {}
    for unit in engine.units:
        for slot, view in zip(unit.slots, unit.master_views()):
            mine = pick(view).contiguous()
            rows = torch.empty(engine.topo.world_size * mine.numel(), dtype=mine.dtype)
            _all_gather(rows, mine)
            out[slot.name] = rows[: slot.spec.numel].view(slot.spec.shape).clone()
    return out


def elastic(rank: int, world: int, root: str, crash_dir: Optional[str]) -> Optional[dict]:
    cfg = {**config(GB), "scheduler": SCHED, "topology": {"ranks_per_node": 1 if world == 2 else world}}
    engine = _engine(cfg, seed=7)
    path, client_state = engine.load_checkpoint(os.path.join(root, "zero3"), tag=f"global_step{N}")
    loaded = engine.consolidated_state_dict()
    state = engine.optimizer.state
    moments = {key: gather_full(engine, lambda v, key=key: state[v][key]) for key in ("exp_avg", "exp_avg_sq")}
    steps = {float(s["step"]) for s in state.values()}
    lr = engine.optimizer.param_groups[0]["lr"]
    counters = (engine.micro_steps, engine.global_steps, engine.lr_scheduler.last_epoch)
    run_steps(engine, rank, world, N, 1, GB, rng_noise=False)
    stepped = engine.consolidated_state_dict()
    out = {"loaded": loaded, "moments": moments, "steps": steps, "lr": lr, "counters": counters,
           "stepped": stepped, "client_state": client_state, "path": path}
    out["across_stages"] = across_stages(root, world)
    if crash_dir is not None:
        survivor = _engine(CRASH_CFG, seed=5)
        out["crash_path"], _ = survivor.load_checkpoint(crash_dir)
        out["crash_state"] = survivor.consolidated_state_dict()
    return out if rank == 0 else None


def across_stages(root: str, world: int) -> dict:
    """The 4-rank stage-0 checkpoint into stage 3, and the 4-rank stage-3 checkpoint into stage 0, on this
    world: the consolidated weights, and stage 0's whole Adam moments, after the load."""
    topology = {"topology": {"ranks_per_node": 1 if world == 2 else world}}
    sharded = _engine({**config(GB), "scheduler": SCHED, **topology}, seed=8)
    sharded.load_checkpoint(os.path.join(root, "stage0"), tag=f"global_step{N}")
    whole = _engine({**config(GB, stage=0), "scheduler": SCHED, **topology}, seed=9)
    whole.load_checkpoint(os.path.join(root, "zero3"), tag=f"global_step{N}")
    state = whole.optimizer.state
    moments = {slot.name: state[view]["exp_avg"][: slot.spec.numel].clone()
               for u in whole.units for slot, view in zip(u.slots, u.master_views())}
    return {"into_stage3": sharded.consolidated_state_dict(), "into_stage0": whole.consolidated_state_dict(),
            "stage0_moments": moments, "stage0_steps": whole.global_steps}


CRASH_CFG = {**config(4), "scheduler": SCHED}
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


def crash_run(rank: int, world: int, save_dir: str, expected_path: str, point: str) -> None:
    """Save tag ``good``; one more step; then save ``bad`` with ``point`` armed (a SIGKILL inside the save)."""
    engine = _engine(CRASH_CFG, seed=0)
    run_steps(engine, rank, world, 0, 1, 4)
    engine.save_checkpoint(save_dir, tag="good")
    state = engine.consolidated_state_dict()
    if rank == 0:
        torch.save(state, expected_path)
    run_steps(engine, rank, world, 1, 1, 4)
    os.environ[CRASH_ENV] = point
    engine.save_checkpoint(save_dir, tag="bad")
