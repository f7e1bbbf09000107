"""Cases from DeepSpeed's tests/unit/runtime/zero/test_zero_tensor_fragment.py (bf16 for fp16; no NVMe)."""
import torch
import torch.distributed as dist
from torch import nn

from common import CASES, SimpleModel, adam, case, destroy, ds, param_cases, random_batches

GRAD = "gradient"


class MyModel(nn.Module):
    def __init__(self, hidden_dim, frozen_weights):
        super().__init__()
        self.act = nn.ReLU()
        self.cel = nn.CrossEntropyLoss()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, 1), nn.Linear(1, 1), nn.Linear(1, hidden_dim)])
        if frozen_weights:
            self.linears[0].weight.requires_grad = False
            self.linears[0].bias.requires_grad = False

    def forward(self, x, y):
        for l in self.linears:
            x = self.act(l(x))
        return self.cel(x, y)


def _u():
    import deepspeed.utils as u
    return u


def validate_tensor(model, api_type, opt_states):
    u = _u()
    for _, lp in model.named_parameters():
        if opt_states:
            vals = [u.safe_get_full_optimizer_state(lp, k) if api_type == "full" else
                    u.safe_get_local_optimizer_state(lp, k) for k in ("exp_avg", "exp_avg_sq")]
        else:
            vals = [u.safe_get_full_fp32_param(lp) if api_type == "full" else u.safe_get_local_fp32_param(lp),
                    u.safe_get_full_grad(lp) if api_type == "full" else u.safe_get_local_grad(lp)]
        if lp.requires_grad:
            assert all(v is not None for v in vals)
        else:
            assert all(v is None for v in vals)


def run_fragmented(model, cfg, hidden, dtype, after_bwd, after_step):
    deepspeed = ds()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dist.barrier()
    for x, y in random_batches(None, 10, hidden, 1, dtype=dtype):
        loss = engine(x, y)
        engine.backward(loss)
        after_bwd(engine)
        engine.step()
        after_step(engine)
    destroy(engine)


def _cfg(stage, dtype, offload, lr=1e-6, **opt):
    c = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1, "optimizer": adam(lr, **opt),
         "zero_optimization": {"stage": stage}}
    if dtype == torch.bfloat16:
        c["bf16"] = {"enabled": True}
    if offload == "cpu":
        c["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return c


_GET = ([dict(frozen_weights=f, api_type="full", zero_stage=s, offload="none") for f in (True, False)
         for s in (1, 2, 3)] +
        [dict(frozen_weights=f, api_type="local", zero_stage=3, offload="none") for f in (True, False)] +
        [dict(frozen_weights=False, api_type="full", zero_stage=s, offload="cpu") for s in (2, 3)])


@param_cases("TestTensorFragmentGet::test_zero_fragments[dtype=bfloat16]", 2, _GET)
def fragment_get(frozen_weights, api_type, zero_stage, offload):
    deepspeed = ds()
    dtype, hidden = torch.bfloat16, 1024
    cfg = _cfg(zero_stage, dtype, offload)
    if zero_stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = MyModel(hidden, frozen_weights)
    else:
        model = MyModel(hidden, frozen_weights)
    run_fragmented(model, cfg, hidden, dtype, lambda m: validate_tensor(m, api_type, False),
                   lambda m: validate_tensor(m, api_type, True))


def _full_values(model, keys, group, grad_dtype):
    out = {}
    for n, lp in model.named_parameters():
        shape = lp.ds_shape if hasattr(lp, "ds_id") else lp.shape
        out[n] = {}
        for k in keys:
            v = torch.rand(shape, dtype=grad_dtype if k == GRAD else torch.float32)
            dist.broadcast(v, src=0, group=group)
            out[n][k] = v
    return out


def _local_values(model, keys, group, grad_dtype):
    return {n: {k: torch.rand(lp.ds_tensor.shape, dtype=grad_dtype if k == GRAD else torch.float32) for k in keys}
            for n, lp in model.named_parameters()}


def _set(model, values, api):
    u = _u()
    for n, lp in model.named_parameters():
        for k, v in values[n].items():
            if k == GRAD:
                (u.safe_set_full_grad if api == "full" else u.safe_set_local_grad)(lp, v)
            elif k == "weight":
                (u.safe_set_full_fp32_param if api == "full" else u.safe_set_local_fp32_param)(lp, v)
            else:
                (u.safe_set_full_optimizer_state if api == "full" else u.safe_set_local_optimizer_state)(lp, v, k)


def _validate(model, values, api):
    u = _u()
    for n, lp in model.named_parameters():
        for k, exp in values[n].items():
            if k == GRAD:
                act = (u.safe_get_full_grad if api == "full" else u.safe_get_local_grad)(lp)
            elif k == "weight":
                act = (u.safe_get_full_fp32_param if api == "full" else u.safe_get_local_fp32_param)(lp)
            else:
                act = (u.safe_get_full_optimizer_state if api == "full" else u.safe_get_local_optimizer_state)(lp, k)
            assert torch.equal(exp, act), f"{n} {k}: value read back differs"


def _sm(stage, cfg, hidden):
    deepspeed = ds()
    if stage == 3:
        cfg["zero_optimization"]["param_persistence_threshold"] = hidden
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            return SimpleModel(hidden)
    return SimpleModel(hidden)


_SET = [dict(api_type="full", zero_stage=s) for s in (1, 2, 3)] + [dict(api_type="local", zero_stage=3)]


@param_cases("TestTensorFragmentSet::test_zero_fragments[dtype=bfloat16,offload=none]", 2, _SET)
def fragment_set(api_type, zero_stage):
    dtype, hidden = torch.bfloat16, 32
    cfg = _cfg(zero_stage, dtype, "none")
    model = _sm(zero_stage, cfg, hidden)
    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    dist.barrier()
    mk = _full_values if api_type == "full" else _local_values

    def after_bwd(m):
        v = mk(m, ["weight", GRAD], group, dtype)
        _set(m, v, api_type)
        _validate(m, v, api_type)

    def after_step(m):
        v = mk(m, ["weight", "exp_avg", "exp_avg_sq"], group, dtype)
        _set(m, v, api_type)
        _validate(m, v, api_type)

    run_fragmented(model, cfg, hidden, dtype, after_bwd, after_step)


@param_cases("TestTensorFragmentUpdate::test_zero_fragments[dtype=bfloat16,offload=none,torch_adam=True]", 2,
             [dict(zero_stage=s) for s in (1, 2, 3)])
def fragment_update(zero_stage):
    dtype, hidden = torch.bfloat16, 32
    cfg = _cfg(zero_stage, dtype, "none")
    model = _sm(zero_stage, cfg, hidden)
    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    dist.barrier()

    def after_bwd(m):
        from deepspeed.utils import safe_update_full_grad_vectorized
        v = _full_values(m, [GRAD], group, dtype)
        new = {id(lp): v[n][GRAD] for n, lp in m.named_parameters()}
        safe_update_full_grad_vectorized([lp for _, lp in m.named_parameters()], lambda old, p: new[id(p)])
        _validate(m, v, "full")

    run_fragmented(model, cfg, hidden, dtype, after_bwd, lambda m: None)
