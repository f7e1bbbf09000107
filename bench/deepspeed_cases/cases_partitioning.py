"""Cases from DeepSpeed's tests/unit/v1/zero/test_zero.py that look inside ZeRO's partitioning
(TestPartitionNcclAlignment, TestZero3ParamPartitioningBase, ...LargeParam, ...ManyParams), adapted to
CPU/gloo/bf16/torch Adam. fp16 rows are left out: the originals skip them where fp16 is unsupported (CPU)."""
import math
from collections import namedtuple
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import L1Loss, Module, ModuleList, Parameter

from common import CASES, SimpleModel, adam, bf16, case, ds, param_cases  # noqa: F401 (the worker reads CASES)


# ---- TestPartitionNcclAlignment -------------------------------------------------------------------------------
@case("TestPartitionNcclAlignment::test", 2)
def partition_nccl_alignment(zero_stage=2):
    deepspeed = ds()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1,
           "zero_optimization": {"stage": zero_stage}, "optimizer": adam(1e-3), "bf16": bf16()}
    model = SimpleModel(4)
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    align = engine.optimizer.nccl_start_alignment_factor
    groups = engine.optimizer.parallel_partitioned_bit16_groups
    assert len(groups) > 0
    for partitions in groups:
        assert len(partitions) == dist.get_world_size()
        for part in partitions:
            assert part.data_ptr() % (2 * align) == 0, "a partition starts off the all-gather alignment"


# ---- the partitioning cases' networks -------------------------------------------------------------------------
def _status():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return ZeroParamStatus


def _assert_partition_status(model, valid):
    for name, param in model.named_parameters():
        assert param.ds_status in valid, f"{name}: {param.ds_status} not in {valid}"


def _assert_fully_available(model):
    for _, param in model.named_parameters():
        assert param.ds_status == _status().AVAILABLE


class EltwiseMultiplicationModule(Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        _assert_fully_available(self)
        return self.weight * x


class EltwiseMultiplicationTestNetwork_Dict(Module):
    def __init__(self, weight1, weight2, weight3):
        super().__init__()
        self.__layer1 = EltwiseMultiplicationModule(weight1)
        self.__layer2 = EltwiseMultiplicationModule(weight2)
        self.__layer3 = EltwiseMultiplicationModule(weight3)
        self.loss = L1Loss(reduction="none")

    def forward(self, x, y, use_module_trace, param_prefetching):
        S = _status()
        anywhere = {S.NOT_AVAILABLE, S.INFLIGHT, S.AVAILABLE} if use_module_trace else {S.NOT_AVAILABLE}
        pre = {S.INFLIGHT if param_prefetching else S.NOT_AVAILABLE, S.AVAILABLE}
        post = {S.AVAILABLE if param_prefetching else S.NOT_AVAILABLE}
        _assert_partition_status(self, anywhere)
        _assert_partition_status(self.__layer1, pre)
        hidden1 = self.__layer1(x)
        _assert_partition_status(self.__layer1, post)
        _assert_partition_status(self.__layer2, pre)
        hidden2 = self.__layer2(hidden1)
        _assert_partition_status(self.__layer2, post)
        _assert_partition_status(self.__layer3, pre)
        y_hat = self.__layer3(hidden2)
        _assert_partition_status(self.__layer3, post)
        loss = self.loss(y_hat, y)
        _assert_partition_status(self, anywhere)
        return {"hidden1": hidden1, "hidden2": hidden2, "y_hat": y_hat, "loss": loss}

    @staticmethod
    def to_dict(outputs):
        return outputs


class EltwiseMultiplicationNamedTuple(NamedTuple):
    hidden1: Tensor
    hidden2: Tensor
    y_hat: Tensor
    loss: Tensor


_Plain = namedtuple("EltwiseMultiplication_namedtuple", ["hidden1", "hidden2", "y_hat", "loss"])
_KEYS = ("hidden1", "hidden2", "y_hat", "loss")


class EltwiseMultiplicationTestNetwork_NamedTuple(EltwiseMultiplicationTestNetwork_Dict):
    def forward(self, *args, **kwargs):
        return EltwiseMultiplicationNamedTuple(**super().forward(*args, **kwargs))

    @staticmethod
    def to_dict(outputs):
        return outputs._asdict()


class EltwiseMultiplicationTestNetwork_namedtuple(EltwiseMultiplicationTestNetwork_Dict):
    def forward(self, *args, **kwargs):
        return _Plain(**super().forward(*args, **kwargs))

    @staticmethod
    def to_dict(outputs):
        return outputs._asdict()


class EltwiseMultiplicationTestNetwork_Tuple(EltwiseMultiplicationTestNetwork_Dict):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        return tuple(out[k] for k in _KEYS)

    @staticmethod
    def to_dict(outputs):
        return dict(zip(_KEYS, outputs))


class EltwiseMultiplicationTestNetwork_List(EltwiseMultiplicationTestNetwork_Dict):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        return [out[k] for k in _KEYS]

    @staticmethod
    def to_dict(outputs):
        return dict(zip(_KEYS, outputs))


# ---- TestZero3ParamPartitioningBase ---------------------------------------------------------------------------
def _partitioning_base(param_persistence_threshold=0, contiguous_gradients=False, offload_optimizer=False,
                       zero_grad=False, prefetching=False, reduce_scatter=False,
                       model_class=EltwiseMultiplicationTestNetwork_Dict):
    if offload_optimizer and not contiguous_gradients:
        return  # as the original
    deepspeed = ds()
    m, n = 3, 5
    weights = [Parameter(torch.zeros((m, n), dtype=torch.float32)) for _ in range(3)]
    model = model_class(*weights)
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0,
                                 "stage3_param_persistence_threshold": param_persistence_threshold,
                                 "contiguous_gradients": contiguous_gradients,
                                 "stage3_prefetch_bucket_size": sum(p.numel() for p in model.parameters())
                                 if prefetching else 0,
                                 "reduce_scatter": reduce_scatter},
           "optimizer": adam(1.0), "bf16": bf16()}
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    for i, weight in enumerate(weights):
        weight.ds_tensor.data = torch.full_like(weight.ds_tensor.data, (i + 1) * (1 + dist.get_rank()))

    def t(vals, dtype=torch.float32):
        return torch.as_tensor(vals, dtype=dtype, device=engine.device)

    expected = {"hidden1": t([[1] * 5, [1, 1, 1, 2, 2], [2] * 5]), "hidden2": t([[2] * 5, [2, 2, 2, 8, 8], [8] * 5]),
                "y_hat": t([[6] * 5, [6, 6, 6, 48, 48], [48] * 5]), "loss": t([[5] * 5, [5, 5, 5, 47, 47], [47] * 5])}
    S = _status()
    for it in range(3):
        out = engine(x=torch.ones((m, n)), y=torch.ones((m, n)), use_module_trace=it > 0,
                     param_prefetching=prefetching and it > 0)
        out = model_class.to_dict(out)
        for k, v in expected.items():
            assert torch.allclose(out[k], v), f"{k} at iteration {it}: {out[k]}"
        engine.backward(out["loss"].sum())
        parts = engine.optimizer.get_fp32_grad_partitions()
        assert set(parts.keys()) == {0}, f"should have one parameter group, got {len(parts)}"
        assert set(parts[0].keys()) == {0, 1, 2}
        mult = 1 if zero_grad else it + 1
        if dist.get_rank() == 0:
            want = ([2] * 8, [3] * 8, [6] * 8)
        else:  # the parameters do not split evenly: rank 1's partition is zero-padded
            want = ([8] * 7 + [0], [12] * 7 + [0], [24] * 7 + [0])
        for layer, w in zip((2, 1, 0), want):
            g = parts[0][layer]
            assert g.dtype == torch.float
            assert torch.allclose(g, mult * t(w)), f"layer {layer + 1} gradient at iteration {it}: {g}"
        if zero_grad:
            engine.optimizer.zero_grad()
    engine.optimizer.step()
    _assert_partition_status(engine, {S.NOT_AVAILABLE})
    assert not math.isclose(engine.optimizer._global_grad_norm, 0.0)
    engine.destroy()


_BASE = ([dict(param_persistence_threshold=v) for v in (0, 10)] + [dict(fp16_enabled=False)]
         + [dict(contiguous_gradients=v) for v in (True, False)] + [dict(offload_optimizer=v) for v in (True, False)]
         + [dict(zero_grad=v) for v in (True, False)] + [dict(prefetching=v) for v in (True, False)]
         + [dict(reduce_scatter=v) for v in (True, False)]
         + [dict(model_class=c) for c in (EltwiseMultiplicationTestNetwork_Dict,
                                          EltwiseMultiplicationTestNetwork_NamedTuple,
                                          EltwiseMultiplicationTestNetwork_namedtuple,
                                          EltwiseMultiplicationTestNetwork_Tuple,
                                          EltwiseMultiplicationTestNetwork_List)])


@param_cases("TestZero3ParamPartitioningBase", 2, _BASE)
def partitioning_base(fp16_enabled=False, **kw):
    _partitioning_base(**kw)  # fp16_enabled=False: bf16, as the original where bf16 is supported


# ---- TestZero3ParamPartitioningLargeParam ---------------------------------------------------------------------
@param_cases("TestZero3ParamPartitioningLargeParam", 2,
             [dict(init_context_manager=i, reduce_scatter=r) for i in (True, False) for r in (True, False)])
def partitioning_large_param(init_context_manager, reduce_scatter, param_sz=8100):
    deepspeed = ds()

    class LargeParamModel(Module):
        def __init__(self):
            super().__init__()
            self.param = Parameter(torch.zeros((param_sz,), dtype=torch.float32))
            if dist.get_rank() == 0:  # only rank 0 initializes: the value must come from it
                size = math.ceil(self.param.numel() / dist.get_world_size())
                for r in range(dist.get_world_size()):
                    with torch.no_grad():
                        self.param[r * size:(r + 1) * size].fill_(r)

        def forward(self, x):
            return x * self.param

    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "contiguous_gradients": True,
                                 "overlap_comm": True, "reduce_scatter": reduce_scatter},
           "optimizer": adam(1.0), "bf16": bf16()}
    with deepspeed.zero.Init(mem_efficient_linear=False, enabled=init_context_manager, config_dict_or_path=cfg):
        model = LargeParamModel()
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    size = math.ceil(param_sz / dist.get_world_size())
    for it in range(3):
        act = engine(torch.ones(param_sz, dtype=torch.float16, device=engine.device))
        for r, start in enumerate(range(0, param_sz, size)):
            piece = act[start:start + size]
            assert torch.allclose(piece, torch.full_like(piece, r)), f"partition {r} at iteration {it}"
        engine.backward(act.sum())
        engine.allreduce_gradients()
        avg = engine.optimizer.averaged_gradients
        assert set(avg.keys()) == {0}, "should only have one parameter group"
        (grad,) = avg[0]
        assert torch.allclose(grad, (it + 1) * torch.full_like(grad, 1)), f"gradient at iteration {it}"
    engine.destroy()


# ---- TestZero3ParamPartitioningManyParams ---------------------------------------------------------------------
@param_cases("TestZero3ParamPartitioningManyParams", 2, [dict(init_context_manager=i) for i in (True, False)])
def partitioning_many_params(init_context_manager, param_sz=100, n_layers=100):
    deepspeed = ds()

    class ManyParamModel(Module):
        def __init__(self):
            super().__init__()
            self.modulelist = ModuleList(EltwiseMultiplicationModule(Parameter(torch.empty((param_sz,))))
                                         for _ in range(n_layers))
            for layer, module in enumerate(self.modulelist):
                with deepspeed.zero.GatheredParameters(module.weight, modifier_rank=0):
                    size = math.ceil(module.weight.numel() / dist.get_world_size())
                    for r in range(dist.get_world_size()):
                        with torch.no_grad():
                            module.weight[r * size:(r + 1) * size].fill_(2 * layer * r)

        def forward(self, x):
            acts = []
            for module in self.modulelist:
                x = module(x)
                acts.append(x)
            return acts

    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "contiguous_gradients": True,
                                 "overlap_comm": True},
           "optimizer": adam(1.0), "bf16": bf16()}
    with deepspeed.zero.Init(config_dict_or_path=cfg, mem_efficient_linear=False, enabled=init_context_manager):
        model = ManyParamModel()
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    dtype = torch.bfloat16
    for _ in range(3):
        acts = engine(torch.ones((param_sz,), dtype=dtype, device=engine.device))
        assert len(acts) == n_layers
        size = math.ceil(param_sz / dist.get_world_size())
        want = torch.empty(param_sz, dtype=dtype, device=engine.device)
        for start in range(0, param_sz, size):
            want[start:start + size] = dist.get_rank()
        for layer, act in enumerate(acts):
            want *= 2 * layer
            assert torch.allclose(act, want), f"activation of layer {layer}"
        engine.backward(acts[-1].sum())
        avg = engine.optimizer.averaged_gradients
        assert set(avg.keys()) == {0}, "should only have one parameter group"
    engine.destroy()
