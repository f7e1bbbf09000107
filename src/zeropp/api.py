"""``zeropp.api.build``: read the config, build the topology and strategies, wrap the model.

This is the only place that looks at the stage's and ZeRO++'s switches: it turns them into the strategies
and policy the engine is handed (see :func:`build_strategies`).
"""
from __future__ import annotations

import datetime
import inspect
import os
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from zeropp import crash_report
from zeropp.activation import checkpointing
from zeropp import topology as topo_mod
from zeropp.comm.buffers import BufferPools
from zeropp.comm.gather import AllGather
from zeropp.comm.ledger import CommLedger
from zeropp.comm.ops import Comm
from zeropp.comm.reduce import AllReduceKeepRow, AllReduceMean, AllToAllReduceScatter
from zeropp.config.loader import ZeroppConfig, load_config
from zeropp.config.auto import AutoValues
from zeropp.offload.link import build_link
from zeropp.offload.residency import build_residency
from zeropp.zero import compiled as compiled_regions
from zeropp.partition.assign import granular_leaves, granularities, mark_leaves, set_leaf
from zeropp.optim import build_optimizer, build_scheduler
from zeropp.plus.frozen import FrozenApart, FrozenGather, QuantizedFrozenUnits
from zeropp.plus.hpz import HpzGather, SecondaryStore
from zeropp.plus.loco import Loco
from zeropp.plus.qgz import QuantizedReduce
from zeropp.plus.qwz import QuantizedGather
from zeropp.topology import Group
from zeropp.zero import gathered, init_context
from zeropp.config.policy import StagePlan, TrainPolicy, resolve
from zeropp.zero.engine import ZeroEngine
from zeropp.zero.strategies import Strategies


def build_strategies(policy: TrainPolicy, comm: Comm) -> Strategies:
    """Map the stage and the ZeRO++ switches (``policy.comm``) to gather and reduce strategies.

    Stages 0-2 gather only after an optimizer step (over a group of one in stage 0, whose every rank holds
    the whole master); the ZeRO++ switches, stage 3 only, each replace one strategy independently.
    """
    if policy.stage == 0:
        me = Group((comm.topo.rank,))
        return Strategies(AllGather(comm, me), AllGather(comm, me), AllReduceMean(comm))
    plus = policy.comm
    block = plus.block_size
    forward = (
        QuantizedGather(comm, plus.weight_bits, block) if plus.quantized_weights
        else AllGather(comm)
    )
    backward = AllGather(comm)
    secondary = None
    if plus.hpz_partition_size > 1:
        # shared: a slice cut after forward serves backward; one pool of output rows (Note [hpZ slices at initialize])
        store, pools = SecondaryStore(), BufferPools("hpz", "out")
        forward = secondary = HpzGather(comm, forward, store, pools)
        backward = HpzGather(comm, backward, store, pools, reports_pools=False)
    if plus.quantized_gradients:
        loco = Loco(plus.loco.err_beta, plus.loco.reset_t, block) if plus.loco is not None else None
        reduce = QuantizedReduce(comm, plus.gradient_bits, block, loco)
    else:
        reduce = AllToAllReduceScatter(comm) if plus.reduce_scatter else AllReduceKeepRow(comm)
    if not plus.quantized_frozen_weights:
        return Strategies(forward, backward, reduce, secondary=secondary)
    # Note [quantized frozen weights]: one frozen gather (and hpZ copy) serves both passes
    hpz = comm.topo.hpz if plus.hpz_partition_size > 1 else None
    frozen = FrozenGather(comm, hpz)
    return Strategies(FrozenApart(forward, frozen), FrozenApart(backward, frozen, reports_frozen=False), reduce,
                      QuantizedFrozenUnits(8, block), secondary)


def _model_device(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _retarget(user_opt: torch.optim.Optimizer, master_of: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    """The user's optimizer over the master shards: the same object, with the same class, groups and
    hyper-parameters, its groups now holding the masters (Note [the client's optimizer]).

    ``master_of`` maps ``id(model parameter)`` to its fp32 master shard; parameters without one are frozen.
    """
    cls = type(user_opt)
    # `defaults` can hold bookkeeping keys the constructor does not take (torch 2.13's AdamW records
    # `decoupled_weight_decay`); only the constructor's own arguments are passed back to it.
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    groups = []
    for group in user_opt.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [master_of[id(p)] for p in group["params"] if id(p) in master_of]
        groups.append(g)
    rebuilt = cls(groups, **{k: v for k, v in user_opt.defaults.items() if k in accepted})
    for key, value in vars(rebuilt).items():
        if key.startswith("_optimizer_") and key.endswith("_hooks") and getattr(user_opt, key, None):
            continue  # hooks the user registered on the optimizer stay
        setattr(user_opt, key, value)
    return user_opt


# Note [the client's optimizer]: an optimizer given to initialize is the engine's optimizer from then on, the caller's
# object itself, as DeepSpeed's (its ZeRO optimizer steps the client's optimizer over fp32 partitions; at stage 0
# it is the client's optimizer). It is built again over the masters, with its class's own constructor (which may
# derive state from the parameters it is given), and that object's attributes are moved into the caller's: groups,
# state and whatever the constructor set; hooks the caller registered stay, a scheduler built over it keeps
# working. Any state from before (a step taken on the unpartitioned model) is dropped.


def build(
    model: nn.Module,
    *,
    config: Union[str, os.PathLike, dict, ZeroppConfig, None] = None,
    optimizer: Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer], None] = None,
    model_parameters: Optional[Iterable[torch.Tensor]] = None,
    lr_scheduler: Any = None,
    param_init_fn: Optional[Callable[[nn.Module], None]] = None,
    engine_class: type[ZeroEngine] = ZeroEngine,
) -> ZeroEngine:
    """Partition ``model`` over the data-parallel ranks and return the engine that trains it (collective).

    The native entry point; :func:`zeropp.initialize` takes DeepSpeed's arguments and returns this engine with
    DeepSpeed's accessors. The engine's optimizer is ``engine.master_optimizer`` and its scheduler
    ``engine.lr_scheduler``; checkpoints are the functions of :mod:`zeropp.checkpoint`.

    Args:
        model: an unchanged ``nn.Module``; its parameters are sharded in place (each rank keeps its chunk).
        config: a DeepSpeed-style JSON path or dict (or a parsed :class:`ZeroppConfig`). Hugging Face's
            ``"auto"`` values are resolved from the model and the arguments where they can be
            (see :mod:`zeropp.config.auto`).
        optimizer: a torch optimizer built over ``model``'s parameters (the same object then steps the fp32 master
            shards, with its class, groups and hyper-parameters: Note [the client's optimizer]), or a callable
            ``params -> optimizer``; default: the config's ``optimizer`` section.
        model_parameters: the parameters to train; others are kept frozen (default: all of them).
        lr_scheduler: a callable ``optimizer -> scheduler``, or a scheduler built over ``optimizer`` (it is
            pointed at the engine's optimizer: the same object when it was built over the one given); default: the
            config's ``scheduler`` section.
        param_init_fn: for a model built under ``torch.device("meta")`` (or ``zeropp.zero.Init``): called on
            each module once its parameters exist on the host (default: ``module.reset_parameters()``);
            parameters are created, initialized and sharded a unit at a time, so no rank ever holds the
            whole model.
        engine_class: the engine's class (a subclass of :class:`ZeroEngine` adds an API over it).
    """
    model, compiled_call = compiled_regions.unwrap(model)  # torch.compile(model): names stay the model's
    _refuse_held(model)
    known = AutoValues(hidden_size=_hidden_size(model), client_optimizer=optimizer is not None,
                       client_scheduler=lr_scheduler is not None)
    cfg = load_config(config if config is not None else {}, known)
    if "activation_checkpointing" in cfg.model_fields_set:  # the section given: its settings apply (see
        checkpointing.apply_config(cfg)                      # docs/config.md, activation_checkpointing)
    if param_init_fn is None and callable(getattr(model, "_init_weights", None)):
        param_init_fn = model._init_weights  # a Hugging Face model initializes each submodule with this
    timeout = datetime.timedelta(seconds=cfg.comm_timeout_s)
    topo_mod.ensure_process_group(timeout=timeout)
    zero = cfg.zero_optimization
    topo = topo_mod.build(cfg.topology.ranks_per_node, zero.zero_hpz_partition_size, timeout=timeout)
    crash_report.install(topo.rank, topo.world_size)  # Note [crash report]: a fatal signal names this rank
    ledger = CommLedger()
    comm = Comm(topo, ledger)
    policy = resolve(cfg, topo.world_size, model)
    compute_dtype, offload = policy.compute_dtype, policy.offload_optimizer
    trainable = {id(p) for p in model_parameters} if model_parameters is not None else None
    make_optimizer = _optimizer_factory(optimizer, dict(model.named_parameters()), cfg, policy)
    _mark_leaves(model, policy)
    # NVMe files are created and their space reserved now: a bad path fails before any work
    residency = build_residency(policy.offload, model, StagePlan(policy.stage).shard_world(topo.world_size),
                                compute_dtype, topo.rank)
    try:
        link = build_link(_model_device(model), offload or policy.offload_param, policy.pin_memory)
        with init_context.paused():  # built inside zero.Init: the engine is not a module being built
            engine = engine_class(
                model, topo, ledger, build_strategies(policy, comm), policy, make_optimizer,
                make_scheduler=_scheduler_factory(lr_scheduler, lambda opt: build_scheduler(cfg.scheduler, opt)),
                trainable=trainable,
                config=cfg,
                param_init_fn=param_init_fn,
                residency=residency,
                link=link,
                compiled_call=compiled_call,
            )
    except BaseException:
        residency.close()  # no offload file outlives a failed start
        raise
    if cfg.compile.enabled:  # the config's compile section: compile at the start
        engine.compile(cfg.compile.backend, cfg.compile.kwargs)
    checkpointing.attach(comm)  # partition_activations "node" splits checkpoints over this engine's nodes
    return engine


def _refuse_held(model: nn.Module) -> None:
    """Never two engines over one parameter's storage: a parameter that a live engine manages is refused by name."""
    managed = gathered.managed_ids()
    held = [name for name, p in model.named_parameters() if id(p) in managed] if managed else []
    if held:
        raise ValueError(f"build: parameter {held[0]!r} (and {len(held) - 1} more) is managed by a live engine; two "
                         "engines would each write its storage. Give the model back first (engine.unpartition(), "
                         "DeepSpeed's engine.destroy()), or build the new engine on another model")


def _optimizer_factory(optimizer: Any, named: dict[str, nn.Parameter], cfg: ZeroppConfig,
                       policy: TrainPolicy) -> Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer]:
    """``masters -> optimizer`` over the fp32 master shards: the caller's optimizer retargeted, the caller's
    callable, or the config's section (masters are named after the parameter they shard)."""

    def make_optimizer(masters: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            return _retarget(optimizer, {id(named[name]): t for name, t in masters})
        # A model with nothing to train (RLHF's frozen reference or reward model, a distillation teacher): one
        # empty group, so that torch accepts it and step() and checkpoints run and change nothing.
        tensors: list = [t for _, t in masters] or [{"params": []}]
        if callable(optimizer):
            return optimizer(tensors)
        # A delayed update runs beside the next forward/backward: leave it half the cores.
        dpu_threads = max(1, torch.get_num_threads() // 2) if policy.delayed_update_after is not None else None
        return build_optimizer(cfg.optimizer, tensors, host_adam=policy.offload_optimizer, threads=dpu_threads)

    return make_optimizer


def _mark_leaves(model: nn.Module, policy: TrainPolicy) -> None:
    """The config's leaf modules (``zero_optimization.leaf_module``): each gathered whole with its subtree."""
    leaf = policy.leaves
    found = {name for name, mod in model.named_modules() if mod in mark_leaves(model, leaf.classes, leaf.names,
                                                                                 leaf.name_suffixes)}
    missing = [n for n in leaf.names if n not in found]
    missing += [s for s in leaf.name_suffixes if not any(n.endswith(s) for n in found)]
    if missing:
        warnings.warn(f"zero_optimization.leaf_module: no module of the model is named {missing}", stacklevel=3)
    threshold = leaf.granularity_threshold
    if threshold and policy.stage == 3:
        leaves = granular_leaves(model, threshold)
        for module in leaves:
            set_leaf(module)
        if not leaves:  # DeepSpeed warns too: the key changes nothing for this model
            finest = min(granularities(model).values(), default=float("inf"))
            warnings.warn(f"zero_optimization.stage3_module_granularity_threshold: {threshold} is under every "
                          f"module's granularity (the smallest is {finest}), so no module becomes a leaf",
                          stacklevel=3)


def _hidden_size(model: nn.Module) -> Optional[int]:
    """A Hugging Face model's ``config.hidden_size`` (what the Trainer sizes "auto" buckets from), else None."""
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _scheduler_factory(lr_scheduler: Any, config_scheduler: Callable[[torch.optim.Optimizer], Any]) -> Callable:
    """``optimizer -> scheduler``: the caller's callable, the caller's scheduler pointed at the engine's optimizer
    (the caller's own object when the scheduler was built over it; its groups carry the same keys, ``initial_lr``
    included), or the config's section."""
    if lr_scheduler is None:
        return config_scheduler
    if hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "optimizer"):
        def move(opt: torch.optim.Optimizer) -> Any:
            lr_scheduler.optimizer = opt
            return lr_scheduler
        return move
    if callable(lr_scheduler):
        return lr_scheduler
    raise TypeError(f"initialize: lr_scheduler must be a scheduler or a callable optimizer -> scheduler, got "
                    f"{type(lr_scheduler).__name__}")
