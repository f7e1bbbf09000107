"""Stage 3 with ZeRO++ on one CUDA device: a world of one over NCCL, qwZ and qgZ active with groups of one
(hpZ needs a group of two), their quantizers on the Triton path. Training follows plain stage 3 within the
quantization error; a forward waits on the device at most once (Note [deferred weight checks] in
``plus/qwz.py``), and a corrupted shard is still named, once the forward ends."""
from __future__ import annotations

import warnings

import pytest
import torch

import zeropp
from support.models import TiedNet, tied_batch
from support.train import config
from zeropp.plus.qgz import QuantizedReduce
from zeropp.plus.qwz import NonFiniteWeightError, QuantizedGather

STEPS, GB = 6, 8
DEVICE = torch.device("cuda", 0)


def _engine(plus: bool):  # noqa: ANN202
    cfg = config(GB)
    cfg["zero_optimization"]["stage"] = 3
    if plus:
        cfg["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True)
    cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    return zeropp.initialize(model=TiedNet().to(DEVICE), config=cfg)[0]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, tgt = tied_batch(step, GB)
    return idx.to(DEVICE), tgt.to(DEVICE)


def _train(engine) -> list[float]:  # noqa: ANN001
    losses = []
    for step in range(STEPS):
        loss = engine(*_batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def test_zeropp_on_cuda_trains_like_plain_stage_3():
    plus = _engine(True)
    assert isinstance(plus.strategies.forward_gather, QuantizedGather)
    assert isinstance(plus.strategies.reduce, QuantizedReduce)
    assert plus.strategies.forward_gather.checks.defer is None  # deferred because the rows are on CUDA
    quantized, plain = _train(plus), _train(_engine(False))
    assert quantized[-1] < quantized[0]
    assert quantized == pytest.approx(plain, rel=5e-2)


def test_adam_on_the_device_is_torchs_fused_one():
    # one kernel for the step, as DeepSpeed's FusedAdam: foreach took 2.3x its time on a 1.24B model (H200)
    engine = _engine(False)
    assert all(g["fused"] for g in engine.master_optimizer.param_groups)
    losses = _train(engine)
    assert losses[-1] < losses[0]
    # neither the step's fp32 gradients nor the reduced rows stay on the device into the next forward (Notes
    # [host step passes], [rows between steps])
    assert engine.stepper._host_grads is None
    assert not engine.stepper.keeps_rows and all(u.grad is None for u in engine.units)


def test_a_forward_waits_on_the_device_at_most_once():
    engine = _engine(True)
    _train(engine)  # the pools' buffers and the kernels exist from here on
    batch = _batch(0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = engine(*batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch also warns once that the debug mode is a prototype; only "called a synchronizing ..." is a sync
    syncs = [str(w.message) for w in seen if "called a synchronizing" in str(w.message)]
    assert len(syncs) <= 1, syncs  # the weight checks' one settle per pass, not one per unit
    engine.backward(loss)
    engine.step()


def test_a_corrupted_shard_is_named_once_the_forward_ends():
    engine = _engine(True)
    unit = next(u for u in engine.units if u.module_name == "up")
    unit.master[0] = float("nan")
    unit.refresh_shard_from_master()
    with pytest.raises(NonFiniteWeightError, match=r"'up\.weight'.*rank 0"):
        engine(*_batch(0))
