"""Cases from DeepSpeed's tests/unit/runtime/zero/test_zero_leaf_module.py."""
import torch
import torch.distributed as dist
from torch import nn

from common import CASES, adam, case, destroy, ds, param_cases, random_batches


class ChooseModuleByCounter(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)])
        self.act = nn.ReLU()
        self.cel = nn.CrossEntropyLoss()
        self.counter = 0

    def forward(self, x, y):
        x = self.act(self.linears[self.counter % len(self.linears)](x))
        loss = self.cel(x, y)
        self.counter += 1
        return x, loss


class ChooseModuleByRankModel(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)])
        self.act = nn.ReLU()
        self.cel = nn.CrossEntropyLoss()

    def forward(self, x, y):
        x = self.act(self.linears[dist.get_rank() % len(self.linears)](x))
        return x, self.cel(x, y)


class MultiOutputMoEBlock(nn.Module):
    def __init__(self, h, num_experts=4):
        super().__init__()
        self.gate = nn.Linear(h, num_experts, bias=False)
        self.experts = nn.ModuleList([nn.Linear(h, h, bias=False) for _ in range(num_experts)])
        self.act = nn.ReLU()
        self.cel = nn.CrossEntropyLoss()

    def forward(self, x, y):
        router_logits = self.gate(x)
        for e in self.experts:
            x = e(x)
        x = self.act(x)
        return x, self.cel(x, y), router_logits


class MLPBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.gate_proj = nn.Linear(h, h, bias=False)
        self.up_proj = nn.Linear(h, h, bias=False)
        self.down_proj = nn.Linear(h, h, bias=False)
        self.act_fn = nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FineGrainedBlock(nn.Module):
    def __init__(self, h, n):
        super().__init__()
        self.mlp_layers = nn.ModuleList([MLPBlock(h) for _ in range(n)])

    def forward(self, x):
        for m in self.mlp_layers:
            x = m(x)
        return x


class BaseLeafModule(nn.Module):
    pass


class SubLeafModule(BaseLeafModule):
    def __init__(self, h):
        super().__init__()
        self.proj = nn.Linear(h, h)

    def forward(self, x):
        return self.proj(x)


class WrapperLeafModule(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.child = SubLeafModule(h)

    def forward(self, x):
        return self.child(x)


class modelWithFineGrainedBlock(nn.Module):
    def __init__(self, h, n):
        super().__init__()
        self.coarse_grained_layer1 = nn.Linear(h, 8 * h)
        self.coarse_grained_layer2 = nn.Linear(8 * h, h)
        self.fine_grained_layer = FineGrainedBlock(h, n)
        self.cel = nn.CrossEntropyLoss()

    def forward(self, x, y):
        x = self.fine_grained_layer(self.coarse_grained_layer2(self.coarse_grained_layer1(x)))
        return x, self.cel(x, y)


def _u():
    ds()
    import deepspeed.utils as u
    return u


# ---- module-level tests (no process group needed; run on 1 rank) ----------------------------------------------
@case("test_set_leaf_modules_with_fully_qualified_name", 1)
def fq_name():
    u = _u()
    model = WrapperLeafModule(16)
    matched = u.set_z3_leaf_modules(model, [f"{SubLeafModule.__module__}.{SubLeafModule.__qualname__}"])
    assert len(matched) == 1 and matched[0] is model.child
    assert u.z3_leaf_module(model.child)
    assert not u.z3_leaf_module(model)


@case("test_set_leaf_modules_no_raise_when_missing", 1)
def no_raise_missing():
    u = _u()
    model = WrapperLeafModule(16)
    assert u.set_z3_leaf_modules(model, ["NonExistentClass"], raise_if_not_found=False) == []
    assert not u.z3_leaf_module(model.child)


@case("test_set_leaf_modules_by_name", 1)
def by_name():
    u = _u()
    model = WrapperLeafModule(16)
    matched, missing = u.set_z3_leaf_modules_by_name(model, ["child"])
    assert matched == [model.child] and missing == []
    assert u.z3_leaf_module(model.child)


@case("test_set_leaf_modules_by_name_missing", 1)
def by_name_missing():
    u = _u()
    model = WrapperLeafModule(16)
    matched, missing = u.set_z3_leaf_modules_by_name(model, ["missing"], raise_if_not_found=False)
    assert matched == [] and missing == ["missing"]


@case("test_set_leaf_modules_by_suffix", 1)
def by_suffix():
    u = _u()
    model = WrapperLeafModule(16)
    matched, missing = u.set_z3_leaf_modules_by_suffix(model, ["child"])
    assert missing == [] and matched == [model.child]
    assert u.z3_leaf_module(model.child)


@case("test_set_leaf_modules_by_suffix_missing", 1)
def by_suffix_missing():
    u = _u()
    model = WrapperLeafModule(16)
    matched, missing = u.set_z3_leaf_modules_by_suffix(model, ["missing"], raise_if_not_found=False)
    assert matched == [] and missing == ["missing"]


@case("test_zero_leaf_module_default_config", 1)
def default_config():
    ds()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.leaf_module_config import (DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAMES,
                                                           DEFAULT_LEAF_MODULE_NAME_SUFFIXES)
    c = DeepSpeedZeroConfig()
    assert c.leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES
    assert c.leaf_module.names == DEFAULT_LEAF_MODULE_NAMES
    assert c.leaf_module.name_suffixes == DEFAULT_LEAF_MODULE_NAME_SUFFIXES


@case("test_zero_leaf_module_custom_config", 1)
def custom_config():
    ds()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    c = DeepSpeedZeroConfig(**{"leaf_module": {"classes": ["custom.module.CustomClass"],
                                               "names": ["transformer.layer"], "name_suffixes": ["experts"]}})
    assert c.leaf_module.classes == ["custom.module.CustomClass"]
    assert c.leaf_module.names == ["transformer.layer"]
    assert c.leaf_module.name_suffixes == ["experts"]


@case("test_zero_leaf_module_string_coercion", 1)
def string_coercion():
    ds()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    c = DeepSpeedZeroConfig(**{"leaf_module": {"classes": "my.Class", "names": "submodule", "name_suffixes": "tail"}})
    assert c.leaf_module.classes == ["my.Class"]
    assert c.leaf_module.names == ["submodule"]
    assert c.leaf_module.name_suffixes == ["tail"]


# ---- TestSetZ3LeafModule (world 2) ---------------------------------------------------------------------------
def _cfg(h, leaf_module=None):
    c = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1, "optimizer": adam(1e-6), "bf16": {"enabled": True},
         "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": h ** 2,
                               "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}
    if leaf_module is not None:
        c["zero_optimization"]["leaf_module"] = leaf_module
    return c


def run_model(model, cfg, h, requires_grad):
    deepspeed = ds()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dist.barrier()
    losses = []
    for x, y in random_batches(None, 10, h, 1, seed=7 + dist.get_rank()):
        x.requires_grad = requires_grad
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    destroy(engine)
    return losses


def _set_leaf_and_run(cls, requires_grad):
    u = _u()
    h = 128
    model = cls(h)
    assert not u.z3_leaf_module(model)
    u.set_z3_leaf_modules(model, [cls])
    assert u.z3_leaf_module(model)
    run_model(model, _cfg(h), h, requires_grad)


@case("TestSetZ3LeafModule::test_choose_module_by_counter", 2)
def by_counter():
    _set_leaf_and_run(ChooseModuleByCounter, True)


@case("TestSetZ3LeafModule::test_choose_module_by_rank", 2)
def by_rank():
    _set_leaf_and_run(ChooseModuleByRankModel, True)


def _multi_output(leaf):
    deepspeed = ds()
    u = _u()
    torch.autograd.set_multithreading_enabled(True)
    h = 128
    model = MultiOutputMoEBlock(h, 4)
    assert not u.z3_leaf_module(model)
    if leaf:
        u.set_z3_leaf_modules(model, [MultiOutputMoEBlock])
        assert u.z3_leaf_module(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_cfg(h))
    dist.barrier()
    for x, y in random_batches(None, 10, h, 1):
        x.requires_grad = True
        _, loss, logits = engine(x, y)
        engine.backward(loss + 0.01 * logits.mean())
        engine.step()
    destroy(engine)


@case("TestSetZ3LeafModule::test_multi_output_leaf_module_thread_safety", 2)
def multi_output_leaf():
    _multi_output(True)


@case("TestSetZ3LeafModule::test_multi_output_non_leaf_module_thread_safety", 2)
def multi_output_non_leaf():
    _multi_output(False)


@case("TestSetZ3LeafModule::test_no_grad_input_error", 2)
def no_grad_input_error():
    try:
        _set_leaf_and_run(ChooseModuleByCounter, False)
        raise AssertionError("Expected RuntimeError: inputs with requires_grad=False is not supported for a leaf module")
    except RuntimeError:
        pass


@case("TestSetZ3LeafModule::test_set_unset_leaf_modules", 2)
def set_unset():
    u = _u()
    model = ChooseModuleByCounter(128)
    assert len(u.set_z3_leaf_modules(model, [nn.ModuleList])) == 1
    assert len(u.get_z3_leaf_modules(model)) == 1
    assert len(u.unset_z3_leaf_modules(model, [nn.ModuleList])) == 1
    assert len(u.get_z3_leaf_modules(model)) == 0


@case("TestSetZ3LeafModule::test_set_leaf_modules_with_subclass", 2)
def with_subclass():
    u = _u()
    model = WrapperLeafModule(32)
    leaves = u.set_z3_leaf_modules(model, [BaseLeafModule])
    assert len(leaves) == 1 and leaves[0] is model.child
    assert u.z3_leaf_module(model.child)
    assert not u.z3_leaf_module(model)


@case("TestSetZ3LeafModule::test_set_no_match_class", 2)
def no_match():
    u = _u()
    model = ChooseModuleByCounter(128)
    try:
        u.set_z3_leaf_modules(model, [nn.Conv2d])
        raise AssertionError("Expected error that no module is set as a leaf module")
    except ValueError:
        pass


@case("TestSetZ3LeafModule::test_leaf_module_enabled_via_config", 2)
def via_config():
    u = _u()
    h = 128
    fqn = f"{ChooseModuleByCounter.__module__}.{ChooseModuleByCounter.__qualname__}"
    model = ChooseModuleByCounter(h)
    assert not u.z3_leaf_module(model)
    run_model(model, _cfg(h, {"classes": [fqn], "name_suffixes": ["linears"]}), h, True)
    assert u.z3_leaf_module(model)
    mods = dict(model.named_modules())
    assert "linears" in mods
    assert u.z3_leaf_module(mods["linears"])


# ---- TestZ3LeafOptimization -----------------------------------------------------------------------------------
@param_cases("TestZ3LeafOptimization::test_finegrained_optimization", 2,
             [dict(module_granularity_threshold=t) for t in (0, 100, 12100, 10000000)])
def finegrained(module_granularity_threshold):
    deepspeed = ds()
    h, nb = 128, 16
    cfg = _cfg(h)

    def losses(c):
        torch.manual_seed(0)
        model = modelWithFineGrainedBlock(h, nb)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=c)
        dist.barrier()
        out = []
        for x, y in random_batches(None, 20, h, 1, seed=11 + dist.get_rank()):
            x.requires_grad = True
            loss = engine(x, y)[1]
            out.append(loss.detach().float().item())
            engine.backward(loss)
            engine.step()
        destroy(engine)
        return out

    base = losses(cfg)
    cfg["zero_optimization"]["stage3_module_granularity_threshold"] = module_granularity_threshold
    got = losses(cfg)
    if dist.get_rank() == 0:
        assert base == got, f"incorrect loss value with threshold:{module_granularity_threshold}: {base} vs {got}"
