"""One rank: nothing is reduced, so no gradient bucket or reduce buffer exists, and stage 3 in fp32 trains
exactly as plain torch does (each gradient is added into its fp32 row as it arrives: ``GradBuckets.direct``)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zeropp
from support.world import run_world

STEPS, BATCH, DIM = 3, 4, 24


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 40), nn.GELU(), nn.Linear(40, 1))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 1, generator=g)


def worker(rank: int, world: int) -> dict:
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed's default decay
    ref_losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    out: dict = {"ref_losses": ref_losses, "ref_state": copy.deepcopy(ref.state_dict())}
    for stage, bf16 in ((3, False), (2, True)):
        config = {"train_micro_batch_size_per_gpu": BATCH, "bf16": {"enabled": bf16},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
        engine, *_ = zeropp.initialize(model=_model(), config=config)
        losses, seconds = [], []
        for step in range(STEPS):
            x, y = _data(step)
            loss = nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            seconds.append(engine.time_report()["step_s"])
        timer = engine.tput_timer
        total_before = timer.total_elapsed_time
        out[(stage, bf16)] = {"losses": losses, "report": engine.memory_report(),
                              "state": engine.consolidated_state_dict(), "seconds": seconds,
                              "tput": (timer.avg_samples_per_sec(), timer.global_step_count, timer.batch_size,
                                       timer.total_elapsed_time, timer.step_elapsed_time)}
        # a script that drives it (DeepSpeed's stopwatch): from the engine's counts on, one global step of two
        # micro-steps, timed since the engine is past the first start_step steps
        timer.start()
        timer.stop()
        timer.start()
        timer.stop(global_step=True)
        out[(stage, bf16)]["driven"] = (timer.micro_step_count, timer.global_step_count, timer.step_elapsed_time,
                                        timer.total_elapsed_time - total_before, timer.end_time > timer.start_time)
        engine.close()
    return out


@pytest.fixture(scope="module")
def result() -> dict:
    return run_world(worker, 1)[0]


@pytest.mark.parametrize("case", [(3, False), (2, True)])
def test_no_bucket_or_reduce_buffer_exists(result: dict, case: tuple) -> None:
    buffers = result[case]["report"]["buffers"]
    assert "reduce" not in buffers and "grad_buckets" not in buffers, buffers
    assert not any("reduce" in part for line in buffers.values() for part in line.get("parts", {})), buffers


def test_fp32_stage3_trains_as_plain_torch_bit_for_bit(result: dict) -> None:
    assert result[(3, False)]["losses"] == result["ref_losses"]
    for name, value in result["ref_state"].items():
        assert torch.equal(result[(3, False)]["state"][name], value), name


def test_bf16_stays_within_bf16_rounding_of_fp32(result: dict) -> None:
    for got, want in zip(result[(2, True)]["losses"], result["ref_losses"]):
        assert abs(got - want) <= 2e-2 * abs(want) + 1e-3


def test_tput_timer_reads_the_engines_step_times(result: dict) -> None:
    run = result[(3, False)]
    avg, steps, batch, total, last = run["tput"]
    counted = run["seconds"][2:]  # DeepSpeed's ThroughputTimer leaves out the first two steps
    assert (steps, batch, last) == (STEPS, BATCH, run["seconds"][-1])
    assert total == sum(counted) > 0 and avg == BATCH * len(counted) / sum(counted)
    micro, steps_after, step_time, added, timed = run["driven"]
    assert (micro, steps_after) == (STEPS + 2, STEPS + 1)  # the engine's counts, then the script's calls
    assert step_time == 0.0 and added > 0 and timed  # both micro-steps timed, the step's time reset at its end
