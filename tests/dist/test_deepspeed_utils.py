"""DeepSpeed's ``deepspeed.utils`` as scripts call it, through ``zeropp.install_deepspeed_alias()`` on 2
ranks: full fp32 weights, gradients and Adam state read and set at stages 1-3, with and without optimizer
offload (to the host; at stage 3 also to NVMe), against an independent single-process model trained on the
same data (torch's AdamW, no zeropp); each rank's local parts; leaf modules marked by class, by name and by
config."""
from __future__ import annotations

import functools
import math
import os
import tempfile

import pytest
import torch
from torch import nn

import zeropp
from support.ds_reference import HIDDEN, ds_batch, ds_loss, make_model
from support.train import error_of
from support.world import run_world

WORLD, LR, WD = 2, 1e-2, 0.01
# offload: False, True (the host) or "nvme" (optimizer states swapped to files: rows leave memory between uses)
VARIANTS = [(stage, offload) for stage in (1, 2, 3) for offload in (False, True)] + [(3, "nvme")]
KEYS = ("exp_avg", "exp_avg_sq", "step")


def config(stage: int, offload: bool | str) -> dict:
    zero: dict = {"stage": stage}
    if offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": tempfile.mkdtemp(prefix="zeropp-nvme-")}
    elif offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def snapshot(model, utils, with_state: bool, grads: bool = False) -> dict:
    out = {}
    for name, p in model.named_parameters():
        entry = {"param": utils.safe_get_full_fp32_param(p)}
        if grads:
            entry["grad"] = utils.safe_get_full_grad(p)
        if with_state:
            entry.update({k: utils.safe_get_full_optimizer_state(p, k) for k in KEYS})
        out[name] = entry
    return out


def alias_run(rank: int, stage: int, offload: bool | str) -> dict:
    """Step 0, grads read; step 1; weights and Adam state read; weights halved and exp_avg zeroed through
    the setters; step 2; read again. Also each rank's local parts after step 2."""
    import deepspeed
    from deepspeed import utils
    model = make_model(0)
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=config(stage, offload))
    out: dict = {}
    for step in range(3):
        loss = ds_loss(engine, *ds_batch(step, rank))
        engine.backward(loss)
        if step == 0:
            out["grads"] = {n: utils.safe_get_full_grad(p) for n, p in model.named_parameters()}
            names = {id(p): n for n, p in model.named_parameters()}
            out["norm_groups"] = dict(zip((names[id(p)] for [p] in optimizer.fp16_groups),
                                          (float(t) for t in optimizer._get_norm_groups())))
        engine.step()
        if step == 0:
            out["global_norm"] = optimizer._global_grad_norm
        if step == 1:
            out["after1"] = snapshot(model, utils, True)
            for name, p in model.named_parameters():
                utils.safe_set_full_fp32_param(p, out["after1"][name]["param"] * 0.5)
                utils.safe_set_full_optimizer_state(p, torch.zeros_like(out["after1"][name]["exp_avg"]), "exp_avg")
            out["set"] = snapshot(model, utils, True)
    out["after2"] = snapshot(model, utils, True)
    out["local"] = {n: (utils.safe_get_local_fp32_param(p), utils.safe_get_local_optimizer_state(p, "exp_avg"))
                    for n, p in model.named_parameters()}
    out["unmanaged"] = utils.safe_get_full_fp32_param(nn.Parameter(torch.ones(2)))
    out["zero_optimizer"] = zero_optimizer_view(engine, optimizer, model)
    engine.close()
    return out


def zero_optimizer_view(engine, optimizer, model) -> dict:
    """What DeepSpeed's TestZeroAdamOptimizerStepCount reads through the returned optimizer: Adam's step count of
    every stage-3 sub-group (``fp32_partitioned_groups_flat``) and of every stage 1-2 group parameter, and which
    model parameters the groups hold."""
    inner = optimizer.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    return {"steps3": [float(inner.state[m]["step"]) for m in optimizer.fp32_partitioned_groups_flat],
            "steps12": [float(inner.state[m]["step"]) for g in inner.param_groups for m in g["params"]],
            "groups3": sorted(names[id(p)] for [p] in optimizer.fp16_groups),
            "groups12": sorted(names[id(p)] for g in optimizer.bit16_groups for p in g),
            "global_steps": engine.global_steps, "inner_is_engines": inner is engine.master_optimizer,
            "class": type(optimizer).__name__, "missing": error_of(lambda: optimizer.load_state_dict).split(":")[0],
            "unknown": error_of(lambda: optimizer.no_such_name).split(":")[0], "hasattr": hasattr(optimizer, "train")}


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class PairNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pairs = nn.Sequential(Pair(), Pair(), Pair())
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pairs(x)).pow(2).mean()

    def describe(self) -> str:
        """A method of the user's model, which DeepSpeed's engine passes through."""
        return f"{len(self.pairs)} pairs"


def leaf_units(rank: int) -> dict:
    """The gather units ``initialize`` plans (granularity "module") for leaves marked each way."""
    from deepspeed import utils
    out = {}
    for how in ("none", "class", "class_name", "name", "suffix", "config"):
        torch.manual_seed(0)
        model = PairNet()
        cfg = {"train_micro_batch_size_per_gpu": 1,
               "zero_optimization": {"stage": 3, "gather_granularity": "module"}}
        if how == "class":
            utils.set_z3_leaf_modules(model, [Pair])
        elif how == "class_name":
            utils.set_z3_leaf_modules(model, ["Pair"])
        elif how == "name":
            utils.set_z3_leaf_modules_by_name(model, ["pairs.1"])
        elif how == "suffix":
            utils.set_z3_leaf_modules_by_suffix(model, [".2"])
        elif how == "config":
            cfg["zero_optimization"]["leaf_module"] = {"names": ["pairs.0"]}
        leaves = [type(m).__name__ for m in utils.get_z3_leaf_modules(model)]
        engine, *_ = zeropp.initialize(model=model, config=cfg)
        loss = engine(torch.ones(2, 4))
        engine.backward(loss)
        engine.step()
        out[how] = {"units": [u.module_name for u in engine.units], "leaves": leaves, "loss": loss.item()}
        engine.close()
    try:
        utils.set_z3_leaf_modules(PairNet(), [nn.Conv2d])
    except ValueError as err:
        out["not_found"] = str(err)
    return out


def ds_views(rank: int) -> dict:
    """DeepSpeed's parameter attributes, read as integrations read them, before and after initialize."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_fp32_param
    with deepspeed.zero.Init():
        model = PairNet()
    p = model.pairs[0].a.weight
    out = {"class": type(p).__name__, "numel": p.ds_numel, "shape": tuple(p.ds_shape), "persist": p.ds_persist,
           "status": p.ds_status, "ids": sorted(q.ds_id for q in model.parameters()),
           "peft_count": sum(q.ds_numel if q.numel() == 0 else q.numel() for q in model.parameters())}
    with deepspeed.zero.GatheredParameters([p]):
        out["gathered"] = p.ds_status
        full = p.detach().clone()
    out["tensor_is_local"] = torch.equal(p.ds_tensor, full.reshape(-1)[rank * 8:(rank + 1) * 8])
    # DeepSpeed's field name of stage3_param_persistence_threshold: the head (5 elements) persists, pairs (20) not
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization":
                                                           {"stage": 3, "param_persistence_threshold": 5}})
    seen = []
    model.pairs[0].a.register_forward_pre_hook(lambda *_: seen.append(p.ds_status))  # after the gather
    loss = engine(torch.ones(2, 4))
    engine.backward(loss)
    engine.step()
    out.update(after=p.ds_status, in_forward=list(seen), engine_ids=sorted(q.ds_id for q in model.parameters()),
               tensor_after=torch.equal(p.ds_tensor, safe_get_full_fp32_param(p).reshape(-1)[rank * 8:(rank + 1) * 8]),
               persist_after=p.ds_persist, head_persist=model.head.weight.ds_persist,
               head_after=model.head.weight.ds_status)
    engine.empty_partition_cache()  # DeepSpeed's: the persistent head is freed too, and gathered at its next use
    out["head_emptied"] = model.head.weight.ds_status
    ahead = []  # the second forward knows the order: the next unit (b) is being prefetched while a runs
    model.pairs[0].a.register_forward_pre_hook(lambda *_: ahead.append(model.pairs[0].b.weight.ds_status))
    out["after_empty"] = float(engine(torch.ones(2, 4)))
    out["prefetched"] = ahead
    try:
        p.ds_status = ZeroParamStatus.AVAILABLE
    except NotImplementedError as err:
        out["write"] = str(err)
    engine.close()
    return out


def hpz_views(rank: int) -> dict:
    """``ds_secondary_tensor`` and ``ds_zero_param_process_group`` without hpZ and with groups of 2 (the world
    here): before the first forward (the slice cut at initialize), after it, after the step."""
    import deepspeed
    out = {}
    for size in (1, 2):
        torch.manual_seed(0)
        model = PairNet()
        engine, *_ = deepspeed.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "zero_hpz_partition_size": size}})
        p = model.pairs[0].a.weight
        seen = {"before": p.ds_secondary_tensor, "group": p.ds_zero_param_process_group is not None}
        with deepspeed.zero.GatheredParameters([p]):
            seen["initial"] = p.detach().clone()
        loss = engine(torch.ones(2, 4))
        seen["forward"] = p.ds_secondary_tensor
        engine.backward(loss)
        with deepspeed.zero.GatheredParameters([p]):
            seen["full"] = p.detach().clone()
        engine.step()
        seen["stepped"] = p.ds_secondary_tensor
        out[size] = seen
        engine.close()
    return out


REDUCTIONS = {"mean": {}, "all_reduce": {"reduce_scatter": False}, "sum": {"gradient_allreduce_op": "sum"},
              "predivide": {"gradient_predivide_factor": 4.0},
              "sum_predivide": {"gradient_allreduce_op": "sum", "gradient_predivide_factor": 4.0},
              "prescale": {"prescale_gradients": True}}


def reductions(rank: int) -> dict:
    """The gradient each reduction setting gives (read as the step will use it), at stages 1-3."""
    import deepspeed
    from deepspeed import utils
    out = {}
    for stage in (1, 2, 3):
        for name, extra in REDUCTIONS.items():
            cfg = config(stage, False)
            top = {k: v for k, v in extra.items() if k != "reduce_scatter"}
            cfg.update(top)
            cfg["zero_optimization"].update({k: v for k, v in extra.items() if k == "reduce_scatter"})
            model = make_model(0)
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
            engine.backward(ds_loss(engine, *ds_batch(0, rank)))
            out[stage, name] = {n: utils.safe_get_full_grad(p) for n, p in model.named_parameters()}
            engine.step()
            engine.close()
    return out


def engine_module(rank: int) -> dict:
    """The engine as DeepSpeed's is: an nn.Module around the model, attributes passed through."""
    import deepspeed
    model = PairNet()
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                           "zero_optimization": {"stage": 3}})
    out = {"module": isinstance(engine, nn.Module), "names": [n for n, _ in engine.named_parameters()],
           "model_names": [n for n, _ in model.named_parameters()], "same": all(
               a is b for a, b in zip(engine.parameters(), model.parameters())),
           "modules": [n for n, _ in engine.named_modules()][:2], "describe": engine.describe(),
           "head": engine.head is model.head}
    engine.eval()
    out["eval"] = not model.training
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
    gathers = lambda: sum(t.calls for (phase, _), t in engine.ledger.current.items()  # noqa: E731
                          if phase.value == "forward_gather")
    with unwrap_model_for_generation(engine) as unwrapped, torch.no_grad():
        on_entry = gathers()
        outs = [float(unwrapped(torch.ones(1, 4))) for _ in range(3)]
        out["held"] = all(u.state.value == "gathered" for u in engine.units)
    out["generate"] = {"same": len(set(outs)) == 1, "released": all(u.state.value == "sharded" for u in engine.units),
                       "on_entry": on_entry, "units": len(engine.units), "forward_gathers": gathers() - on_entry}
    engine.train()
    try:
        engine.compile(backend="no_such_backend")
    except ValueError as err:
        out["compile"] = str(err)
    out["compiled_before"] = engine.is_compiled
    engine.destroy()
    return out


def gathered_writes(rank: int) -> dict:
    """In-place writes inside GatheredParameters(modifier_rank=None), made on rank 1 only: one that changes a
    value raises on every rank, before initialize (parameters partitioned by zero.Init) and after; after
    initialize, writing the values already there (add_(0.0), load_state_dict of the same weights) passes, and
    raises with enable_sanity_checks."""
    import deepspeed
    out = {}
    with deepspeed.zero.Init():
        model = PairNet()
    for when in ("constructed", "engine", "same", "same_state_dict", "sanity"):
        if when == "sanity":
            engine.close()
            with deepspeed.zero.Init():
                model = PairNet()
        if when in ("engine", "sanity"):
            zero = {"stage": 3, "enable_sanity_checks": when == "sanity"}
            engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                                   "zero_optimization": zero})
        params = [model.pairs[0].a.weight, model.head.weight]
        gathered = list(model.parameters()) if when == "same_state_dict" else params  # state_dict reads them all
        try:
            with deepspeed.zero.GatheredParameters(gathered, modifier_rank=None), torch.no_grad():
                if rank == 1 and when == "same_state_dict":
                    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
                elif rank == 1:
                    model.head.weight.add_(1.0 if when in ("constructed", "engine") else 0.0)
            out[when] = None
        except RuntimeError as err:
            out[when] = str(err)
        with deepspeed.zero.GatheredParameters(params), torch.no_grad():  # reading alone raises nothing
            out[when + "_read"] = float(model.head.weight.sum())
    engine.close()
    return out


def unused(rank: int) -> dict:
    """A parameter no loss uses, at stages 1-2 with ignore_unused_parameters false (and true)."""
    out = {}
    for stage in (1, 2):
        for ignore in (False, True):
            model = PairNet()
            cfg = {"train_micro_batch_size_per_gpu": 1,
                   "zero_optimization": {"stage": stage, "ignore_unused_parameters": ignore}}
            engine, *_ = zeropp.initialize(model=model, config=cfg)
            x = torch.ones(2, 4)
            try:  # the head never runs
                loss = engine.module.pairs(x).sum()
                engine.backward(loss)
                engine.step()
                out[stage, ignore] = None
            except RuntimeError as err:
                out[stage, ignore] = str(err)
            engine.close()
    return out


def comm_calls(rank: int, world: int) -> dict:
    """``deepspeed.comm`` as scripts use it: collectives on the world and on a group, each tallied."""
    import deepspeed.comm as dist
    from deepspeed.comm import ReduceOp
    dist.reset_log()
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x, op=ReduceOp.SUM, log_name="metric")
    y = torch.full((2,), float(rank))
    dist.broadcast(y, src=world - 1)
    out = torch.empty(2 * world)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
    pair = dist.new_group([0, 1])
    z = torch.ones(1)
    if rank < 2:
        dist.all_reduce(z, group=pair)
    dist.barrier()
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": x.tolist(), "bcast": y.tolist(),
            "gathered": out.tolist(), "pair": z.item(), "log": dist.log_summary(return_dict=True),
            "count": dist.get_comm_operation_count()}


class ByRank(nn.Module):
    """A leaf module whose forward picks a child by rank (DeepSpeed's ChooseModuleByRankModel)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.pick = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.pick[rank % 2](self.inp(x)).pow(2).mean()


def by_rank_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(31 * step + rank))


def partly_used(rank: int) -> dict:
    """Ranks that use different children of one leaf unit train on the mean of their gradients (zeros for a
    child a rank did not run); plus the frozen-parameter and no-op-move behaviours."""
    import deepspeed
    from deepspeed import utils
    from deepspeed.utils import set_z3_leaf_modules
    torch.manual_seed(0)
    model = ByRank()
    set_z3_leaf_modules(model, [ByRank])
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    out: dict = {"doubled": []}
    for step in range(3):
        engine.backward(engine(by_rank_batch(step, rank), rank))
        before = utils.safe_get_full_grad(model.inp.weight)
        utils.safe_update_full_grad_vectorized(list(model.parameters()), lambda g, p: 2 * g)
        utils.safe_update_full_grad_vectorized(list(model.parameters()), lambda g, p: g / 2)
        out["doubled"].append(torch.equal(utils.safe_get_full_grad(model.inp.weight), before))
        engine.step()
    out["state"] = engine.consolidated_state_dict()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    ckpt = f"{tempfile.gettempdir()}/zeropp-ds-fp32-{os.environ['MASTER_PORT']}"  # the same on both ranks
    engine.save_checkpoint(ckpt)
    torch.distributed.barrier()
    out["from_checkpoint"] = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    engine.close()
    plain = make_model(0)
    engine, *_ = deepspeed.initialize(model=plain, config=config(2, False))
    engine.empty_partition_cache()  # stage 2: the weights are resident, nothing to free
    engine.backward(ds_loss(engine, *ds_batch(0, rank)))
    engine.step()
    out["stage2_after_empty_cache"] = math.isfinite(ds_loss(engine, *ds_batch(1, rank)).item())
    engine.close()
    frozen = make_model(0)
    frozen.norm.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=frozen, config=config(3, False))
    out["frozen_gets"] = [utils.safe_get_full_fp32_param(frozen.norm.weight),
                          utils.safe_get_full_optimizer_state(frozen.norm.weight, "exp_avg"),
                          utils.safe_get_local_fp32_param(frozen.norm.weight)]
    try:
        utils.safe_set_full_fp32_param(frozen.norm.weight, torch.zeros(HIDDEN))
    except ValueError as err:
        out["frozen_set"] = str(err)
    try:
        utils.safe_set_local_fp32_param(frozen.norm.weight, torch.zeros(HIDDEN // WORLD))
    except ValueError as err:
        out["frozen_set_local"] = str(err)
    engine.close()
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        built = nn.Sequential(nn.Linear(4, 4)).cpu().to(torch.float32)  # moves that move nothing
    try:
        built.to(torch.float64)
    except Exception as err:  # noqa: BLE001 (the type is what the test reads)
        out["real_move"] = type(err).__name__
    engine, *_ = deepspeed.initialize(model=built, config=cfg)
    out["engine_cpu"] = engine.module.cpu() is engine.module
    engine.close()
    return out


def scenario(rank: int, world: int) -> dict:
    zeropp.install_deepspeed_alias()
    comm = comm_calls(rank, world)
    out: dict = {v: alias_run(rank, *v) for v in VARIANTS}
    out["reductions"] = reductions(rank)
    out["leaves"] = leaf_units(rank)
    out["views"] = ds_views(rank)
    out["hpz"] = hpz_views(rank)
    out["engine"] = engine_module(rank)
    out["writes"] = gathered_writes(rank)
    out["unused"] = unused(rank)
    out["partly"] = partly_used(rank)
    out["comm"] = comm
    return out


@functools.lru_cache(maxsize=None)
def results() -> list:
    return run_world(scenario, WORLD)


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    """The same model and data in one process: the loss of each step is the mean of the ranks' losses."""
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    out: dict = {}
    for step in range(3):
        loss = sum(ds_loss(model, *ds_batch(step, r)) for r in range(WORLD)) / WORLD
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step == 1:
            out["after1"] = {n: {"param": p.detach().clone(), **{k: opt.state[p][k].clone() for k in KEYS}}
                             for n, p in model.named_parameters()}
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
                    opt.state[p]["exp_avg"].zero_()
    out["after2"] = {n: {"param": p.detach().clone(), **{k: opt.state[p][k].clone() for k in KEYS}}
                     for n, p in model.named_parameters()}
    return out


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-7, msg=what)


@pytest.mark.parametrize("stage,offload", VARIANTS)
def test_full_values_equal_a_single_process_and_setters_take(stage, offload):
    ref = reference()
    for rank, res in enumerate(results()):
        got = res[(stage, offload)]
        for name, want in ref["grads"].items():
            close(got["grads"][name], want, f"rank {rank} grad {name}")
        for when in ("after1", "after2"):
            for name, want in ref[when].items():
                for key, value in want.items():
                    close(got[when][name][key], value, f"rank {rank} {when} {name} {key}")
        for name, values in got["set"].items():  # what was set is what is read back, exactly
            assert torch.equal(values["param"], got["after1"][name]["param"] * 0.5), name
            assert not values["exp_avg"].any(), name
        assert got["unmanaged"] is None


@pytest.mark.parametrize("stage,offload", VARIANTS)
def test_the_returned_optimizer_reads_as_deepspeeds_zero_optimizer(stage, offload):
    """``deepspeed.initialize``'s optimizer: Adam's step of every sub-group equals the engine's global steps (what
    DeepSpeed's TestZeroAdamOptimizerStepCount checks), its groups hold every parameter once, a name it lacks
    raises DeepSpeedAPIError (tests/dist/test_deepspeed_optimizer.py drives its step() and zero_grad())."""
    names = sorted(n for n, _ in make_model(0).named_parameters())
    for res in results():
        view = res[(stage, offload)]["zero_optimizer"]
        assert view["global_steps"] == 3 and view["inner_is_engines"]
        assert view["steps3"] == view["steps12"] == [3.0] * len(names)
        assert view["groups3"] == view["groups12"] == names
        assert view["missing"] == "DeepSpeedAPIError"  # a DeepSpeed name it lacks, named
        assert view["unknown"] == "AttributeError" and view["hasattr"] is False  # as DeepSpeed's, for probes
        assert view["class"] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")


@pytest.mark.parametrize("stage,offload", VARIANTS)
def test_the_optimizers_norm_groups_are_each_gradients_norm(stage, offload):
    """``optimizer._get_norm_groups()`` after a backward (what DeepSpeed's TestZeroGradClip reads before and after
    clipping gradients by hand): each parameter's gradient norm, as the single-process reference has it; their
    L2 norm is ``_global_grad_norm`` once the step ran."""
    ref = reference()
    for res in results():
        got = res[(stage, offload)]
        want = {n: float(g.float().norm()) for n, g in ref["grads"].items()}
        assert got["norm_groups"] == pytest.approx(want, rel=1e-5)
        total = sum(v * v for v in got["norm_groups"].values()) ** 0.5
        assert got["global_norm"] == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("stage,offload", VARIANTS)
def test_local_parts_are_each_ranks_range(stage, offload):
    ranks = results()
    for name, full in ranks[0][(stage, offload)]["after2"].items():
        for key, index in (("param", 0), ("exp_avg", 1)):
            parts = [r[(stage, offload)]["local"][name][index] for r in ranks]
            assert torch.equal(torch.cat(parts), full[key].reshape(-1).float()), (name, key)


def test_leaf_modules_by_class_name_suffix_and_config_are_whole_units():
    for res in results():
        leaves = res["leaves"]
        assert "pairs.0.a" in leaves["none"]["units"] and "pairs.0" not in leaves["none"]["units"]
        for how in ("class", "class_name"):
            assert leaves[how]["leaves"] == ["Pair"] * 3
            assert leaves[how]["units"] == ["pairs.0", "pairs.1", "pairs.2", "head"], leaves[how]
        assert "pairs.1" in leaves["name"]["units"] and "pairs.1.a" not in leaves["name"]["units"]
        assert "pairs.0.a" in leaves["name"]["units"]
        assert "pairs.2" in leaves["suffix"]["units"] and "pairs.2.b" not in leaves["suffix"]["units"]
        assert "pairs.0" in leaves["config"]["units"] and "pairs.0.a" not in leaves["config"]["units"]
        losses = {how: v["loss"] for how, v in leaves.items() if isinstance(v, dict)}
        assert len(set(losses.values())) == 1, losses  # the units change, the values do not
        assert "No modules of type" in leaves["not_found"]


def test_the_secondary_partition_is_read_while_current():
    """hpZ's slice of a parameter (DeepSpeed's ``ds_secondary_tensor``, read by its test_zeropp.py) exists from
    ``initialize`` (Note [hpZ slices at initialize]) and from each forward's release until the optimizer step
    changes the weights; its values are the rank's part of the weights; without hpZ there is none and no group."""
    for rank, res in enumerate(results()):
        plain, hpz = res["hpz"][1], res["hpz"][2]
        assert plain["before"] is plain["forward"] is plain["stepped"] is None and not plain["group"]
        assert hpz["group"] and hpz["stepped"] is None
        assert torch.equal(hpz["before"], hpz["initial"].reshape(-1)[rank * 8:(rank + 1) * 8])
        assert torch.equal(hpz["forward"], hpz["full"].reshape(-1)[rank * 8:(rank + 1) * 8])


def test_parameter_attributes_are_views_of_the_partitioned_state():
    from zeropp.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    n = sum(p.numel() for p in PairNet().parameters())
    for res in results():
        v = res["views"]
        assert v["class"] == "DeepSpeedParameter" and v["numel"] == 16 and v["shape"] == (4, 4)
        assert v["persist"] is False and v["peft_count"] == n
        assert v["persist_after"] is False and v["head_persist"] is True
        assert v["head_after"] is ZeroParamStatus.AVAILABLE  # kept gathered past the step, until its next use
        assert v["head_emptied"] is ZeroParamStatus.NOT_AVAILABLE and math.isfinite(v["after_empty"])
        assert v["prefetched"] == [ZeroParamStatus.INFLIGHT]
        assert v["status"] is ZeroParamStatus.NOT_AVAILABLE and v["gathered"] is ZeroParamStatus.AVAILABLE
        assert v["after"] is ZeroParamStatus.NOT_AVAILABLE and v["in_forward"] == [ZeroParamStatus.AVAILABLE]
        assert len(set(v["ids"])) == len(v["ids"]) and v["engine_ids"] == list(range(len(v["engine_ids"])))
        assert v["tensor_is_local"] and v["tensor_after"]
        assert "read-only" in v["write"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reduction_settings_give_the_mean_or_the_sum(stage):
    ref = reference()["grads"]
    for res in results():
        got = res["reductions"]
        for name, factor in (("mean", 1), ("all_reduce", 1), ("predivide", 1), ("prescale", 1), ("sum", WORLD),
                             ("sum_predivide", WORLD)):
            for key, want in ref.items():
                close(got[stage, name][key], want * factor, f"stage {stage} {name} {key}")


def test_the_engine_is_a_module_that_passes_the_models_attributes_through():
    for res in results():
        got = res["engine"]
        assert got["module"] and got["same"] and got["head"] and got["eval"]
        assert got["names"] == ["module." + n for n in got["model_names"]]
        assert got["modules"] == ["", "module"] and got["describe"] == "3 pairs"
        assert "compile backend 'no_such_backend'" in got["compile"] and "aot_eager" in got["compile"]
        assert got["compiled_before"] is False  # a failed compile leaves the model eager
        assert got["held"] and got["generate"]["same"] and got["generate"]["released"]
        # each unit gathered once on entry (through the forward's strategy), none per forward
        assert got["generate"]["on_entry"] == got["generate"]["units"] and got["generate"]["forward_gathers"] == 0


def test_an_in_place_write_in_a_read_only_gather_raises_on_every_rank():
    """A changed value raises everywhere and is discarded; writing back the same values passes (DeepSpeed's
    TestZeroToFP32 loads the weights just saved inside such a block), unless enable_sanity_checks asks that any
    write raise, as DeepSpeed's check does."""
    for res in results():
        for when in ("constructed", "engine", "sanity"):
            err = res["writes"][when]
            assert err is not None and "in-place modification" in err and "rank(s) [1]" in err, (when, err)
        assert res["writes"]["same"] is None and res["writes"]["same_state_dict"] is None
        reads = {res["writes"][w + "_read"] for w in ("constructed", "engine", "same", "same_state_dict")}
        assert len(reads) == 1  # nothing written in a read-only block stayed (one model until "sanity")


def test_unused_parameters_are_named_at_stages_1_and_2_when_asked():
    for res in results():
        for stage in (1, 2):
            err = res["unused"][stage, False]
            assert err is not None and "got no gradient" in err and "rank(s) [0, 1]" in err, (stage, err)
            assert "'head.weight'" in err
            assert res["unused"][stage, True] is None


def test_deepspeed_comm_runs_collectives_and_tallies_them():
    n = WORLD * (WORLD + 1) / 2
    for rank, res in enumerate(results()):
        c = res["comm"]
        assert (c["rank"], c["world"]) == (rank, WORLD)
        assert c["sum"] == [n] * 4 and c["bcast"] == [float(WORLD - 1)] * 2
        assert c["gathered"] == [float(r) for r in range(WORLD) for _ in range(2)]
        assert c["pair"] == (2.0 if rank < 2 else 1.0)
        calls = 2 if rank < 2 else 1
        assert c["log"]["all_reduce"] == {"calls": calls, "bytes": 16 + 4 * (calls - 1)}
        assert c["log"]["all_gather_into_tensor"] == {"calls": 1, "bytes": 8}
        assert c["count"] == calls + 3  # all_reduce(s), broadcast, all_gather_into_tensor, barrier


def test_ranks_using_different_children_of_a_leaf_train_on_the_mean_gradient():
    """One process: SGD on the mean of the two ranks' losses, each computed with the child its rank picks."""
    torch.manual_seed(0)
    ref = ByRank()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        sum(ref(by_rank_batch(step, r), r) for r in range(WORLD)).div(WORLD).backward()
        opt.step()
    for res in results():
        got = res["partly"]
        assert got["doubled"] == [True] * 3  # safe_update_full_grad_vectorized wrote each update
        assert got["from_checkpoint"].keys() == got["state"].keys() and got["stage2_after_empty_cache"]
        for name, value in got["state"].items():  # deepspeed.utils.zero_to_fp32 reads the saved masters
            assert torch.equal(got["from_checkpoint"][name], value), name
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got["state"][name], p.detach(), rtol=1e-5, atol=1e-7)


def test_frozen_parameters_have_no_fp32_state_and_moves_that_move_nothing_pass():
    for res in results():
        got = res["partly"]
        assert got["frozen_gets"] == [None, None, None]  # as DeepSpeed: frozen at initialize, nothing trained
        for key in ("frozen_set", "frozen_set_local"):
            assert "norm.weight" in got[key] and "frozen at initialize" in got[key], got.get(key)
        assert got["real_move"] == "ParameterAccessError" and got["engine_cpu"]
