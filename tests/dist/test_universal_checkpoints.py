"""Universal checkpoints across world sizes and stages, on gloo, without DeepSpeed.

* DeepSpeed 0.19.8 saved a run on 2 ranks and its own ``ds_to_universal`` converted it (tests/data/deepspeed_universal);
  zeropp loads that on 4 ranks into another ZeRO stage (``"checkpoint": {"load_universal": true}``,
  ``engine.load_checkpoint(dir)``): the fp32 weights are DeepSpeed's ``zero_to_fp32`` output and the Adam moments and
  steps DeepSpeed's own, bit for bit; the next 5 steps' losses equal DeepSpeed's continuation of the same universal
  checkpoint on 4 ranks, and its uninterrupted run.
* zeropp saves a run on 2 ranks, converts it (``to_universal``: DeepSpeed's layout and zeropp's), and loads it on 4
  ranks into another stage (stage 0 too): the weights and moments are the saved ones bit for bit, and the next 5 steps'
  losses are those of the run that went on uninterrupted on 2 ranks; also for a model with a weight under two names
  and a frozen layer.
* a damaged universal checkpoint raises a named error on every rank and leaves the engine as it was.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import os
import shutil
import tempfile

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zeropp
from support.ds_reference import ds_batch, ds_loss, make_model
from support.world import run_world
from zeropp.checkpoint import CheckpointError
from zeropp.deepspeed import checkpoint_format as fmt
from zeropp.deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
from zeropp.deepspeed.checkpoint.universal_io import to_universal

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
FIRST, CONTINUED = 3, 5
# DeepSpeed-made universal checkpoint -> the zeropp stage it loads into on 4 ranks (another than DeepSpeed saved)
DS_LOADS = {"stage2_fp32": 3, "stage3_bf16": 1}
# zeropp's own runs on 2 ranks: (model, (stage, bf16) saved) -> (stage, layout) loaded on 4 ranks
OWN_RUNS = {"own_s2_fp32": (("ds", (2, False)), (3, "deepspeed")), "own_s3_bf16": (("ds", (3, True)), (0, "zeropp")),
            "tied_frozen_s3": (("tied", (3, False)), (1, "deepspeed")),
            "tied_frozen_s1": (("tied", (1, False)), (2, "zeropp"))}


class TiedFrozen(nn.Module):
    """A weight under two names (``a.weight`` is ``b.weight``) and a frozen layer between them."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(8, 8, bias=False)
        self.mid = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight
        self.head = nn.Linear(8, 5)
        self.mid.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.tanh(self.mid(torch.tanh(self.a(x))))))


def model(kind: str, seed: int) -> nn.Module:
    return make_model(seed) if kind == "ds" else TiedFrozen(seed)


def ds_config(stage: int, bf16: bool, world: int, universal: bool = False) -> dict:
    with open(os.path.join(DATA, "deepspeed", "stage2_fp32", "reference", "continued_losses.json")) as f:
        cfg = copy.deepcopy(json.load(f)["config"])  # the config DeepSpeed trained with
    cfg["train_micro_batch_size_per_gpu"] = 4 // world  # 4 samples a step on any world
    cfg["bf16"] = {"enabled": bf16}
    cfg["zero_optimization"] = {"stage": stage}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share (world 2 or 4) of the 4 samples the 2 ranks of DeepSpeed's run took at ``step``."""
    per = world // 2
    x, y = ds_batch(step, rank // per)
    m, i = 2 // per, rank % per
    return x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]


def full_state(engine) -> dict:
    """The whole fp32 weights and Adam moments (every rank's chunks gathered) and steps."""
    world = torch.distributed.get_world_size()
    weights = engine.consolidated_state_dict()
    moments = {}
    for u in engine.units:
        for slot, view in zip(u.slots, u.master_views()):
            st = engine.optimizer.state.get(view, {})
            entry = {"step": float(st["step"])} if "step" in st else {}
            for key in ("exp_avg", "exp_avg_sq") if st else ():  # a frozen parameter has none
                rows = [torch.empty_like(st[key]) for _ in range(world)]
                torch.distributed.all_gather(rows, st[key].contiguous())
                entry[key] = torch.cat(rows)[: slot.spec.numel].view(slot.spec.shape)  # stage 0: rank 0's whole
            moments[slot.name] = entry
    return {"weights": weights, "moments": moments}


def train(engine, rank: int, world: int, dtype: torch.dtype) -> list[float]:
    losses = []
    for step in range(FIRST, FIRST + CONTINUED):
        loss = ds_loss(engine, *batch(step, rank, world), dtype=dtype)
        engine.backward(loss)
        engine.step()
        value = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(value)
        losses.append(value.item() / world)
    return losses


# ---- world 2: zeropp's own runs -----------------------------------------------------------------------------------
def save_own_runs(rank: int, world: int, root: str) -> dict:
    out = {}
    for run, ((kind, (stage, bf16)), _) in OWN_RUNS.items():
        dtype = torch.bfloat16 if bf16 else torch.float32
        engine, *_ = zeropp.initialize(model=model(kind, 0), config=ds_config(stage, bf16, world))
        for step in range(FIRST):
            engine.backward(ds_loss(engine, *batch(step, rank, world), dtype=dtype))
            engine.step()
        engine.save_checkpoint(os.path.join(root, run), client_state={"epoch": 1, "note": "hello"})
        saved = full_state(engine)
        out[run] = {**saved, "losses": train(engine, rank, world, dtype)}  # the uninterrupted run
        engine.close()
    return out


# ---- world 4: every load ------------------------------------------------------------------------------------------
def load(rank: int, world: int, ckpt: str, stage: int, bf16: bool, kind: str = "ds") -> dict:
    engine, *_ = zeropp.initialize(model=model(kind, 1234), config=ds_config(stage, bf16, world, universal=True))
    path, client = engine.load_checkpoint(ckpt)
    got = {"path": path, "client": client, "lr": engine.get_lr(), "global_steps": engine.global_steps,
           **full_state(engine)}
    got["losses"] = train(engine, rank, world, torch.bfloat16 if bf16 else torch.float32)
    engine.close()
    return got


def damaged(rank: int, world: int, root: str) -> dict:
    bad = os.path.join(root, "damaged")
    if rank == 0:
        shutil.copytree(os.path.join(DATA, "deepspeed_universal", "stage2_fp32"), bad,
                        ignore=shutil.ignore_patterns("reference"))
        path = os.path.join(bad, "global_step3_universal", "zero", "fc2.bias", "exp_avg.pt")
        with open(path, "r+b") as f:
            f.truncate(100)
    torch.distributed.barrier()
    engine, *_ = zeropp.initialize(model=make_model(1234), config=ds_config(2, False, world, universal=True))
    before = engine.consolidated_state_dict()
    try:
        engine.load_checkpoint(bad)
        error = None
    except CheckpointError as err:
        error = str(err)
    after = engine.consolidated_state_dict()
    steps = engine.global_steps
    engine.close()
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before), "global_steps": steps}


def load_everything(rank: int, world: int, root: str) -> dict:
    out = {}
    for case, stage in DS_LOADS.items():
        out[case] = load(rank, world, os.path.join(DATA, "deepspeed_universal", case), stage, "bf16" in case)
    for run, ((kind, (_, bf16)), (stage, _)) in OWN_RUNS.items():
        out[run] = load(rank, world, os.path.join(root, f"{run}_universal"), stage, bf16, kind)
    out["damaged"] = damaged(rank, world, root)
    return out


@functools.lru_cache(maxsize=None)
def results() -> tuple[list, list, str]:
    root = tempfile.mkdtemp(prefix="zeropp-universal-")
    saved = run_world(save_own_runs, 2, root)
    for run, (_, (_, layout)) in OWN_RUNS.items():  # no process group: the test process converts
        to_universal(os.path.join(root, run), os.path.join(root, f"{run}_universal", "global_step3_universal"),
                     layout=layout)
    return saved, run_world(load_everything, 4, root), root


def reference(case: str) -> dict:
    ref = os.path.join(DATA, "deepspeed", case, "reference")
    with open(os.path.join(ref, "continued_losses.json")) as f:
        uninterrupted = json.load(f)["continued"]
    with open(os.path.join(DATA, "deepspeed_universal", case, "reference", "continued_losses.json")) as f:
        universal = json.load(f)["ranks"]
    return {"weights": load_file(os.path.join(ref, "fp32_weights.safetensors")),
            "moments": load_file(os.path.join(ref, "optimizer_state.safetensors")),
            "uninterrupted": [sum(r[i]["loss"] for r in uninterrupted.values()) / 2 for i in range(CONTINUED)],
            "universal": [sum(r["continued"][i]["loss"] for r in universal.values()) / 4 for i in range(CONTINUED)],
            "lrs": [s["lr"] for s in universal["0"]["continued"]]}


@pytest.mark.parametrize("case", list(DS_LOADS))
def test_deepspeeds_universal_checkpoint_loads_on_4_ranks_into_another_stage(case):
    _, loaded, _ = results()
    ref = reference(case)
    for got in (r[case] for r in loaded):
        assert got["path"].endswith("global_step3_universal") and got["global_steps"] == 3
        assert got["client"]["epoch"] == 1 and got["client"]["note"] == "hello" and got["lr"] == [0.007]
        for name, want in ref["weights"].items():  # zero_to_fp32's weights (and the buffer), bit for bit
            assert torch.equal(got["weights"][name].float(), want), name
        for name in (n for n in ref["weights"] if n != "out_shift"):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got["moments"][name][key], ref["moments"][f"{name}.{key}"]), (name, key)
            assert got["moments"][name]["step"] == 3.0
    ours = loaded[0][case]["losses"]
    tolerance = 2e-3 if "bf16" in case else 1e-6
    for theirs in (ref["universal"], ref["uninterrupted"]):  # DeepSpeed's universal reload on 4, its own run on 2
        assert all(math.isclose(a, b, rel_tol=tolerance) for a, b in zip(ours, theirs)), (ours, theirs)


@pytest.mark.parametrize("run", list(OWN_RUNS))
def test_a_zeropp_run_converted_loads_on_4_ranks_and_continues_as_uninterrupted(run):
    saved, loaded, root = results()
    want = saved[0][run]
    for got in (r[run] for r in loaded):
        # DeepSpeed's layout carries universal_checkpoint_info in the model states, and DeepSpeed's loads return it
        client = {k: v for k, v in got["client"].items() if k != UNIVERSAL_CHECKPOINT_INFO}
        assert got["global_steps"] == 3 and client == {"epoch": 1, "note": "hello"}
        for name, t in want["weights"].items():
            assert torch.equal(got["weights"][name], t), name
        for name, st in want["moments"].items():
            assert got["moments"][name].keys() == st.keys() and st.get("step", 3.0) == 3.0, name
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert key not in st or torch.equal(torch.as_tensor(got["moments"][name][key]),
                                                    torch.as_tensor(st[key])), (name, key)
    if run.startswith("tied"):  # both names of the tied weight, and the frozen layer (another seed in the model)
        assert {"a.weight", "b.weight", "mid.weight", "mid.bias"} <= set(want["weights"])
        assert not want["moments"]["mid.weight"] and not loaded[0][run]["moments"]["mid.weight"]
    if OWN_RUNS[run][1][1] == "deepspeed":
        folder = os.path.join(root, f"{run}_universal", "global_step3_universal")
        states = fmt.load_file(os.path.join(folder, "mp_rank_00_model_states.pt"))
        assert [list(g) for g in states["param_shapes"]] == [[n for n in want["moments"] if want["moments"][n]]]
        if run.startswith("tied"):
            assert states["shared_params"] == {"b.weight": "a.weight"}
            assert list(states["frozen_param_shapes"]) == ["mid.weight", "mid.bias"]
    tolerance = 2e-3 if "bf16" in run else 1e-6
    ours, uninterrupted = loaded[0][run]["losses"], want["losses"]
    assert all(math.isclose(a, b, rel_tol=tolerance) for a, b in zip(ours, uninterrupted)), (ours, uninterrupted)


def test_a_damaged_universal_checkpoint_is_named_on_every_rank_and_changes_nothing():
    _, loaded, _ = results()
    for got in (r["damaged"] for r in loaded):
        assert got["error"] is not None and "fc2.bias/exp_avg.pt" in got["error"], got["error"]
        assert got["unchanged"] and got["global_steps"] == 0
