"""ZeRO-Infinity: optimizer state and parameters offloaded to NVMe files.

* Parity: NVMe offload changes where model states wait between uses, not what is computed: losses, gradient
  norms and weights equal the non-offloaded run bit for bit (stages 2 and 3, fp32 and bf16, with gradient
  accumulation and clipping; torch's AdamW and zeropp's CpuAdam are bit-identical).
* Memory: with both offloads on NVMe, the model-state bytes resident per rank, sampled throughout forward,
  backward and every per-unit optimizer step, stay within the stated bound while the model's states are more
  than 4x that bound.
* Files: one per rank and kind while training, none after ``close()`` or after the process exits.
"""
from __future__ import annotations

import functools
import math
import os
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeropp
from support.train import config, train_engine
from support.world import run_world
from zeropp.offload.link import ThreadedLink

STEPS, GB = 4, 8
CASES = [(stage, dtype, param) for stage in (2, 3) for dtype in ("fp32", "bf16")
         for param in ((False, True) if stage == 3 else (False,))]
CASES += [(2, "fp16", False), (3, "fp16", True)]  # overflows skip steps: offloaded rows must still be cleared
CASES += [("zeropp", "bf16", False)]  # qwZ + hpZ + qgZ with the optimizer on NVMe (hpZ keeps params in memory)
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
# also through ThreadedLink (device memory apart from the host, copies that finish later; see test_offload)
LINK_CASES = [(2, "fp32", False), (3, "fp32", False), (3, "bf16", False), (3, "bf16", True)]


def case_config(stage: int | str, dtype: str, param_nvme: bool, nvme_dir: str | None) -> dict:
    cfg = config(GB, **(ZEROPP if stage == "zeropp" else {}))
    stage = 3 if stage == "zeropp" else stage
    cfg["gradient_accumulation_steps"] = 2
    cfg["gradient_clipping"] = 0.5
    cfg["zero_optimization"]["stage"] = stage
    if nvme_dir is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
        if param_nvme:
            cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir,
                                                         "buffer_count": 3, "buffer_size": 64}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # the default scale (2^16) overflows at first, then halves until steps go through
        cfg["fp16"] = {"enabled": True, "hysteresis": 1}
    return cfg


def parity_run(rank: int, world: int, nvme_dir: str) -> dict:
    out = {}
    for case in CASES:
        for offload in (False, True):
            r = train_engine(rank, world, case_config(*case, nvme_dir if offload else None), STEPS, GB)
            out[(case, offload)] = {k: r[k] for k in ("losses", "grad_norms", "eval_loss", "state")}
    for case in LINK_CASES:
        with mock.patch("zeropp.api.build_link", lambda *args: ThreadedLink()):
            r = train_engine(rank, world, case_config(*case, nvme_dir), STEPS, GB)
        out[(case, "threaded")] = {k: r[k] for k in ("losses", "grad_norms", "eval_loss", "state")}
    return out


@functools.lru_cache(maxsize=None)
def parity_results() -> list:
    with tempfile.TemporaryDirectory() as d:
        got = run_world(parity_run, 2, d)
        left = os.listdir(d)
    return [got, left]


@pytest.mark.parametrize("stage,dtype,param", CASES)
def test_nvme_offload_equals_the_plain_run_bit_for_bit(stage, dtype, param):
    got, _ = parity_results()
    for rank_result in got:
        plain, nvme = rank_result[((stage, dtype, param), False)], rank_result[((stage, dtype, param), True)]
        assert nvme["losses"] == plain["losses"]
        assert [repr(n) for n in nvme["grad_norms"]] == [repr(n) for n in plain["grad_norms"]]  # nan == nan
        assert nvme["eval_loss"] == plain["eval_loss"]
        for key, value in plain["state"].items():
            assert torch.equal(nvme["state"][key], value), key
        finite = [n for n in plain["grad_norms"] if math.isfinite(n)]
        assert max(finite) > 0.5  # clipping (a second pass over the offloaded rows) was exercised
        if dtype == "fp16":
            assert len(finite) < STEPS  # some steps were skipped (overflow) ...
        assert len(set(plain["losses"])) >= STEPS - 1  # ... and the weights moved


@pytest.mark.parametrize("stage,dtype,param", LINK_CASES)
def test_nvme_offload_through_an_asynchronous_link_equals_the_plain_run(stage, dtype, param):
    got, _ = parity_results()
    for rank_result in got:
        plain, linked = rank_result[((stage, dtype, param), False)], rank_result[((stage, dtype, param), "threaded")]
        assert linked["losses"] == plain["losses"] and linked["eval_loss"] == plain["eval_loss"]
        for key, value in plain["state"].items():
            assert torch.equal(linked["state"][key], value), key


def test_offload_files_are_gone_when_the_engines_are_collected():
    _, left = parity_results()
    assert left == []


# ---- memory bound ----------------------------------------------------------------------------------------
DIM, HIDDEN, BLOCKS = 32, 128, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def stack_config(world: int, nvme_dir: str | None) -> tuple[dict, int]:
    block_elems = sum(p.numel() for p in Block().parameters())
    bucket = 2 * block_elems  # elements
    zero: dict = {"stage": 3, "reduce_bucket_size": bucket}
    if nvme_dir is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 3}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 3,
                                 "buffer_size": block_elems // world + 64}
    cfg = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    return cfg, bucket


def stack_engine(world: int, nvme_dir: str | None):
    cfg, _ = stack_config(world, nvme_dir)
    torch.manual_seed(0)
    return zeropp.initialize(model=Stack(), config=cfg)[0]


def stack_steps(engine, rank: int, first: int, n: int) -> list[float]:
    x = torch.randn(64, 4, DIM, generator=torch.Generator().manual_seed(1))
    out = []
    for i in range(first, first + n):
        loss = engine(x[i * 8 + rank * 2: i * 8 + rank * 2 + 2])
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def memory_run(rank: int, world: int, nvme_dir: str) -> dict:
    plain = stack_steps(stack_engine(world, None), rank, 0, 6)
    cfg, bucket = stack_config(world, nvme_dir)
    torch.manual_seed(0)
    engine, optimizer, *_ = zeropp.initialize(model=Stack(), config=cfg)
    samples: list[int] = []
    sample = lambda *_: samples.append(engine.model_state_bytes()["total"])  # noqa: E731
    for m in engine.module.modules():
        m.register_forward_pre_hook(sample)
        m.register_forward_hook(sample)
        m.register_full_backward_pre_hook(lambda *_: sample())
    step = optimizer.step

    def sampled_step(*args, **kwargs):  # the engine steps one unit at a time: sample inside each
        sample()
        out = step(*args, **kwargs)
        sample()
        return out

    optimizer.step = sampled_step
    files = sorted(os.listdir(nvme_dir))
    losses = stack_steps(engine, rank, 0, 6)
    units = engine.units
    gathered = sorted((sum(s.spec.padded for s in u.slots) * 2 for u in units), reverse=True)
    report = engine.offload_report()
    engine.close()
    return {"samples": samples, "losses": losses, "plain_losses": plain, "files": files, "report": report,
            "gathered_two_largest": gathered[0] + gathered[1], "root_gathered": gathered[-1],
            "bucket_bytes": 2 * bucket * 2, "units": len(units),
            "model_state_full": 16 * sum(sum(s.spec.padded for s in u.slots) for u in units) // world,
            "left_after_close": sorted(os.listdir(nvme_dir))}


@functools.lru_cache(maxsize=None)
def memory_results() -> list:
    with tempfile.TemporaryDirectory() as d:
        return run_world(memory_run, 2, d)


def test_resident_model_states_stay_within_the_bound_on_a_model_four_times_larger():
    for rank, r in enumerate(memory_results()):
        rep = r["report"]
        # The bound: the swap buffers (offload_param: buffer_count x buffer_size x 2 bytes; offload_optimizer:
        # buffer_count x the largest unit's record) plus one module's working set: the full 16-bit weights of
        # the units gathered at once (the root and two blocks: the block in backward and the one whose
        # gradient arrives next) and the full gradients in the two reduce buckets (one filling, one in flight).
        working_set = r["gathered_two_largest"] + r["root_gathered"] + r["bucket_bytes"]
        bound = rep["buffer_budget_bytes"] + working_set
        assert max(r["samples"]) <= bound, (max(r["samples"]), bound)
        assert rep["buffer_peak_bytes"] <= rep["buffer_budget_bytes"]
        assert r["model_state_full"] >= 4 * bound, (r["model_state_full"], bound)
        assert rep["offloaded_bytes"] >= r["model_state_full"] * 0.9  # masters, moments, shards, grads on disk
        assert len(r["samples"]) > 6 * 2 * (4 * BLOCKS)  # sampled through forward, backward and each unit step
        assert r["losses"] == r["plain_losses"]  # and it computes exactly what the non-offloaded run does
        mine = sorted(f.split("-rank")[0] for f in r["files"] if f"-rank{rank}-" in f)
        assert mine == ["zeropp-optimizer", "zeropp-param"]  # one file per rank and kind
        assert sorted(rep["files"]) == sorted(os.path.join(os.path.dirname(rep["files"][0]), f)
                                              for f in r["files"] if f"-rank{rank}-" in f)
        assert not any(f"-rank{rank}-" in f for f in r["left_after_close"])  # close() deleted them


# ---- start-up errors and checkpoints ---------------------------------------------------------------------
def startup_errors(rank: int, world: int, base: str) -> dict:
    """Each bad setting fails in initialize, naming its key, and leaves no file behind."""
    from zeropp.offload.aio import OffloadError
    blocker = os.path.join(base, "a-file")
    open(blocker, "w").close()
    good = os.path.join(base, "nvme")
    out = {}

    def attempt(label: str, zero: dict) -> None:
        cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 3, **zero},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        try:
            zeropp.initialize(model=Stack(), config=cfg)
            out[label] = "no error"
        except OffloadError as e:
            out[label] = str(e)

    attempt("unwritable", {"offload_optimizer": {"device": "nvme", "nvme_path": os.path.join(blocker, "sub")}})
    attempt("small_buffer", {"offload_param": {"device": "nvme", "nvme_path": good, "buffer_size": 100},
                             "offload_optimizer": {"device": "nvme", "nvme_path": good}})
    real = os.statvfs

    class Full:  # a file system with 1 MiB free
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize, self.f_bavail = 4096, 256

    os.statvfs = lambda p: Full(real(p))  # only inside this spawned rank
    try:
        attempt("full_disk", {"offload_param": {"device": "nvme", "nvme_path": good}})
    finally:
        os.statvfs = real
    out["left"] = sorted(os.listdir(good)) if os.path.isdir(good) else []
    return out


def test_bad_offload_paths_fail_at_start_up_naming_the_key(tmp_path):
    r = run_world(startup_errors, 1, str(tmp_path))[0]
    assert r["unwritable"].startswith("zero_optimization.offload_optimizer.nvme_path: offload path")
    assert "cannot be created" in r["unwritable"]
    assert r["small_buffer"].startswith("zero_optimization.offload_param.buffer_size: unit 'blocks.0'")
    assert r["full_disk"].startswith("zero_optimization.offload_param.nvme_path:")
    assert "not enough free disk space" in r["full_disk"]
    assert r["left"] == []  # a failed start deletes what it created


def checkpoint_run(rank: int, world: int, base: str) -> dict:
    """Save with NVMe offload mid-run, load into a fresh NVMe engine: it continues exactly as the original.
    Then load a checkpoint saved before any step (no optimizer state) into an engine that has state."""
    ckpt, early = os.path.join(base, "ckpt"), os.path.join(base, "early")
    a = stack_engine(world, os.path.join(base, "nvme"))
    a.save_checkpoint(early)
    stack_steps(a, rank, 0, 4)  # 2 optimizer steps (2 micro-steps each)
    a.save_checkpoint(ckpt)
    original = stack_steps(a, rank, 4, 4)
    b = stack_engine(world, os.path.join(base, "nvme"))
    b.load_checkpoint(ckpt)
    resumed = stack_steps(b, rank, 4, 4)
    plain = stack_engine(world, None)
    plain.load_checkpoint(ckpt)  # the checkpoint is the same format either way
    sa, sb = a.consolidated_state_dict(), b.consolidated_state_dict()
    a.load_checkpoint(early)  # its moments are dropped from memory and from the store
    again = stack_steps(a, rank, 0, 4)
    fresh = stack_steps(stack_engine(world, None), rank, 0, 4)
    return {"original": original, "resumed": resumed, "plain": stack_steps(plain, rank, 4, 4),
            "state_equal": all(torch.equal(v, sb[k]) for k, v in sa.items()), "again": again, "fresh": fresh}


def test_checkpoint_round_trip_with_nvme_offload_continues_bit_for_bit(tmp_path):
    for r in run_world(checkpoint_run, 2, str(tmp_path)):
        assert r["resumed"] == r["original"]
        assert r["plain"] == r["original"]
        assert r["state_equal"]
        assert r["again"] == r["fresh"]


def frozen_run(rank: int, world: int, base: str) -> dict:
    """Frozen parameters and parameters left out of the optimizer keep their weights under every offload
    combination (the optimizer never writes their 16-bit shards; the engine must recast them)."""
    out = {}
    for label, opt_dev, par_dev in (("plain", "none", "none"), ("cpu+param_nvme", "cpu", "nvme"),
                                    ("nvme+param_nvme", "nvme", "nvme"), ("cpu+param_cpu", "cpu", "cpu")):
        cfg, _ = stack_config(world, None)
        zero = cfg["zero_optimization"]
        path = os.path.join(base, label)
        if opt_dev != "none":
            zero["offload_optimizer"] = {"device": opt_dev, "nvme_path": path}
        if par_dev != "none":
            zero["offload_param"] = {"device": par_dev, "nvme_path": path, "buffer_size": 10_000}
        torch.manual_seed(0)
        model = Stack()
        model.blocks[0].up.weight.requires_grad_(False)
        trained = [p for p in model.parameters() if p.requires_grad and p is not model.blocks[1].down.bias]
        engine = zeropp.initialize(model=model, config=cfg, model_parameters=trained)[0]
        losses = stack_steps(engine, rank, 0, 6)
        state = engine.consolidated_state_dict()
        engine.close()
        out[label] = {"losses": losses, "state": state}
    return out


def test_frozen_and_left_out_parameters_keep_their_weights_under_offload(tmp_path):
    for r in run_world(frozen_run, 2, str(tmp_path)):
        plain = r["plain"]
        torch.manual_seed(0)
        init = Stack().state_dict()
        assert torch.equal(plain["state"]["blocks.0.up.weight"], init["blocks.0.up.weight"])
        assert torch.equal(plain["state"]["blocks.1.down.bias"], init["blocks.1.down.bias"])
        for label in ("cpu+param_nvme", "nvme+param_nvme", "cpu+param_cpu"):
            assert r[label]["losses"] == plain["losses"], label
            for key, value in plain["state"].items():
                assert torch.equal(r[label]["state"][key], value), (label, key)
