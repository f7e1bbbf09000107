"""DeepSpeed's runtime tests (``tests/unit/runtime/``: initialize, config dict, multiple models, multi-output models,
``no_sync``; ``tests/unit/checkpoint/``: tag validation, immediate save and load) adapted and run through the
``deepspeed`` alias on 2 gloo ranks, one world for every scenario: what ``initialize`` returns as the optimizer
(the client's own object), ``backward``'s value, engines without an optimizer, several engines under one loss
(``_backward_epilogue``) against a single-process reference, ``no_sync``'s refusals, the checkpoint tag check, a
second ``initialize`` on a model a live engine holds, the flat fp32 group partitions, and ``all_gather_coalesced``.
The single-process checks are tests/unit/test_ds_runtime_api.py."""
from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

import zeropp
from support.ds_reference import ds_batch, ds_loss, make_model
from support.train import error_of
from support.world import run_world

WORLD, HIDDEN = 2, 10


class SimpleModel(nn.Module):
    """DeepSpeed's ``unit/simple_model.py`` model: one linear layer and a cross-entropy loss."""

    def __init__(self, hidden_dim: int = HIDDEN) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.cross_entropy_loss(self.linears[0](x), y)


class MultiOutputModel(nn.Module):
    """DeepSpeed's ``unit/multi_output_model.py``: one loss per (input, target) pair."""

    def __init__(self, hidden_dim: int, weight_value: float) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.linear.weight.data.fill_(weight_value)
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, inputs: list, targets: list) -> tuple:
        return tuple(self.cross_entropy_loss(self.linear(x), y) for x, y in zip(inputs, targets))


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(1, HIDDEN, generator=g).to(dtype), torch.randint(0, HIDDEN, (1,), generator=g)


def adam(stage: int, **extra: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, **extra}


def train(engine: Any, rank: int, steps: int = 2, dtype: torch.dtype = torch.float32) -> list[float]:
    losses = []
    for step in range(steps):
        loss = engine(*batch(rank, step, dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# ---- initialize: the optimizer it returns (TestClientOptimizer, TestBf16ZeRO0UnfusedOptimizer) ------------------
def client_optimizers(rank: int, folder: str) -> dict:
    import deepspeed
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    out: dict = {}
    model = SimpleModel()
    client = torch.optim.Adam(model.parameters())
    engine, opt, *_ = deepspeed.initialize(config={"train_batch_size": WORLD}, model=model,
                                           model_parameters=list(model.parameters()), optimizer=client)
    out["stage0_object"] = (opt is client, engine.optimizer is client, engine.master_optimizer is client)
    out["stage0_trains"] = all(torch.isfinite(torch.tensor(train(engine, rank))))
    engine.destroy()
    engine, opt, *_ = deepspeed.initialize(config={"train_batch_size": WORLD}, model=SimpleModel(),
                                           optimizer=lambda params: torch.optim.AdamW(params=params))
    out["callable"] = type(opt).__name__
    engine.destroy()
    engine, opt, *_ = deepspeed.initialize(config={"train_batch_size": WORLD, "optimizer": {"type": "Adam"}},
                                           model=SimpleModel())
    out["config"] = isinstance(opt, torch.optim.Optimizer) and opt is engine.master_optimizer
    engine.destroy()
    for stage in (1, 2, 3):
        model = SimpleModel()
        client = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, opt, *_ = deepspeed.initialize(config={"train_batch_size": WORLD, "zero_optimization": {
            "stage": stage}}, model=model, optimizer=client)
        out[f"stage{stage}"] = (type(opt).__name__, opt.optimizer is client, client.param_groups[0]["lr"])
        engine.destroy()
    model = SimpleModel(16)
    client = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(config={"train_batch_size": WORLD, "bf16": {"enabled": True},
                                                   "zero_optimization": {"stage": 0}},
                                           model=model, optimizer=client)
    o = engine.optimizer
    out["bf16"] = (isinstance(o, FP16_UnfusedOptimizer), o.low_precision_dtype, o.loss_scale_config.dynamic_loss_scale,
                   o.loss_scale_config.cur_scale, o.optimizer is client)
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    engine.backward(engine(x, torch.tensor([3])))
    grads_after_backward = any(p.grad is not None for p in engine.module.parameters())
    engine.step()
    out["bf16_grads"] = (grads_after_backward, all(p.grad is None for p in engine.module.parameters()))
    engine.destroy()
    return out


# ---- config forms (TestConfigLoad, TestDeprecatedDeepScaleConfig, TestDistInit, TestInitNoOptimizer) ------------
def config_forms(rank: int, folder: str) -> dict:
    import deepspeed
    out: dict = {}
    base = {"train_batch_size": WORLD, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
            "bf16": {"enabled": True}}
    path = os.path.join(folder, "config.json")
    hjson_path = os.path.join(folder, "config.hjson")
    if rank == 0:
        with open(path, "w") as f:
            json.dump(base, f)
        with open(hjson_path, "w") as f:
            f.write("{\n  # Hjson, as hjson.dump writes it: quoteless strings, no commas\n  train_batch_size: 2\n"
                    "  optimizer:\n  {\n    type: Adam\n    params:\n    {\n      lr: 0.00015\n    }\n  }\n"
                    "  bf16:\n  {\n    enabled: true\n  }\n}\n")
    torch.distributed.barrier()
    for name, kwargs in (("dict", {"config": base}), ("json", {"config": path}), ("hjson", {"config": hjson_path}),
                         ("dist_init", {"config": base, "dist_init_required": True})):
        engine, *_ = deepspeed.initialize(model=SimpleModel(), **kwargs)
        out[name] = (engine.config.optimizer.params.lr, engine.bfloat16_enabled(), len(train(engine, rank, 1,
                                                                                             torch.bfloat16)))
        engine.destroy()
    args = argparse.ArgumentParser().parse_args(args=[])
    args.deepscale_config, args.local_rank = path, 0
    engine, *_ = deepspeed.initialize(args=args, model=SimpleModel(), model_parameters=SimpleModel().parameters())
    out["deepscale"] = (args.deepspeed_config == path, args.deepscale_config, len(train(engine, rank, 3,
                                                                                      torch.bfloat16)))
    engine.destroy()
    engine, opt, *_ = deepspeed.initialize(config={"train_batch_size": WORLD}, model=SimpleModel())
    loss = engine(*batch(rank, 0))
    out["no_optimizer"] = (opt, engine.optimizer, error_of(lambda: engine.backward(loss)), error_of(engine.step))
    engine.destroy()
    engine, opt, *_ = deepspeed.initialize(config={"train_batch_size": WORLD, "zero_optimization": {"stage": 3}},
                                           model=SimpleModel())
    out["no_optimizer_3"] = (type(opt).__name__, len(train(engine, rank, 1)))  # DeepSpeed's backward runs there
    engine.destroy()
    bad = {"train_batch_size": WORLD, "checkpoint": {"tag_validation": "foo"}}
    try:
        deepspeed.initialize(config=bad, model=SimpleModel())
    except deepspeed.DeepSpeedConfigError as err:
        out["unknown_tag_validation"] = str(err)
    return out


# ---- multi-output models (TestTwoOutputModel, TestThreeOutputModel) ----------------------------------------------
def multi_output(rank: int, folder: str) -> dict:
    import deepspeed
    out: dict = {}
    for n, gas in ((2, 2), (3, 3)):
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
                  "train_batch_size": gas * WORLD, "steps_per_print": 1, "bf16": {"enabled": True},
                  "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}}
        engine, *_ = deepspeed.initialize(config=config, model=MultiOutputModel(HIDDEN, 0.1))
        seen = []
        for _ in range(gas):
            inputs = [torch.full((1, HIDDEN), float(v + 1), dtype=torch.bfloat16) for v in range(n)]
            targets = [torch.full((1,), v + 1, dtype=torch.long) for v in range(n)]
            losses = engine(inputs, targets)
            summed = sum(losses)
            scaled = engine.backward(summed)
            seen.append(([loss.item() for loss in losses], [tuple(loss.shape) for loss in losses],
                         torch.equal(scaled, summed / gas), scaled.item()))
            engine.step()
        out[n] = seen
        engine.destroy()
    return out


# ---- several engines (TestMultipleModels: independent and shared losses) --------------------------------------------
def multiple_models(rank: int, folder: str) -> dict:
    """Two engines per stage, fp32 SGD, two steps; the shared loss is DeepSpeed's test's: the models' losses summed
    (the i-th divided by i + 1), one direct loss.backward(), then each engine's _backward_epilogue() and step()."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    out: dict = {}
    for stage in (1, 2, 3):
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        for shared in (False, True):
            models = [deepspeed.initialize(model=make_model(i), config=config)[0] for i in range(2)]
            for step in range(2):
                x, y = ds_batch(step, rank)
                if shared:
                    losses = [ds_loss(m.module, x, y) for m in models]
                    sum(loss / (i + 1) for i, loss in enumerate(losses)).backward()
                    for m in models:
                        m._backward_epilogue()
                    for m in models:
                        m.step()
                    for m in models:
                        m.optimizer.zero_grad()
                else:
                    for m in models:
                        m.backward(ds_loss(m, x, y))
                        m.step()
            out[(stage, shared)] = [{n: safe_get_full_fp32_param(p) for n, p in m.module.named_parameters()}
                                    for m in models]
            for m in models:
                m.destroy()
    engine, *_ = deepspeed.initialize(model=make_model(0), config={
        "train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "initial_scale_power": 8},
        "optimizer": {"type": "Adam"}})
    ds_loss(engine.module, *ds_batch(0, rank)).backward()
    out["fp16_direct"] = error_of(engine._backward_epilogue)
    engine.destroy()
    return out


def reference_models(shared: bool) -> list[dict]:
    """One process, both ranks' batches: the weights of ``multiple_models``' two engines after two SGD steps."""
    refs = [make_model(i) for i in range(2)]
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in refs]
    for step in range(2):
        batches = [ds_batch(step, r) for r in range(WORLD)]
        total = sum(sum(ds_loss(m, x, y) / ((i + 1) if shared else 1) for i, m in enumerate(refs))
                    for x, y in batches) / WORLD
        total.backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return [{n: p.detach().clone() for n, p in r.named_parameters()} for r in refs]


# ---- no_sync (TestNoSyncCtxt) ----------------------------------------------------------------------------------------
def no_sync(rank: int, folder: str) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    out: dict = {}
    for stage in (0, 1, 2, 3):
        engine, *_ = deepspeed.initialize(model=SimpleModel(64), config=adam(stage))

        def inside() -> None:
            with engine.no_sync():
                engine.backward(engine(torch.randn(1, 64), torch.tensor([1])))
        out[("ctxt", stage)] = error_of(inside)
        if stage <= 1:
            with engine.no_sync():
                engine.backward(engine(torch.randn(1, 64), torch.tensor([1])))
                out[("step", stage)] = error_of(engine.step)
                out[("reentry", stage)] = error_of(lambda: engine.no_sync().__enter__())
            engine.zero_grad()
            runs = []
            for _ in range(2):
                losses, norms = [], []
                with engine.no_sync():
                    for step in range(3):
                        x = torch.full((1, 64), 0.1 * (step + rank))
                        loss = engine(x, torch.tensor([step]))
                        losses.append(loss.item())
                        engine.backward(loss)
                        norms.append(sum(safe_get_full_grad(p).norm() for p in engine.module.parameters()).item())
                engine.zero_grad()
                runs.append((losses, norms))
            out[("repeat", stage)] = runs
        engine.destroy()
    return out


# ---- checkpoints: tags, empty directories, a second initialize (TestCheckpointValidationTag, ...) -----------------
def checkpoints(rank: int, folder: str) -> dict:
    import deepspeed
    out: dict = {}
    for mode in ("Fail", "Warn", "Ignore"):
        engine, *_ = deepspeed.initialize(model=SimpleModel(), config=adam(1, checkpoint={"tag_validation": mode}))
        save_dir = os.path.join(folder, mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = error_of(lambda: out.__setitem__((mode, "path"), engine.save_checkpoint(save_dir,
                                                                                             tag=f"tag-{rank}")))
        out[(mode, "error")] = result
        out[(mode, "warned")] = [str(w.message) for w in caught if "not consistent across all ranks" in str(w.message)]
        out[(mode, "same")] = engine.checkpoint_tag_validation_enabled(), engine.checkpoint_tag_validation_fail()
        engine.save_checkpoint(save_dir, tag="common")  # equal tags pass in every mode
        out[(mode, "empty")] = [error_of(lambda d=d: engine.save_checkpoint(d)) for d in (None, "")]
        engine.destroy()
    # DeepSpeed's test_load_immediate_save: train, save, a fresh engine on the same model, load, save again
    for stage in (1, 3):
        model = SimpleModel()
        first, *_ = deepspeed.initialize(model=model, config=adam(stage, bf16={"enabled": True}))
        train(first, rank, 1, torch.bfloat16)
        first.empty_partition_cache()
        save_dir = os.path.join(folder, f"immediate{stage}")
        first.save_checkpoint(save_dir)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second, *_ = deepspeed.initialize(model=model, config=adam(stage, bf16={"enabled": True}))
        out[("second", stage, "warned")] = any("held by a live engine" in str(w.message) for w in caught)
        out[("second", stage, "old")] = [error_of(lambda: first(*batch(rank, 0, torch.bfloat16))),
                                         error_of(first.step), error_of(lambda: first.save_checkpoint(save_dir))]
        path, _ = second.load_checkpoint(save_dir, load_optimizer_states=False, load_lr_scheduler_states=False)
        out[("second", stage, "loaded")] = path is not None
        second.save_checkpoint(save_dir)
        out[("second", stage, "trains")] = len(train(second, rank, 1, torch.bfloat16))
        second.destroy()
    return out


# ---- the flat fp32 group partitions, all_gather_coalesced, pipeline loading ---------------------------------------
def partitions(rank: int, folder: str) -> dict:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_local_fp32_param
    out: dict = {}
    for stage in (1, 2):
        model = make_model(0)
        groups = [{"params": [model.fc1.weight, model.fc1.bias]},
                  {"params": [p for n, p in model.named_parameters() if not n.startswith("fc1.")], "lr": 1e-2}]
        engine, opt, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=0.1),
                                               config={"train_micro_batch_size_per_gpu": 2,
                                                       "zero_optimization": {"stage": stage}})
        parts = opt.single_partition_of_fp32_groups
        out[(stage, "shapes")] = [(type(t).__name__, t.dim(), t.numel(), t.dtype) for t in parts]
        out[(stage, "chunks")] = [sum(m.numel() for m in g["params"]) for g in opt.param_groups]
        out[(stage, "values")] = [torch.equal(t, torch.cat([m.reshape(-1) for m in g["params"]]))
                                  for t, g in zip(parts, opt.param_groups)]
        parts[0].mul_(0.0)  # DeepSpeed's idiom: write this rank's fp32 partition in place
        opt.single_partition_of_fp32_groups[1].data = torch.full_like(parts[1], float(rank + 1))
        out[(stage, "written")] = ([safe_get_local_fp32_param(p) for p in (model.fc1.weight, model.fc1.bias)],
                                   safe_get_local_fp32_param(model.fc2.weight))
        out[(stage, "plain")] = type(parts[0] * 2) is torch.Tensor
        engine.destroy()
    with deepspeed.zero.Init(config_dict_or_path=adam(3)):
        model = SimpleModel()
    engine, *_ = deepspeed.initialize(model=model, config=adam(3, zero_optimization={
        "stage": 3, "pipeline_loading_checkpoint": True}))
    params = [p for p in engine.module.parameters() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    want = [safe_get_full_fp32_param(p) for p in params]
    handle = params[0].all_gather_coalesced(params)
    handle.wait()
    out["gathered"] = ([p.ds_status.name for p in params],
                       [torch.equal(p.data.float(), w) for p, w in zip(params, want)])
    params[0].partition(params)
    out["partitioned"] = [p.ds_status.name for p in params]
    engine.save_checkpoint(os.path.join(folder, "pipeline"))
    path, _ = engine.load_checkpoint(os.path.join(folder, "pipeline"))
    out["pipeline_load"] = path is not None
    engine.destroy()
    engine, *_ = deepspeed.initialize(model=SimpleModel(), config=adam(1, zero_optimization={
        "stage": 1, "pipeline_loading_checkpoint": True}))
    out["pipeline_below_3"] = error_of(lambda: engine.load_checkpoint(os.path.join(folder, "pipeline")))
    engine.destroy()
    return out


SCENARIOS: dict[str, Callable[[int, str], dict]] = {  # each (rank, a folder of its own) -> results
    "client_optimizers": client_optimizers, "config_forms": config_forms, "multi_output": multi_output,
    "multiple_models": multiple_models, "no_sync": no_sync, "checkpoints": checkpoints, "partitions": partitions}


def scenario(rank: int, world: int, folder: str) -> dict:
    zeropp.install_deepspeed_alias()
    out = {}
    for name, fn in SCENARIOS.items():
        sub = os.path.join(folder, name)
        os.makedirs(sub, exist_ok=True)
        out[name] = fn(rank, sub)
    return out


@functools.lru_cache(maxsize=None)
def results() -> list:
    with tempfile.TemporaryDirectory(prefix="zeropp-ds-runtime-") as folder:
        return run_world(scenario, WORLD, folder)


def test_initialize_returns_the_clients_optimizer_object_as_deepspeed():
    for res in results():
        got = res["client_optimizers"]
        assert got["stage0_object"] == (True, True, True) and got["stage0_trains"]
        assert got["callable"] == "AdamW" and got["config"]
        assert got["stage1"] == ("DeepSpeedZeroOptimizer", True, 1e-2)
        assert got["stage2"] == ("DeepSpeedZeroOptimizer", True, 1e-2)
        assert got["stage3"] == ("DeepSpeedZeroOptimizer_Stage3", True, 1e-2)
        assert got["bf16"] == (True, torch.bfloat16, False, 1.0, True)
        assert got["bf16_grads"] == (True, True)  # gradients after backward, dropped by the step


def test_config_dict_file_hjson_and_deprecated_args_train():
    for res in results():
        got = res["config_forms"]
        for name in ("dict", "json", "hjson", "dist_init"):
            assert got[name] == (0.00015, True, 1), name
        assert got["deepscale"] == (True, None, 3)  # read as deepspeed_config, which the args now hold


def test_an_engine_without_optimizer_refuses_backward_and_step_as_deepspeed():
    for res in results():
        got = res["config_forms"]
        opt, engine_opt, backward, step = got["no_optimizer"]
        assert opt is None and engine_opt is None
        assert backward == "AssertionError: must provide optimizer during init in order to use backward"
        assert step == "AssertionError: must provide optimizer during init in order to use step"
        assert got["no_optimizer_3"] == ("DeepSpeedZeroOptimizer_Stage3", 1)  # zeropp's default AdamW steps
        assert "checkpoint.tag_validation" in got["unknown_tag_validation"]


def test_multi_output_models_backward_returns_the_scaled_loss():
    expected = torch.tensor(2.302734375, dtype=torch.bfloat16).item()  # DeepSpeed's expected loss, ln(10), in bf16
    for res in results():
        for n, gas in ((2, 2), (3, 3)):
            for losses, shapes, equal, scaled in res["multi_output"][n]:
                assert losses == [pytest.approx(expected)] * n
                assert shapes == [()] * n and equal  # backward's value is the summed loss / accumulation steps
                assert scaled == pytest.approx(n * expected / gas, rel=1e-2)


@pytest.mark.parametrize("shared", [False, True])
def test_several_engines_train_as_one_process_would(shared):
    want = reference_models(shared)
    for rank, res in enumerate(results()):
        for stage in (1, 2, 3):
            for i, got in enumerate(res["multiple_models"][(stage, shared)]):
                for name, value in want[i].items():
                    torch.testing.assert_close(got[name].float(), value, rtol=1e-5, atol=1e-6,
                                               msg=f"rank {rank} stage {stage} model {i} {name}")


def test_a_direct_backward_under_fp16_loss_scaling_is_refused():
    for res in results():
        assert res["multiple_models"]["fp16_direct"].startswith("RuntimeError: Loss scaling is required")


def test_no_sync_refuses_as_deepspeed():
    for res in results():
        got = res["no_sync"]
        assert got[("ctxt", 0)] == "no error" and got[("ctxt", 1)] == "no error"
        for stage in (2, 3):
            assert got[("ctxt", stage)] == ("AssertionError: no_sync context manager is incompatible with gradient "
                                            f"partitioning logic of ZeRO stage {stage}")
        for stage in (0, 1):
            assert got[("step", stage)] == \
                "AssertionError: It is illegal to call Engine.step() inside no_sync context manager"
            assert got[("reentry", stage)] == "AssertionError: no_sync context manager reentry is unsupported"
            first, second = got[("repeat", stage)]
            assert first == second  # test_multiple_ctxts: the same losses and gradient norms each time
            assert first[1][0] < first[1][1] < first[1][2]  # inside, gradients accumulate


def test_checkpoint_tag_validation_and_empty_directories():
    ranks = results()
    for rank, res in enumerate(ranks):
        got = res["checkpoints"]
        assert got[("Fail", "error")].startswith("AssertionError: [rank=") and "tag-" in got[("Fail", "error")]
        for mode in ("Warn", "Ignore"):
            assert got[(mode, "error")] == "no error" and got[(mode, "path")].endswith("tag-0")  # rank 0's tag
            assert got[(mode, "warned")] and "rank 0's tag 'tag-0'" in got[(mode, "warned")][0]
        assert got[("Fail", "same")] == (True, True) and got[("Ignore", "same")] == (False, False)
        for mode in ("Fail", "Warn", "Ignore"):
            assert got[(mode, "empty")] == ["ValueError: save_dir must be a non-empty string, got None",
                                            "ValueError: save_dir must be a non-empty string, got ''"]


def test_a_second_initialize_on_a_held_model_takes_it_from_the_first_engine():
    for res in results():
        got = res["checkpoints"]
        for stage in (1, 3):
            assert got[("second", stage, "warned")] and got[("second", stage, "loaded")]
            assert got[("second", stage, "trains")] == 1
            for error in got[("second", stage, "old")]:
                assert error.startswith("EngineGivenBackError: engine.") and "gave its model back" in error


def test_single_partition_of_fp32_groups_are_flat_views_whose_writes_reach_the_masters():
    for rank, res in enumerate(results()):
        got = res["partitions"]
        for stage in (1, 2):
            assert got[(stage, "shapes")] == [("GroupPartition", 1, n, torch.float32) for n in got[(stage, "chunks")]]
            assert got[(stage, "values")] == [True, True] and got[(stage, "plain")]
            (fc1_w, fc1_b), fc2_w = got[(stage, "written")]
            assert not fc1_w.any() and not fc1_b.any()
            assert torch.equal(fc2_w, torch.full_like(fc2_w, float(rank + 1)))


def test_all_gather_coalesced_holds_the_full_values_until_partition_and_pipeline_loading():
    for res in results():
        got = res["partitions"]
        statuses, values = got["gathered"]
        assert statuses == ["AVAILABLE"] * len(statuses) and all(values) and values
        assert got["partitioned"] == ["NOT_AVAILABLE"] * len(statuses)
        assert got["pipeline_load"]
        assert got["pipeline_below_3"] == "AssertionError: Only stage3 support for pipeline checkpoint loading"
