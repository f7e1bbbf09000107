"""DeepSpeed 0.19.8 continues, at another world size and ZeRO stage, from universal checkpoints zeropp's converter wrote.

Two halves, each in its own environment:

1. ``make OUT`` (zeropp's ``.venv``): on 2 gloo ranks zeropp trains tests/support/ds_reference.py's model 3 steps
   (DeepSpeed's reference config; ZeRO-2 fp32 and ZeRO-3 bf16), saves, and goes on 5 steps uninterrupted (each rank's
   loss and lr recorded, with the fp32 weights and Adam moments at the save); then zeropp's converter
   (``zeropp.deepspeed.checkpoint.universal_io.to_universal``, what ``zeropp to-universal`` runs) writes each saved
   checkpoint in DeepSpeed's universal layout, ``OUT/<run>/global_step3_universal``. It also converts the ZeRO
   checkpoints DeepSpeed itself saved (tests/data/deepspeed/<case>) with zeropp's converter: DeepSpeed -> zeropp's
   converter -> DeepSpeed.
2. ``continue OUT`` (an environment with DeepSpeed 0.19.8, ``DS_ACCELERATOR=cpu``): for each checkpoint and each
   target (ZeRO stage, world size) a fresh DeepSpeed engine (model seed 1234, ``"checkpoint": {"load_universal":
   true}``) runs ``load_checkpoint(OUT/<run>)``; its ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``
   are compared with the saved state (bit for bit), then it trains 5 steps, every rank taking its share of the 4
   samples a step the 2 saving ranks took; the mean loss and the lr of each step are compared with the uninterrupted
   run (zeropp's, or DeepSpeed's own for its checkpoints: tests/data/deepspeed*/<case>/reference). Results go to
   ``--out``.

    .venv/bin/python bench/deepspeed_universal.py make /tmp/ds_universal
    DS_ACCELERATOR=cpu /tmp/dsvenv3/bin/python bench/deepspeed_universal.py continue /tmp/ds_universal
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import socket
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
DATA = os.path.join(HERE, "..", "tests", "data")
SAVED_WORLD, FIRST, STEPS = 2, 3, 5
RUNS = {"zeropp_s2_fp32": (2, False), "zeropp_s3_bf16": (3, True)}  # zeropp's runs: (stage, bf16)
DS_CASES = ("stage2_fp32", "stage3_bf16")  # DeepSpeed's runs, converted by zeropp
TARGETS = ((1, 4), (2, 1), (3, 4))  # DeepSpeed's (stage, world) for each zeropp run
DS_CASE_TARGETS = ((3, 4), (1, 1))  # ... for each DeepSpeed run: another stage than it saved with


def config(stage: int, bf16: bool, world: int, universal: bool = False) -> dict:
    with open(os.path.join(DATA, "deepspeed", "stage2_fp32", "reference", "continued_losses.json")) as f:
        cfg = copy.deepcopy(json.load(f)["config"])
    cfg["train_micro_batch_size_per_gpu"] = 4 // world
    cfg["bf16"] = {"enabled": bf16}
    cfg["zero_optimization"] = {"stage": stage}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def batch(step: int, rank: int, world: int):
    """Rank ``rank`` of ``world`` (1, 2 or 4)'s share of the 4 samples the 2 saving ranks took at ``step``."""
    import torch
    from ds_reference import ds_batch
    if world == 1:
        (x0, y0), (x1, y1) = ds_batch(step, 0), ds_batch(step, 1)
        return torch.cat([x0, x1]), torch.cat([y0, y1])
    per = world // SAVED_WORLD
    x, y = ds_batch(step, rank // per)
    m, i = 2 // per, rank % per
    return x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]


# ---- half 1: zeropp --------------------------------------------------------------------------------------------
def _zeropp_rank(rank: int, world: int, out: str) -> None:
    import torch
    import zeropp
    from ds_reference import ds_loss, make_model
    from safetensors.torch import save_file
    for run, (stage, bf16) in RUNS.items():
        dtype = torch.bfloat16 if bf16 else torch.float32
        engine, *_ = zeropp.initialize(model=make_model(0), config=config(stage, bf16, world))
        for step in range(FIRST):
            engine.backward(ds_loss(engine, *batch(step, rank, world), dtype=dtype))
            engine.step()
        engine.save_checkpoint(os.path.join(out, "zeropp", run), client_state={"epoch": 1, "note": "hello"})
        weights = engine.consolidated_state_dict()
        moments = {}
        for u in engine.units:
            for slot, view in zip(u.slots, u.master_views()):
                for key in ("exp_avg", "exp_avg_sq"):
                    rows = [torch.empty_like(engine.optimizer.state[view][key]) for _ in range(world)]
                    torch.distributed.all_gather(rows, engine.optimizer.state[view][key])
                    moments[f"{slot.name}.{key}"] = torch.cat(rows)[: slot.spec.numel].view(slot.spec.shape)
        steps = []
        for step in range(FIRST, FIRST + STEPS):
            lr = engine.get_lr()[0]
            loss = ds_loss(engine, *batch(step, rank, world), dtype=dtype)
            engine.backward(loss)
            engine.step()
            steps.append({"step": step, "loss": loss.item(), "lr": lr})
        os.makedirs(os.path.join(out, "reference", run), exist_ok=True)
        with open(os.path.join(out, "reference", run, f"continued_{rank}.json"), "w") as f:
            json.dump(steps, f)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in weights.items()},
                      os.path.join(out, "reference", run, "fp32_weights.safetensors"))
            save_file({k: v.contiguous() for k, v in moments.items()},
                      os.path.join(out, "reference", run, "optimizer_state.safetensors"))
        engine.close()


def make(out: str) -> None:
    from support.world import run_world
    from zeropp.deepspeed.checkpoint.universal_io import to_universal
    shutil.rmtree(out, ignore_errors=True)
    run_world(_zeropp_rank, SAVED_WORLD, out)
    for run in RUNS:
        print(to_universal(os.path.join(out, "zeropp", run), os.path.join(out, run, "global_step3_universal")))
    for case in DS_CASES:
        print(to_universal(os.path.join(DATA, "deepspeed", case), os.path.join(out, case, "global_step3_universal")))


# ---- half 2: DeepSpeed -----------------------------------------------------------------------------------------
def _reference(out: str, run: str) -> dict:
    """The saved state and the uninterrupted run's per-rank steps (zeropp's, or DeepSpeed's own for its cases)."""
    from safetensors.torch import load_file
    if run in RUNS:
        ref = os.path.join(out, "reference", run)
        ranks = []
        for r in range(SAVED_WORLD):
            with open(os.path.join(ref, f"continued_{r}.json")) as f:
                ranks.append(json.load(f))
    else:
        ref = os.path.join(DATA, "deepspeed", run, "reference")
        with open(os.path.join(ref, "continued_losses.json")) as f:
            ranks = list(json.load(f)["continued"].values())
    return {"weights": load_file(os.path.join(ref, "fp32_weights.safetensors")),
            "moments": load_file(os.path.join(ref, "optimizer_state.safetensors")), "ranks": ranks}


def _deepspeed_rank(rank: int, run: str, stage: int, world: int, out: str, port: int, ext_dir: str,
                    results: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                      TORCH_EXTENSIONS_DIR=ext_dir)
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from ds_reference import ds_loss, make_model
    deepspeed.init_distributed(dist_backend="gloo")
    bf16 = "bf16" in run
    model = make_model(1234)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, bf16, world, universal=True))
    path, client = engine.load_checkpoint(os.path.join(out, run))
    ref = _reference(out, run)
    exact = {"weights": True, "moments": True}
    for name, p in engine.module.named_parameters():
        exact["weights"] &= torch.equal(safe_get_full_fp32_param(p).float(), ref["weights"][name])
        for key in ("exp_avg", "exp_avg_sq"):
            exact["moments"] &= torch.equal(safe_get_full_optimizer_state(p, key), ref["moments"][f"{name}.{key}"])
    after = {"global_steps": engine.global_steps, "lr": engine.get_lr()[0], "epoch": client.get("epoch")}
    steps = []
    for step in range(FIRST, FIRST + STEPS):
        lr = engine.get_lr()[0]
        loss = ds_loss(engine, *batch(step, rank, world))
        engine.backward(loss)
        engine.step()
        steps.append({"step": step, "loss": loss.item(), "lr": lr})
    with open(os.path.join(results, f"{rank}.json"), "w") as f:
        json.dump({"loaded": path is not None, "exact": exact, "after_load": after, "steps": steps}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one(run: str, stage: int, world: int, out: str, ext_dir: str) -> dict:
    import torch.multiprocessing as mp
    tmp = tempfile.mkdtemp(prefix="ds_uc_cont_")
    try:
        mp.spawn(_deepspeed_rank, args=(run, stage, world, out, _free_port(), ext_dir, tmp), nprocs=world, join=True)
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"{r}.json")) as f:
                ranks.append(json.load(f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ref = _reference(out, run)["ranks"]
    theirs = [sum(r["steps"][i]["loss"] for r in ranks) / world for i in range(STEPS)]
    want = [sum(r[i]["loss"] for r in ref) / SAVED_WORLD for i in range(STEPS)]
    return {"stage": stage, "world_size": world, "loaded": all(r["loaded"] for r in ranks),
            "weights_bit_equal": all(r["exact"]["weights"] for r in ranks),
            "moments_bit_equal": all(r["exact"]["moments"] for r in ranks),
            "after_load": ranks[0]["after_load"], "mean_losses": theirs, "uninterrupted_mean_losses": want,
            "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(theirs, want)),
            "lr_equal": all(r["steps"][i]["lr"] == ref[0][i]["lr"] for r in ranks for i in range(STEPS))}


def cont(out: str, results_path: str) -> None:
    import deepspeed
    assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
    ext_dir = tempfile.mkdtemp(prefix="ds_ext_")
    report: dict = {"deepspeed_version": deepspeed.__version__, "saved_world_size": SAVED_WORLD, "runs": {}}
    try:
        jobs = [(run, t) for run in RUNS for t in TARGETS] + [(case, t) for case in DS_CASES for t in DS_CASE_TARGETS]
        for run, (stage, world) in jobs:
            got = _one(run, stage, world, out, ext_dir)
            report["runs"].setdefault(run, []).append(got)
            print(f"{run} -> DeepSpeed ZeRO-{stage} on {world} rank(s): weights bit-equal {got['weights_bit_equal']}, "
                  f"moments bit-equal {got['moments_bit_equal']}, loss rel. diff {got['max_loss_rel_diff']:.2e}, "
                  f"lr equal {got['lr_equal']}", flush=True)
    finally:
        shutil.rmtree(ext_dir, ignore_errors=True)
    with open(results_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {results_path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("half", choices=("make", "continue"))
    ap.add_argument("dir", help="where the universal checkpoints are written / read")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "deepspeed_universal.json"))
    args = ap.parse_args()
    if args.half == "make":
        make(args.dir)
    else:
        cont(args.dir, args.out)


if __name__ == "__main__":
    main()
