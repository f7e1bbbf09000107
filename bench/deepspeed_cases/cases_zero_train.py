"""More cases from DeepSpeed's tests/unit/v1/zero/test_zero.py (training through the engine, the optimizer's
attributes, construction), adapted to CPU/gloo/bf16/torch Adam as the others are: TestZeroOffloadStage1,
TestZero3DictFwd, TestZeroAdamOptimizerStepCount, TestZeroFrozenWeights, TestZeroOffloadOptim,
TestZeroPartitionCache, TestEmptyParameterGroup (bf16 and fp32: the original skips fp16 where the accelerator
lacks it, as the CPU one does), TestZero3SwitchModes and TestZero3ClientModuleID."""
import torch
import torch.distributed as dist
from torch import nn

from common import (CASES, SimpleModel, adam, bf16, case, destroy, ds, engine_dtype, expect_raises, param_cases,
                    random_batches)


def _batches(engine, total, hidden):
    return random_batches(None, total, hidden, engine.train_micro_batch_size_per_gpu(), dtype=engine_dtype(engine))


# ---- TestZeroOffloadStage1 ------------------------------------------------------------------------------------
@case("TestZeroOffloadStage1::test", 2)
def offload_stage1():
    deepspeed = ds()
    cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1, "optimizer": adam(1e-4),
           "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}, "bf16": bf16(),
           "zero_force_ds_cpu_optimizer": False}  # torch's Adam instead of DeepSpeedCPUAdam (a C++ build)
    model = SimpleModel(10)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dist.barrier()
    for x, y in _batches(engine, 50, 10):
        engine.backward(engine(x, y))
        engine.step()
    destroy(engine)


# ---- TestZero3DictFwd -------------------------------------------------------------------------------------------
@param_cases("TestZero3DictFwd", 1, [dict(return_type=t) for t in (tuple, list, dict)])
def dict_fwd(return_type):
    deepspeed = ds()
    cfg = {"train_batch_size": 4, "steps_per_print": 1, "optimizer": adam(1e-4), "zero_optimization": {"stage": 3},
           "bf16": bf16()}

    class MyModel(nn.Module):
        def __init__(self, hidden_dim):
            super().__init__()
            self.l1 = nn.Linear(hidden_dim, hidden_dim)
            self.cel = nn.CrossEntropyLoss()

        def forward(self, x, y):
            x = self.l1(x)
            loss = self.cel(x, y)
            if return_type == dict:
                return {"a": x, "loss": loss, "b": 1, "c": None}
            return [x, loss] if return_type == list else (x, loss)

    with deepspeed.zero.Init(config=cfg):
        model = MyModel(10)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dist.barrier()
    for x, y in _batches(engine, 50, 10):
        out = engine(x, y)
        engine.backward(out["loss"] if return_type == dict else out[1])
        engine.step()
    destroy(engine)


# ---- TestZeroAdamOptimizerStepCount -------------------------------------------------------------------------------
@param_cases("TestZeroAdamOptimizerStepCount", 1, [dict(zero_stage=s) for s in (1, 2, 3)])
def adam_step_count(zero_stage):
    deepspeed = ds()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1,
           "zero_optimization": {"stage": zero_stage, "stage3_param_persistence_threshold": 0, "sub_group_size": 4},
           "optimizer": adam(1e-3), "bf16": bf16()}
    model = SimpleModel(hidden_dim=4, nlayers=12)
    engine, optimizer, _, _ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    assert engine.global_steps == 0
    for x, y in _batches(engine, 16, 4):
        engine.backward(engine(x, y))
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            counts = []
            if zero_stage == 3:
                for sub_group_id, _ in enumerate(optimizer.fp16_groups):
                    fp32_param = optimizer.fp32_partitioned_groups_flat[sub_group_id]
                    counts.append(optimizer.optimizer.state[fp32_param]["step"])
            else:
                for group in optimizer.optimizer.param_groups:
                    for param in group["params"]:
                        counts.append(optimizer.optimizer.state[param]["step"])
            assert all(step == counts[0] for step in counts)
            assert engine.global_steps == counts[0]
    destroy(engine)


# ---- TestZeroFrozenWeights ----------------------------------------------------------------------------------------
@param_cases("TestZeroFrozenWeights", 2, [dict(zero_stage=s) for s in (1, 2, 3)])
def frozen_weights(zero_stage):
    deepspeed = ds()
    cfg = {"train_batch_size": 4, "steps_per_print": 1, "optimizer": adam(1e-4),
           "zero_optimization": {"stage": zero_stage}, "bf16": bf16()}

    class MyModel(nn.Module):
        def __init__(self, hidden_dim):
            super().__init__()
            self.l1 = nn.Linear(hidden_dim, hidden_dim)
            self.l2 = nn.Linear(hidden_dim, hidden_dim)
            self.act = nn.ReLU()
            self.cel = nn.CrossEntropyLoss()
            self.l2.weight.requires_grad = False  # freeze one fc
            self.l2.bias.requires_grad = False

        def forward(self, x, y):
            x = self.l2(self.act(self.l1(x)))
            return x, self.cel(x, y)

    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=zero_stage == 3):
        model = MyModel(10)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dist.barrier()
    for x, y in _batches(engine, 50, 10):
        engine.backward(engine(x, y)[1])
        engine.step()
    destroy(engine)


# ---- TestZeroOffloadOptim ---------------------------------------------------------------------------------------
@param_cases("TestZeroOffloadOptim", 1, [dict(force_ds_optim=f) for f in (True, False)])
def offload_optim(force_ds_optim):
    deepspeed = ds()
    cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1,
           "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
           "zero_force_ds_cpu_optimizer": force_ds_optim, "bf16": bf16()}
    model = SimpleModel(10)
    optimizer = torch.optim.Adam(model.parameters())
    if force_ds_optim:
        from deepspeed.runtime.zero.utils import ZeRORuntimeException
        expect_raises(ZeRORuntimeException, deepspeed.initialize, model=model, optimizer=optimizer, config=cfg)
    else:
        deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)


# ---- TestZeroPartitionCache --------------------------------------------------------------------------------------
@param_cases("TestZeroPartitionCache::test_training_partition_cache", 1, [dict(training=t) for t in (True, False)])
def partition_cache(training):
    deepspeed = ds()
    hidden = 10
    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": hidden},
           "bf16": bf16()}
    if training:
        cfg["optimizer"] = adam()
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = SimpleModel(hidden, empty_grad=False)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    for x, y in _batches(engine, 6, hidden):
        loss = engine(x, y)
        if training:
            engine.backward(loss)
            engine.step()
    persist = sum(p.numel() for p in engine.parameters() if p.ds_persist)
    assert persist >= sum(p.numel() for p in engine.parameters())
    engine.empty_partition_cache()
    assert sum(p.numel() for p in engine.parameters()) == 0
    destroy(engine)


# ---- TestEmptyParameterGroup -------------------------------------------------------------------------------------
@param_cases("TestEmptyParameterGroup::test_empty_param_groups", 1,
             [dict(dtype=d, use_client_optimizer=c, empty_weight_group=e) for d in (torch.bfloat16, torch.float32)
              for c in (True, False) for e in (True, False)])
def empty_param_groups(dtype, use_client_optimizer, empty_weight_group):
    deepspeed = ds()
    model = SimpleModel(hidden_dim=4, nlayers=4)
    groups = [{"params": [] if empty_weight_group else [l.weight for l in model.linears], "weight_decay": 0.01},
              {"params": [l.bias for l in model.linears] if empty_weight_group else [], "weight_decay": 0.0}]
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "fp16": {"enabled": False}, "bf16": {"enabled": dtype == torch.bfloat16}}
    if use_client_optimizer:
        optimizer, params = torch.optim.AdamW(groups, lr=0.1), model.parameters()
    else:
        cfg["optimizer"] = {"type": "adamw", "params": {"torch_adam": True}}
        optimizer, params = None, groups
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=cfg)
    destroy(engine)


# ---- TestZero3SwitchModes ---------------------------------------------------------------------------------------
@param_cases("TestZero3SwitchModes::test", 2, [dict(prefetch_ratio=r) for r in (0.0, 0.5, 1.0)])
def switch_modes(prefetch_ratio):
    deepspeed = ds()
    hidden = 10
    model = SimpleModel(hidden)
    prefetch = int(sum(p.numel() for p in model.parameters(recurse=True)) * prefetch_ratio)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": prefetch}, "optimizer": adam(1e-3),
           "bf16": bf16()}
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    batches = _batches(engine, 16, hidden)
    for _ in range(3):
        engine.train()
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
        engine.eval()
        with torch.no_grad():
            for x, y in batches:
                engine(x, y)
    destroy(engine)


# ---- TestZero3ClientModuleID -------------------------------------------------------------------------------------
@case("TestZero3ClientModuleID::test_client_module_id", 2)
def client_module_id():
    deepspeed = ds()
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1, "optimizer": adam(),
           "zero_optimization": {"stage": 3}}

    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.id = 3  # an arbitrary client attribute, e.g. GPU placement
            self.fc = nn.Linear(128, 128)

        def forward(self, x):
            return self.fc(x)

    model = MyModel()
    before = model.id
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert before == engine.id
    destroy(engine)


# ---- TestZero3InitForParentWeightInitialization ------------------------------------------------------------------
@case("TestZero3InitForParentWeightInitialization::test", 2)
def parent_weight_init():
    import math
    deepspeed = ds()
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "contiguous_gradients": True,
                                 "overlap_comm": True},
           "optimizer": adam(1.0), "bf16": bf16()}

    class ModelWhereParentInitializesChildWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(12, 1)
            self.apply(self.__init_weights)

        def __init_weights(self, module):
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.fill_(1 + dist.get_rank())

    with deepspeed.zero.Init(config_dict_or_path=cfg, mem_efficient_linear=False, enabled=True):
        model = ModelWhereParentInitializesChildWeights()
    assert model.linear.weight.ds_tensor.numel() == math.ceil(12 / dist.get_world_size())
    assert torch.allclose(model.linear.weight.ds_tensor, torch.full_like(model.linear.weight.ds_tensor, 1))


# ---- TestParamPartitioningSkipInit (its fp16 parametrization adapts to the same bf16 case) ------------------------
@case("TestParamPartitioningSkipInit[dtype=bfloat16]", 2)
def skip_init_partitioning():
    import math
    from torch.nn.utils import skip_init
    deepspeed = ds()
    cfg = {"train_batch_size": 4, "steps_per_print": 1, "optimizer": adam(1e-4), "zero_optimization": {"stage": 3},
           "bf16": bf16()}
    hidden_dim = 10

    class SubModel(nn.Module):
        def __init__(self, input_size, output_size, dropout_prob=0.5, device=None):
            super().__init__()
            self.linear = nn.Linear(input_size, output_size, device=device)
            self.dropout = nn.Dropout(dropout_prob)
            self.module_list = nn.ModuleList([nn.Linear(input_size, output_size, device=device)])

        def forward(self, x):
            return self.module_list[0](self.dropout(self.linear(x)))

    class MyModel(nn.Module):
        def __init__(self, hidden_dim):
            super().__init__()
            self.l1 = skip_init(nn.Linear, hidden_dim, hidden_dim)
            self.l2 = skip_init(SubModel, hidden_dim, hidden_dim)
            self.l3 = nn.Linear(hidden_dim, hidden_dim)
            self.cel = nn.CrossEntropyLoss()
            self.l4 = skip_init(SubModel, hidden_dim, hidden_dim)

        def forward(self, x, y):
            x = self.l4(self.l3(self.l2(self.l1(x))))
            return [x, self.cel(x, y)]

    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = MyModel(hidden_dim)
    numel = math.ceil(hidden_dim * hidden_dim / dist.get_world_size())
    for p in (model.l1.weight, model.l2.linear.weight, model.l2.module_list[0].weight, model.l3.weight,
              model.l4.linear.weight, model.l4.module_list[0].weight):
        assert p.ds_tensor.numel() == numel
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dist.barrier()
    for x, y in _batches(engine, 16, hidden_dim):
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
    destroy(engine)
