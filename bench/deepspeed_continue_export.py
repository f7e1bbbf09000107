"""DeepSpeed 0.19.8 continues a run from a checkpoint zeropp exported (``zeropp export-deepspeed``).

Two halves, each in its own environment:

1. ``make OUT`` (zeropp's ``.venv``): on 2 gloo ranks zeropp imports each DeepSpeed-made ZeRO-3 checkpoint of
   tests/data/deepspeed (``engine.load_checkpoint``), saves its own checkpoint, and exports that one back to
   DeepSpeed's layout in ``OUT/<case>``: DeepSpeed -> zeropp -> DeepSpeed;
2. ``continue OUT`` (an environment with DeepSpeed 0.19.8 installed, ``DS_ACCELERATOR=cpu``): on 2 gloo ranks a
   fresh DeepSpeed engine (another seed) loads ``OUT/<case>`` and trains 5 steps; each rank's loss and lr per step
   are compared with those of DeepSpeed's own continuation from its own checkpoint (the case's
   ``reference/continued_losses.json``). Results go to ``--out``.

    .venv/bin/python bench/deepspeed_continue_export.py make /tmp/ds_export
    DS_ACCELERATOR=cpu /work/dsenv/bin/python bench/deepspeed_continue_export.py continue /tmp/ds_export
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
DATA = os.path.join(HERE, "..", "tests", "data", "deepspeed")
CASES = ("stage3_fp32", "stage3_bf16")
WORLD, STEPS = 2, 5


def _reference(case: str) -> dict:
    with open(os.path.join(DATA, case, "reference", "continued_losses.json")) as f:
        return json.load(f)


# ---- half 1: zeropp --------------------------------------------------------------------------------------------
def _zeropp_rank(rank: int, world: int, out: str) -> None:
    import zeropp
    from ds_reference import make_model
    for case in CASES:
        engine, *_ = zeropp.initialize(model=make_model(1234), config=_reference(case)["config"])
        _, client = engine.load_checkpoint(os.path.join(DATA, case))
        engine.save_checkpoint(os.path.join(out, "zeropp", case), client_state=client)
        engine.close()


def make(out: str) -> None:
    from support.world import run_world
    from zeropp.deepspeed.checkpoint_io import export_deepspeed
    shutil.rmtree(out, ignore_errors=True)
    run_world(_zeropp_rank, WORLD, out)
    for case in CASES:
        print(export_deepspeed(os.path.join(out, "zeropp", case), os.path.join(out, case), WORLD))


# ---- half 2: DeepSpeed -----------------------------------------------------------------------------------------
def _deepspeed_rank(rank: int, case: str, out: str, port: int, ext_dir: str, results: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                      TORCH_EXTENSIONS_DIR=ext_dir)
    import deepspeed
    from ds_reference import ds_batch, ds_loss, make_model
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(1234)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(_reference(case)["config"]))
    path, client = engine.load_checkpoint(os.path.join(out, case))
    steps = []
    for step in range(3, 3 + STEPS):
        x, y = ds_batch(step, rank)
        lr = engine.get_lr()[0]
        loss = ds_loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        steps.append({"step": step, "loss": loss.item(), "lr": lr})
    with open(os.path.join(results, f"{case}_{rank}.json"), "w") as f:
        json.dump({"loaded": path is not None, "client_state": client, "steps": steps}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cont(out: str, results_path: str) -> None:
    import deepspeed
    import torch.multiprocessing as mp
    assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
    ext_dir, tmp = tempfile.mkdtemp(prefix="ds_ext_"), tempfile.mkdtemp(prefix="ds_cont_")
    report = {}
    try:
        for case in CASES:
            mp.spawn(_deepspeed_rank, args=(case, out, _free_port(), ext_dir, tmp), nprocs=WORLD, join=True)
            ref = _reference(case)["continued"]
            ranks = []
            for r in range(WORLD):
                with open(os.path.join(tmp, f"{case}_{r}.json")) as f:
                    got = json.load(f)
                pairs = list(zip(got["steps"], ref[str(r)]))
                ranks.append({"loaded": got["loaded"], "client_state": got["client_state"], "steps": got["steps"],
                              "max_loss_rel_diff": max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in pairs),
                              "lr_equal": all(a["lr"] == b["lr"] for a, b in pairs)})
            report[case] = ranks
            print(f"{case}: " + "; ".join(f"rank {r}: loss rel. diff {x['max_loss_rel_diff']:.2e}, lr equal "
                                          f"{x['lr_equal']}" for r, x in enumerate(ranks)))
    finally:
        shutil.rmtree(ext_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    with open(results_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {results_path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("half", choices=("make", "continue"))
    ap.add_argument("dir", help="where the exported checkpoints are written / read")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "deepspeed_continue_export.json"))
    args = ap.parse_args()
    if args.half == "make":
        make(args.dir)
    else:
        cont(args.dir, args.out)


if __name__ == "__main__":
    main()
