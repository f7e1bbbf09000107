"""DeepSpeed's engine and ZeRO optimizer as its scripts and tests drive them, through the ``deepspeed`` alias on 2
ranks: ``engine.optimizer`` is the ZeRO optimizer, whose ``step()``/``zero_grad()`` and gradient partitions
(``averaged_gradients``, ``get_fp32_grad_partitions()``) behave as DeepSpeed's, checked against an independent
single-process model (torch's AdamW); ``param.ds_tensor.data = value`` sets a rank's partition; inputs are not
cast; an unused parameter raises DeepSpeed's AssertionError."""
from __future__ import annotations

import functools
import tempfile

import torch
from torch import nn

import zeropp
from support.ds_reference import ds_batch, ds_loss, make_model
from support.train import error_of
from support.world import run_world

WORLD, LR, WD = 2, 1e-2, 0.01


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, **extra}


def grads(utils, model) -> dict:
    return {n: utils.safe_get_full_grad(p) for n, p in model.named_parameters()}


def optimizer_calls(rank: int, stage: int) -> dict:
    """Backward twice (accumulating), zero_grad, backward again (a new accumulation), then the ZeRO optimizer's
    own step(); the gradient partitions after the first backward."""
    import deepspeed
    from deepspeed import utils
    from deepspeed.runtime.engine import DeepSpeedEngine
    model = make_model(0)
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=config(stage))
    out: dict = {"classes": (isinstance(engine, deepspeed.DeepSpeedEngine), isinstance(engine, DeepSpeedEngine)),
                 "same_view": engine.optimizer is optimizer, "inner": optimizer.optimizer is engine.master_optimizer}
    names = {id(p): n for n, p in model.named_parameters()}
    out["order"] = [names[id(p)] for [p] in optimizer.fp16_groups]
    x, y = ds_batch(0, rank)
    engine.backward(ds_loss(engine, x, y))
    out["once"] = grads(utils, model)
    if stage == 3:
        out["parts"] = optimizer.get_fp32_grad_partitions()
    if stage >= 2:
        out["averaged"] = optimizer.averaged_gradients
    engine.backward(ds_loss(engine, x, y))
    out["twice"] = grads(utils, model)
    optimizer.zero_grad()
    out["after_zero_grad"] = grads(utils, model)  # DeepSpeed's: dropped when the next backward begins
    engine.backward(ds_loss(engine, x, y))
    engine.allreduce_gradients()
    out["restarted"] = grads(utils, model)
    optimizer.step()
    out["stepped"] = {n: utils.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    out["counts"] = (engine.global_steps, engine.micro_steps)
    out["closure"] = error_of(lambda: optimizer.step(lambda: 0.0))
    if stage == 2:
        out["bit16"] = [[(t.detach().clone(), t.data_ptr()) for t in parts]
                        for parts in optimizer.parallel_partitioned_bit16_groups]
        out["align"] = optimizer.nccl_start_alignment_factor
        out["weights"] = {names[id(p)]: p.detach().clone() for p in model.parameters()}
    if stage == 3:
        out["bit16"] = error_of(lambda: optimizer.parallel_partitioned_bit16_groups)
    engine.destroy()
    return out


def partition_writes(rank: int) -> dict:
    """``param.ds_tensor.data = value`` (DeepSpeed's test idiom) on a stage-3 engine, and what is refused."""
    import deepspeed
    from deepspeed import utils
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, config=config(3))
    w = model.fc1.weight
    w.ds_tensor.data = torch.full_like(w.ds_tensor.data, float(rank + 1))
    out = {"full": utils.safe_get_full_fp32_param(w), "part": w.ds_tensor.clone(),
           "plain": type(w.ds_tensor * 2) is torch.Tensor,
           "add_": error_of(lambda: w.ds_tensor.add_(1.0)), "fill_": error_of(lambda: w.ds_tensor.data.fill_(0.0)),
           "setitem": error_of(lambda: w.ds_tensor.__setitem__(0, 5.0)),
           "size": error_of(lambda: setattr(w.ds_tensor, "data", torch.zeros(3)))}
    seen = []
    model.fc1.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    engine(torch.ones(1, 8))
    out["fc1_out"] = seen[0]
    engine.destroy()
    return out


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x.to(self.used.weight.dtype)).pow(2).mean()  # as a script does whose inputs are not cast


def inputs_and_errors(rank: int) -> dict:
    """The dtype a bf16 model is given, under the alias and natively; the unused-parameter error's type."""
    import deepspeed
    out: dict = {}
    fp16 = {"fp16": {"enabled": True, "auto_cast": True}}
    for how, init, extra in (("alias", deepspeed.initialize, {"bf16": {"enabled": True}}),
                             ("native", zeropp.initialize, {"bf16": {"enabled": True}}),
                             ("auto_cast", deepspeed.initialize, fp16)):
        model = Unused()
        dtypes = []
        model.register_forward_pre_hook(lambda m, a: dtypes.append(a[0].dtype))
        engine, *_ = init(model=model, config=config(2, **extra))
        engine(torch.ones(2, 4))
        out[how] = dtypes[0]
        engine.destroy()
    engine, *_ = deepspeed.initialize(model=Unused(), config=config(2, zero_optimization={
        "stage": 2, "ignore_unused_parameters": False}))
    try:
        engine.backward(engine(torch.ones(2, 4)))
    except AssertionError as err:
        out["unused"] = (str(err), type(err.__cause__).__name__)
    engine.destroy()
    return out


def accessors(rank: int) -> dict:
    """The engine's DeepSpeed accessors over an accumulation window of 2 micro-steps (stage 2, bf16, the optimizer
    on the host)."""
    import deepspeed
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, config=config(2, gradient_accumulation_steps=2, bf16={
        "enabled": True}, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}))
    out: dict = {"batch": engine.get_batch_info(), "sizes": (engine.dp_world_size, engine.mp_world_size, engine.mpu),
                 "settings": (engine.gradient_clipping(), engine.gradient_predivide_factor(), engine.steps_per_print(),
                              engine.wall_clock_breakdown(), engine.dynamic_loss_scale(), engine.amp_enabled()),
                 "zero": (engine.zero_optimization_partition_gradients(), engine.zero_optimization_partition_weights(),
                          engine.zero_offload_optimizer(), engine.zero_offload_param(), engine.zero_cpu_offload(),
                          engine.zero_allgather_bucket_size(), engine.zero_overlap_comm()),
                 "reduce_bucket": engine.zero_reduce_bucket_size(), "comm_dtype": engine.communication_data_type,
                 "missing": error_of(lambda: engine.training_dataloader)}
    applied = []
    for micro in range(2):
        x, y = ds_batch(micro, rank)
        engine.backward(ds_loss(engine, x, y))
        engine.step()
        applied.append(engine.was_step_applied())
    out.update(applied=applied, samples=engine.global_samples, skipped=engine.skipped_steps)
    path = engine.save_fp16_model(tempfile.mkdtemp(prefix="zeropp-fp16-") if rank == 0 else "unused")
    out["saved"] = sorted(torch.load(path)) if rank == 0 else None
    out["names"] = sorted(n for n, _ in model.named_parameters())
    engine.destroy()
    return out


def scenario(rank: int, world: int) -> dict:
    zeropp.install_deepspeed_alias()
    out: dict = {stage: optimizer_calls(rank, stage) for stage in (1, 2, 3)}
    out["writes"] = partition_writes(rank)
    out["inputs"] = inputs_and_errors(rank)
    out["accessors"] = accessors(rank)
    return out


@functools.lru_cache(maxsize=None)
def results() -> list:
    return run_world(scenario, WORLD)


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    """One process, the ranks' batches averaged: the gradient, and the weights after one clipped AdamW step."""
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    loss = sum(ds_loss(model, *ds_batch(0, r)) for r in range(WORLD)) / WORLD
    loss.backward()
    grad = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {"grad": grad, "stepped": {n: p.detach().clone() for n, p in model.named_parameters()}}


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-7, msg=what)


def test_engine_optimizer_is_the_zero_optimizer_and_steps_as_deepspeeds():
    """``engine.optimizer`` is what initialize returned; zero_grad() makes the next backward start afresh (the
    gradients stay readable until then); optimizer.step() is the clipped AdamW step of the reference, without
    advancing the engine's counters; a closure is refused."""
    ref = reference()
    for rank, res in enumerate(results()):
        for stage in (1, 2, 3):
            got = res[stage]
            assert got["classes"] == (True, True) and got["same_view"] and got["inner"], stage
            for name, g in ref["grad"].items():
                what = f"rank {rank} stage {stage} {name}"
                close(got["once"][name], g, what + " once")
                close(got["twice"][name], 2 * g, what + " twice")
                close(got["after_zero_grad"][name], 2 * g, what + " after zero_grad")
                close(got["restarted"][name], g, what + " restarted")
                close(got["stepped"][name], ref["stepped"][name], what + " stepped")
            assert got["counts"] == (0, 0), stage
            assert got["closure"].startswith("DeepSpeedAPIError") and "closure" in got["closure"]


def test_gradient_partitions_are_each_ranks_chunk_of_the_averaged_gradient():
    ref = reference()["grad"]
    ranks = results()
    for stage in (2, 3):
        order = ranks[0][stage]["order"]
        for j, name in enumerate(order):
            parts = [r[stage]["averaged"][0][j] for r in ranks]
            if stage == 3:
                for r, res in enumerate(ranks):
                    assert torch.equal(res[stage]["parts"][0][j], parts[r]), (name, r)
                    assert res[stage]["parts"][0][j].dtype == torch.float32
            assert len({p.numel() for p in parts}) == 1, name  # equal chunks, the last padded
            flat = torch.cat(parts)
            n = ref[name].numel()
            close(flat[:n], ref[name].reshape(-1), f"stage {stage} {name}")
            assert not flat[n:].any(), name


def test_stage_2_partitions_are_aligned_views_of_the_resident_weights():
    for res in results():
        got = res[2]
        assert got["align"] == 2
        for j, name in enumerate(got["order"]):
            parts = got["bit16"][j]
            assert len(parts) == WORLD
            weight = got["weights"][name].reshape(-1)
            assert torch.equal(torch.cat([t for t, _ in parts])[: weight.numel()], weight), name
            assert all(ptr % (2 * got["align"]) == 0 for _, ptr in parts), name
        assert res[3]["bit16"].startswith("DeepSpeedAPIError") and "stage 3" in res[3]["bit16"]


def test_ds_tensor_data_sets_this_ranks_partition():
    """Each rank set its part of fc1.weight (128 elements: 64 each) to rank + 1: the fp32 weight and the next
    forward hold them; an in-place change of the copy is refused, saying what to do."""
    want = torch.cat([torch.full((64,), 1.0), torch.full((64,), 2.0)])
    for rank, res in enumerate(results()):
        w = res["writes"]
        assert torch.equal(w["full"].reshape(-1), want)
        assert torch.equal(w["part"].float(), torch.full((64,), float(rank + 1)))
        assert torch.allclose(w["fc1_out"], want.view(16, 8).sum(1) + make_model(0).fc1.bias.detach())
        assert w["plain"]
        for key in ("add_", "fill_", "setitem"):
            assert w[key].startswith("DeepSpeedAPIError") and "ds_tensor.data = value" in w[key], (key, w[key])
        assert w["size"].startswith("ValueError") and "64" in w["size"]


def test_inputs_pass_uncast_under_the_alias_and_unused_parameters_raise_assertion_error():
    for res in results():
        got = res["inputs"]
        assert got["alias"] == torch.float32 and got["native"] == torch.bfloat16 and got["auto_cast"] == torch.float16
        message, cause = got["unused"]
        assert "ignore_unused_parameters" in message and "unused.weight" in message
        assert cause == "UnusedParametersError"


def test_the_engines_deepspeed_accessors_read_its_settings_and_steps():
    for res in results():
        got = res["accessors"]
        assert got["batch"] == (2 * 2 * WORLD, 2, 2) and got["sizes"] == (WORLD, 1, None)
        assert got["settings"] == (1.0, 1.0, 10, False, False, False)
        assert got["zero"] == (True, False, True, False, True, 500_000_000, True)
        assert got["reduce_bucket"] > 0 and got["comm_dtype"] == torch.bfloat16
        assert got["missing"].startswith("DeepSpeedAPIError") and "training_dataloader" in got["missing"]
        assert got["applied"] == [False, True]  # off the boundary nothing was applied
        assert got["samples"] == 2 * 2 * WORLD and got["skipped"] == 0
    saved = results()[0]["accessors"]  # rank 0 wrote the file
    assert set(saved["names"]) <= set(saved["saved"]), saved["saved"]  # the weights (and the persistent buffer)
