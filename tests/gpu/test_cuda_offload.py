"""ZeRO-Offload on a CUDA device: host rows are page-locked, gradients go down and 16-bit shards go up
through CudaLink's side streams, and training matches the run without offload.

CpuAdam reproduces torch's CPU AdamW bit for bit; torch's CUDA AdamW rounds its square root differently,
so the comparison with the plain CUDA run allows float rounding (the CPU suite checks exactness)."""
from __future__ import annotations

import pytest
import torch

import zeropp
from support.models import TiedNet, tied_batch
from support.train import config
from zeropp.offload.link import CudaLink

STEPS, GB = 6, 8
DEVICE = torch.device("cuda", 0)


def run(stage: int, dtype: str, offload: bool, pin: bool = True) -> dict:
    cfg = config(GB)
    cfg["zero_optimization"]["stage"] = stage
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    engine, optimizer, *_ = zeropp.initialize(model=TiedNet().to(DEVICE), config=cfg)
    losses = []
    for step in range(STEPS):
        idx, tgt = tied_batch(step, GB)
        loss = engine(idx.to(DEVICE), tgt.to(DEVICE))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    torch.cuda.synchronize()
    return {"engine": engine, "losses": losses, "state": engine.consolidated_state_dict(),
            "optimizer": type(optimizer).__name__}


@pytest.mark.parametrize("stage,dtype", [(1, "bf16"), (2, "bf16"), (3, "bf16"), (3, "fp32")])
def test_offload_on_cuda_trains_like_the_plain_cuda_run(stage, dtype):
    plain, off = run(stage, dtype, False), run(stage, dtype, True)
    assert off["optimizer"] == "CpuAdam"
    assert off["losses"][-1] < off["losses"][0]
    tol = 2e-2 if dtype == "bf16" else 1e-4
    assert off["losses"] == pytest.approx(plain["losses"], rel=tol)
    for key, value in plain["state"].items():
        torch.testing.assert_close(off["state"][key], value, rtol=tol, atol=tol, msg=key)


@pytest.mark.parametrize("pin", [True, False])
def test_offloaded_rows_live_on_the_host_and_are_pinned_when_asked(pin):
    engine = run(3, "bf16", True, pin)["engine"]
    assert isinstance(engine.link, CudaLink)
    for u in engine.units:
        assert u.master.device.type == "cpu" and u.master.is_pinned() == pin
        assert u.staged_row is not None and u.staged_row.is_pinned() == pin  # the fused step writes it
        assert u.kept_shard is not None and u.kept_shard.device.type == "cuda"  # what the gather reads
        assert u.grad is not None and u.grad.device.type == "cpu" and u.grad.is_pinned() == pin
        torch.testing.assert_close(u.kept_shard.cpu(), u.staged_row, rtol=0, atol=0)  # the upload landed
