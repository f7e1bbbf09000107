"""A script written against DeepSpeed's documented API, with only its import changed
(``examples/deepspeed_train.py``: argparse + add_config_arguments, init_distributed, zero.Init,
initialize(args=, training_data=), the engine's accessors, save_checkpoint with client state,
save_16bit_model), run under torchrun on 2 nodes x 2 ranks, trains to the same losses as the same model
and data through zeropp's native API."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeropp
from support.world import run_world

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "deepspeed_train.py"
STEPS = 6
CONFIG = {**json.loads((ROOT / "examples" / "ds_config.json").read_text()), "topology": {"ranks_per_node": 2}}
CONFIG["zero_optimization"] = {**CONFIG["zero_optimization"], "zero_quantized_weights": True,
                               "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


def _example():
    spec = importlib.util.spec_from_file_location("deepspeed_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def native(rank: int, world: int, cfg: dict) -> list[float]:
    """The same training in zeropp's own vocabulary: a meta-device model, a loader built here."""
    ex = _example()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = ex.TinyLM()
    engine, *_ = zeropp.initialize(model=model, config=cfg)
    data = ex.Sequences()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg["train_micro_batch_size_per_gpu"], sampler=sampler)
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    dist.barrier()
    return losses


@pytest.fixture(scope="module")
def script_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("ds_script")
    cfg_path = tmp / "ds_config.json"
    cfg_path.write_text(json.dumps(CONFIG))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(SCRIPT), "--deepspeed", "--deepspeed_config", str(cfg_path), "--steps", str(STEPS),
           "--save_dir", str(tmp / "save"), "--out", str(tmp / "out.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {"out": json.loads((tmp / "out.json").read_text()), "dir": tmp / "save", "stdout": proc.stdout}


def test_script_trains_to_the_native_losses(script_run: dict) -> None:
    native_losses = run_world(native, 4, CONFIG, ranks_per_node=2)[0]
    script_losses = script_run["out"]["losses"]
    assert len(script_losses) == STEPS and script_losses[-1] < script_losses[0]
    assert script_losses == native_losses  # the same computation through two front doors: bit for bit


def test_script_reports_and_saves_through_deepspeed_names(script_run: dict) -> None:
    out = script_run["out"]
    assert out["stage"] == 3 and out["world_size"] == 4
    assert "step 0 loss" in script_run["stdout"]
    save = script_run["dir"]
    assert (save / "latest").read_text().strip() == f"global_step{STEPS}"
    state = torch.load(save / "model_16bit.bin")
    assert state["emb.weight"].dtype == torch.bfloat16 and state["emb.weight"].shape == (64, 32)
