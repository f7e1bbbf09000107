#!/usr/bin/env python
"""Universal checkpoints made by DeepSpeed 0.19.8's own converter, plus what DeepSpeed does with them, as test data
for zeropp's DeepSpeed-free universal loader.

Run it with a Python that has deepspeed==0.19.8 and torch installed (CPU only):

    python3 -m venv /tmp/dsvenv3 && /tmp/dsvenv3/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 /tmp/dsvenv3/bin/pip install deepspeed==0.19.8 safetensors numpy
    /tmp/dsvenv3/bin/python tests/data/deepspeed_universal/make_universal.py [case ...]

Cases: stage2_fp32 stage3_bf16 (default: both). For each, the ZeRO checkpoint DeepSpeed 0.19.8 saved on 2 ranks
(tests/data/deepspeed/<case>, made by tests/data/deepspeed/make_checkpoints.py) is converted by DeepSpeed's own
command, exactly as a user runs it:

    python -m deepspeed.checkpoint.ds_to_universal --input_folder <copy>/global_step3 \\
        --output_folder <copy>/global_step3_universal --inject_missing_state

(``--inject_missing_state``: the run saved no ``universal_checkpoint_info`` client key, which only Megatron-DeepSpeed
writes; DeepSpeed's stage 1-2 converter refuses without one). Its output is kept as written in
``<case>/global_step3_universal/`` with ``<case>/latest_universal``. Then, on ``RELOAD_WORLD`` (4) gloo ranks, a
fresh DeepSpeed engine (model seed 1234) with ``"checkpoint": {"load_universal": true}`` loads ``<case>`` and
trains 5 steps; each rank takes its share of the samples the 2 saving ranks took (``batch`` below). The script
asserts that DeepSpeed's fp32 masters and Adam moments after the load equal the ZeRO checkpoint's references
(tests/data/deepspeed/<case>/reference) bit for bit, and writes ``<case>/reference/continued_losses.json``: per rank
the loss and lr of each continued step, the global step and lr after the load.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ZERO_DATA = os.path.normpath(os.path.join(HERE, "..", "deepspeed"))
SUPPORT = os.path.normpath(os.path.join(HERE, "..", "..", "support"))
sys.path.insert(0, SUPPORT)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CASES = ("stage2_fp32", "stage3_bf16")
RELOAD_WORLD = 4
SAVED_WORLD = 2
FIRST_STEP, CONTINUE_STEPS = 3, 5
FRESH_SEED = 1234


def config(case: str, world: int) -> dict:
    with open(os.path.join(ZERO_DATA, case, "reference", "continued_losses.json")) as f:
        cfg = copy.deepcopy(json.load(f)["config"])
    cfg["train_micro_batch_size_per_gpu"] = 2 * SAVED_WORLD // world  # the same global batch
    cfg["checkpoint"] = {"load_universal": True}
    return cfg


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank`` of ``world``'s share of the samples the saving rank ``rank // (world // 2)`` took."""
    from ds_reference import ds_batch
    per = world // SAVED_WORLD
    x, y = ds_batch(step, rank // per)
    m = 2 // per
    i = rank % per
    return x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]


def convert(case: str, work: str) -> str:
    """DeepSpeed's own converter on a copy of the case; returns the copy's directory."""
    src = os.path.join(work, case)
    shutil.copytree(os.path.join(ZERO_DATA, case), src, ignore=shutil.ignore_patterns("reference"))
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           os.path.join(src, "global_step3"), "--output_folder", os.path.join(src, "global_step3_universal"),
           "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    subprocess.run(cmd, check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return src


def reload_rank(rank: int, case: str, src: str, port: int, ext_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(RELOAD_WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(RELOAD_WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=ext_dir)
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from ds_reference import ds_loss, make_model
    from safetensors.torch import load_file
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(FRESH_SEED)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(case, RELOAD_WORLD))
    path, client = engine.load_checkpoint(src)
    ref = os.path.join(ZERO_DATA, case, "reference")
    weights = load_file(os.path.join(ref, "fp32_weights.safetensors"))
    moments = load_file(os.path.join(ref, "optimizer_state.safetensors"))
    for name, p in engine.module.named_parameters():  # DeepSpeed's own universal load restores them exactly
        assert torch.equal(safe_get_full_fp32_param(p).float(), weights[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(safe_get_full_optimizer_state(p, key), moments[f"{name}.{key}"]), (name, key)
    after = {"global_steps": engine.global_steps, "lr": engine.get_lr()[0], "returned_path": os.path.basename(path)}
    steps = []
    for step in range(FIRST_STEP, FIRST_STEP + CONTINUE_STEPS):
        lr = engine.get_lr()[0]
        loss = ds_loss(engine, *batch(step, rank, RELOAD_WORLD))
        engine.backward(loss)
        engine.step()
        steps.append({"step": step, "loss": loss.item(), "lr": lr})
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"after_load": after, "continued": steps,
                   "client_keys": sorted(k for k in client if isinstance(k, str))}, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(case: str, work: str, ext_dir: str) -> None:
    src = convert(case, work)
    out = tempfile.mkdtemp(prefix="ds_uc_reload_", dir=work)
    mp.spawn(reload_rank, args=(case, src, free_port(), ext_dir, out), nprocs=RELOAD_WORLD, join=True)
    ranks = {}
    for r in range(RELOAD_WORLD):
        with open(os.path.join(out, f"{r}.json")) as f:
            ranks[str(r)] = json.load(f)
    dst = os.path.join(HERE, case)
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(os.path.join(dst, "reference"))
    shutil.copytree(os.path.join(src, "global_step3_universal"), os.path.join(dst, "global_step3_universal"))
    shutil.copy2(os.path.join(src, "latest_universal"), os.path.join(dst, "latest_universal"))
    import deepspeed
    doc = {"what": f"DeepSpeed {deepspeed.__version__} converted tests/data/deepspeed/{case} (saved on "
                   f"{SAVED_WORLD} ranks) with its ds_to_universal --inject_missing_state, then on {RELOAD_WORLD} "
                   "ranks "
                   "a fresh engine (model seed 1234, checkpoint.load_universal true) ran load_checkpoint(<case>) and "
                   "5 steps; per rank the loss and the lr each step used (engine.get_lr()[0] before engine.step())",
           "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
           "world_size": RELOAD_WORLD, "config": config(case, RELOAD_WORLD), "ranks": ranks}
    with open(os.path.join(dst, "reference", "continued_losses.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"[{case}] universal checkpoint and DeepSpeed's continuation on {RELOAD_WORLD} ranks written to {dst}")


def main(argv: list[str]) -> None:
    import deepspeed
    assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
    work, ext_dir = tempfile.mkdtemp(prefix="ds_uc_"), tempfile.mkdtemp(prefix="ds_ext_")
    try:
        for case in argv or CASES:
            make(case, work, ext_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ext_dir, ignore_errors=True)


if __name__ == "__main__":
    os.environ["DS_ACCELERATOR"] = "cpu"
    main(sys.argv[1:])
