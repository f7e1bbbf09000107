"""Cases from DeepSpeed's tests/unit/runtime/zero/test_zero_context.py."""
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from common import CASES, SimpleModel, adam, bf16, case, destroy, ds

_CFG = {"train_batch_size": 1, "steps_per_print": 1, "optimizer": adam(0.00015), "bf16": bf16(),
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}


class ConvX(nn.Conv1d):
    def __init__(self, *a):
        super().__init__(*a)
        self.param_in = nn.Parameter(torch.FloatTensor(5).uniform_())

    def forward(self, x):
        return x


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = ConvX(1, 3, 4)
        self.param = nn.Parameter(torch.FloatTensor(5).uniform_())

    def forward(self, x):
        return x


class _L1(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.l1 = nn.Linear(h, h)


@case("TestZeroGatheredParametersFree::test", 1)
def gathered_free():
    deepspeed = ds()
    with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
        model = _L1(10)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        assert model.l1.weight.numel() != 0, "GatheredParameters should give a non-0-sized tensor"
    assert model.l1.weight.numel() == 0, "outside of GatheredParameters the param should go back to be 0-sized"


@case("TestMiCSGatheredParametersFree::test", 1)
def mics_gathered_free():
    deepspeed = ds()
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 1}}
    with deepspeed.zero.MiCS_Init(config_dict_or_path=cfg):
        model = _L1(10)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        assert model.l1.weight.numel() != 0, "GatheredParameters should give a non-0-sized tensor"
    assert model.l1.weight.numel() == 0, "outside of GatheredParameters the param should go back to be 0-sized"


@case("TestGatheredParametersAllRanksErrorOnModification::test", 2)
def gathered_modification_error():
    deepspeed = ds()
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "enable_sanity_checks": True}}

    class M(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.l1 = nn.Linear(h, h)
            self.l2 = nn.Linear(h, h)

    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = M(10)
    local = False
    try:
        with deepspeed.zero.GatheredParameters([model.l1.weight, model.l2.weight], modifier_rank=None):
            with torch.no_grad():
                model.l1.weight.add_(0.0)
    except RuntimeError as exc:  # the original catches RuntimeError naming "in-place modification"
        if "in-place modification" in str(exc):
            local = True
    flag = torch.tensor(1 if local else 0)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    assert flag.item() == 1, "Expected in-place modification error on all ranks."


@case("TestSerialContext::test_subclass_param", 1)
def serial_subclass_param():
    deepspeed = ds()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    with deepspeed.zero.Init(config=_CFG):
        model = ConvNet()
    assert model.param.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert model.conv1.param_in.ds_status == ZeroParamStatus.NOT_AVAILABLE


def scattered_init_dist():
    deepspeed = ds()
    assert not dist.is_initialized()
    with deepspeed.zero.Init():
        assert dist.is_initialized()


scattered_init_dist.no_init = True
CASES.append(("TestSerialContext::test_scattered_init_dist", 1, scattered_init_dist, {}))


@case("TestSerialContext::test_throughput_calculation", 1)
def throughput_calculation():
    deepspeed = ds()
    mb, gas = 7, 6
    cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas, "optimizer": adam(0.001),
           "zero_optimization": {"stage": 0}}
    net = SimpleModel(4)
    engine, *_ = deepspeed.initialize(args=SimpleNamespace(local_rank=0), config=cfg, model=net,
                                      model_parameters=net.parameters())
    t = engine.tput_timer
    assert t.batch_size == mb * gas
    assert not t.initialized and not t.started
    assert t.start_step == 2 and t.start_time == 0
    assert t.micro_step_count == 0 and t.global_step_count == 0 and t.total_elapsed_time == 0
    t.stop()
    assert not t.initialized and not t.started
    assert t.start_time == 0 and t.micro_step_count == 0 and t.global_step_count == 0 and t.total_elapsed_time == 0
    t.start()
    assert t.initialized and t.started
    assert t.start_time == 0 and t.micro_step_count == 0 and t.global_step_count == 0 and t.total_elapsed_time == 0
    t.stop()
    assert t.initialized and not t.started
    assert t.start_time == 0 and t.micro_step_count == 1 and t.global_step_count == 0 and t.total_elapsed_time == 0
    while t.micro_step_count < gas * t.start_step:
        t.start()
        t.stop(global_step=(t.micro_step_count + 1) % gas == 0)
    assert t.global_step_count == t.start_step
    assert t.total_elapsed_time == 0
    while t.global_step_count == t.start_step:
        t.start()
        cur, tot = t.step_elapsed_time, t.total_elapsed_time
        t.stop(global_step=(t.micro_step_count + 1) % gas == 0)
        dur = t.end_time - t.start_time
        assert t.step_elapsed_time == (0 if t.global_step_count != t.start_step else cur + dur)
        assert t.total_elapsed_time == tot + dur


@case("TestSerialContext::test_ext_param_getattr", 1)
def ext_param_getattr():
    deepspeed = ds()

    class ExtLinear(nn.Module):
        def __init__(self, dim=16):
            super().__init__()
            self.dim = dim
            self.linear1 = nn.Linear(dim, dim)
            self.linear2 = nn.Linear(dim, dim)

        def forward(self, x):
            b = self.linear2(self.linear1(x))
            return nn.functional.linear(b, self.linear1.weight).sum()

    net = ExtLinear()
    engine, *_ = deepspeed.initialize(args=SimpleNamespace(local_rank=0), model=net,
                                      model_parameters=net.parameters(), config=_CFG)
    with deepspeed.zero.GatheredParameters(net.linear1.weight):
        assert net.linear1.weight.numel() == net.dim ** 2
    loss = engine(torch.rand(net.dim).to(torch.bfloat16))
    engine.backward(loss)
    engine.step()


@case("TestScatterGather::test", 2)
def scatter_gather():
    deepspeed = ds()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    with deepspeed.zero.Init():
        l = nn.Linear(6, 3)
    assert l.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert l.weight.shape == torch.Size([0])  # DeepSpeed's partitioned_param_data_shape
    l2 = nn.Linear(6, 3)
    assert not hasattr(l2.weight, "ds_status")
    assert l2.weight.numel() == l2.in_features * l2.out_features
    with deepspeed.zero.GatheredParameters(l.weight):
        assert l.weight.ds_status == ZeroParamStatus.AVAILABLE
        assert l.weight.numel() == l.in_features * l.out_features


@case("TestGatherUpdate::test", 2)
def gather_update():
    deepspeed = ds()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    with deepspeed.zero.Init():
        l = nn.Linear(4, 2)
    assert l.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    with deepspeed.zero.GatheredParameters(l.weight, modifier_rank=1):
        assert l.weight.ds_status == ZeroParamStatus.AVAILABLE
        if dist.get_rank() == 1:
            with torch.no_grad():
                l.weight.zero_()
    with deepspeed.zero.GatheredParameters(l.weight):
        assert torch.equal(l.weight, torch.zeros_like(l.weight))
