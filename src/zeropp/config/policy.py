"""The engine's policy: the config settled against the world and the model, once (:func:`resolve`).

The engine and its reports read :class:`TrainPolicy`, never the raw config: every default that depends on the
world or the model (the batch split, the reduce bucket size, the pre-division of ``prescale_gradients``) and
every derived switch is decided here. A new key is read in ``schema.py``, settled here, and used by the part it
concerns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from zeropp.config.loader import ZeroppConfig
from zeropp.config.schema import DEFAULT_LEAF_CLASSES, ZeroConfig
from zeropp.partition.spec import ShardSpec


# How large gradient buckets are: the default ``reduce_bucket_size`` and what it bounds.
#
# Note [bucket size]: ``reduce_bucket_size`` counts elements of the 16-bit gradient held in buckets at once, as
# DeepSpeed's does (its one bucket of that many elements costs 2 bytes each). The engine keeps
# ``BUCKETS_IN_FLIGHT`` buckets (one reducing while backward fills the next), so each holds at most half of it;
# a bucket is flushed before a gradient would overflow it, and only a parameter larger than half the setting
# is reduced on its own, in a bucket of its size. So the gradient buckets take at most
# ``2 B x max(reduce_bucket_size, 2 x the largest parameter)``. At stages 0-2, while gradients arrive out of the
# bucket layout's order (a rank that skipped a module, the first step of a model whose parameters are not in
# backward order), the buckets after an incomplete one are held until it completes or backward ends: at most
# the whole 16-bit gradient, what stage 1 holds (Note [positional buckets] in ``zero/buckets.py``).
#
# Left unset, the size follows the model: a quarter of its trainable elements (about eight buckets per
# backward, so the reduction of the first overlaps the rest of backward even on a small model), at least
# ``DEFAULT_FLOOR`` (a bucket smaller than half a million elements pays more in per-collective latency than it
# gains in overlap: docs/benchmarks.md, "Default buckets") and at most ``DEFAULT_CAP`` (400 MB of 16-bit
# gradient, against the 1 GB DeepSpeed's default of 5e8 costs). With a world of one rank nothing is reduced
# and no bucket exists (``GradBuckets.direct``); under optimizer offload from a separate device, up to one
# bucket's capacity of gradients waits there for its copy to the host (Note [direct downloads] in zero/buckets.py).
BUCKETS_IN_FLIGHT = 2  # one bucket reducing while backward fills the next (zero/buckets.py)
DEFAULT_BUCKETS_PER_BACKWARD = 8
DEFAULT_FLOOR = 1_000_000
DEFAULT_CAP = 200_000_000


def default_reduce_bucket_size(trainable_elements: int) -> int:
    """``reduce_bucket_size`` when the config leaves it out (Note [bucket size])."""
    share = -(-trainable_elements * BUCKETS_IN_FLIGHT // DEFAULT_BUCKETS_PER_BACKWARD)
    return min(DEFAULT_CAP, max(DEFAULT_FLOOR, share))


def bucket_capacity(reduce_bucket_size: int) -> int:
    """Padded elements one bucket is flushed at: its share of the buckets in flight."""
    return reduce_bucket_size // BUCKETS_IN_FLIGHT


def largest_bucket(reduce_bucket_size: int, largest_parameter: int) -> int:
    """Elements of the largest bucket: the capacity, or a larger parameter reduced alone."""
    return max(bucket_capacity(reduce_bucket_size), largest_parameter)


@dataclass(frozen=True)
class StagePlan:
    """What one ZeRO stage partitions (ZeRO, Rajbhandari et al. 2020, section 5: P_os, P_os+g, P_os+g+p)."""

    stage: int

    @property
    def shards_optimizer(self) -> bool:
        """Stages 1-3: fp32 masters and optimizer state are cut over the world (stage 0: a group of one)."""
        return self.stage >= 1

    def shard_world(self, world_size: int) -> int:
        """Ranks the fp32 masters and optimizer state are cut over: the world, or one rank at stage 0."""
        return world_size if self.shards_optimizer else 1

    @property
    def reduces_as_ready(self) -> bool:
        """Stages 2-3: gradients are reduced into shards while backward runs, not kept whole until the step."""
        return self.stage >= 2

    @property
    def shards_weights(self) -> bool:
        """Stage 3: full weights exist only around each module's forward and backward."""
        return self.stage == 3


@dataclass(frozen=True)
class LossScaling:
    """fp16's loss scale: fixed (``loss_scale`` > 0) or dynamic from ``2 ** initial_scale_power``."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0


@dataclass(frozen=True)
class Loco:
    """LoCo error feedback for qgZ (``zeropp_loco_param``)."""

    err_beta: float = 0.8
    reset_t: int = 1024


@dataclass(frozen=True)
class CommSettings:
    """Which gather and reduce strategies ``zeropp.api.build_strategies`` picks: ZeRO++ and the plain reduction."""

    quantized_weights: bool = False  # qwZ (zero_quantized_weights)
    weight_bits: int = 8
    block_size: int = 2048  # elements per quantization block (quantization_block_size)
    hpz_partition_size: int = 1  # hpZ's secondary group (zero_hpz_partition_size); 1: off
    quantized_gradients: bool = False  # qgZ (zero_quantized_gradients)
    gradient_bits: int = 4
    loco: Optional[Loco] = None  # LoCo error feedback for qgZ
    reduce_scatter: bool = True  # gradients reduce-scattered (else all-reduced, each rank keeping its row)
    quantized_frozen_weights: bool = False  # zero_quantized_nontrainable_weights


@dataclass(frozen=True)
class NvmeFile:
    """A per-rank NVMe offload file's directory and its in-memory buffers."""

    path: str
    key: str  # the config key that named the path, for errors
    buffer_count: int
    buffer_size: int = 0  # elements per buffer (parameters only)


@dataclass(frozen=True)
class OffloadSettings:
    """Where model states wait (``zeropp.offload.residency.build_residency``): host step, NVMe files."""

    host_step: bool = False  # offload_optimizer.device "cpu": the step on the host, in groups
    sub_group_size: int = 1_000_000_000  # elements per host step group
    optimizer_nvme: Optional[NvmeFile] = None  # offload_optimizer.device "nvme"
    param_nvme: Optional[NvmeFile] = None  # offload_param.device "nvme"


@dataclass(frozen=True)
class LeafSettings:
    """Modules gathered whole with their subtree (``leaf_module``, ``stage3_module_granularity_threshold``)."""

    classes: tuple[str, ...] = tuple(DEFAULT_LEAF_CLASSES)
    names: tuple[str, ...] = ()
    name_suffixes: tuple[str, ...] = ()
    granularity_threshold: int = 0  # stage 3: DeepSpeed's rule for marking leaves (0: off)


@dataclass(frozen=True, kw_only=True)
class TrainPolicy:
    """The settings of a training step, settled (:func:`resolve`). Defaults are the config schema's, but for
    ``reduce_bucket_size``, whose default follows the model (Note [bucket size])."""

    reduce_bucket_size: int  # 16-bit gradient elements in buckets (Note [bucket size])
    compute_dtype: torch.dtype = torch.float32
    gradient_accumulation_steps: int = 1
    micro_batch_per_rank: int = 1
    train_batch_size: int = 1  # samples per optimizer step over all ranks and accumulation steps
    gradient_clipping: float = 0.0
    stage: int = 0
    comm: CommSettings = CommSettings()  # the gather and reduce strategies
    offload: OffloadSettings = OffloadSettings()  # NVMe files and the host step's groups
    leaves: LeafSettings = LeafSettings()
    loss_scaling: Optional[LossScaling] = None  # fp16 only
    delayed_update_after: Optional[int] = None  # DPU: optimizer steps before updates run in the background
    offload_optimizer: bool = False  # fp32 masters, optimizer state and gradient rows on the host
    offload_param: bool = False  # stage 3's 16-bit shards on the host (or on NVMe through the residency)
    gather_granularity: str = "block"  # stage 3 units: one per block (ModuleList child) or per module
    prefetch_bucket_size: int = 50_000_000  # stage 3: most elements one prefetch may gather (0: none)
    max_live_parameters: int = 1_000_000_000  # stage 3: gathered + in-flight elements a prefetch may reach
    coalesced_prefetch: bool = True  # stage 3: small units gathered in groups (Note [gather groups])
    coalesced_prefetch_asked: bool = False  # set true in the config (initialize warns where it has no effect)
    persistence_threshold: int = 0  # stage 3: units this small stay gathered until the step (Note [persistent units])
    model_persistence_threshold: int = 2**63 - 1  # stage 3: the most elements persistent units hold together
    broadcast_rank0: bool = True  # take rank 0's weights at construction (Note [one model at initialize])
    grad_predivide: float = 1.0  # gradients divided by this before the reduction (DeepSpeed's predivide factor)
    grad_sum: bool = False  # the step uses the ranks' summed gradient instead of their mean
    ignore_unused_parameters: bool = True  # stages 1-2, False: a trainable parameter without gradient raises
    sanity_checks: bool = False  # any write in a read-only GatheredParameters raises, not only a changed value
    pin_memory: bool = False  # offloaded host rows page-locked
    print_every: int = 0  # wall_clock_breakdown: the time report printed every this many steps (0: never)


def resolve(cfg: ZeroppConfig, world_size: int, model: nn.Module) -> TrainPolicy:
    """The engine's policy for ``cfg`` on ``world_size`` ranks and ``model`` (collective-free, no side effect).

    Raises the config's errors for a batch split that does not fit the world (``ZeroppConfig.resolve_batch``).
    """
    zero = cfg.zero_optimization
    batch = cfg.resolve_batch(world_size)
    compute_dtype, loss_scaling = _precision(cfg)
    return TrainPolicy(
        compute_dtype=compute_dtype,
        gradient_accumulation_steps=batch.gradient_accumulation_steps,
        micro_batch_per_rank=batch.micro_batch_per_rank,
        train_batch_size=batch.train_batch_size,
        gradient_clipping=cfg.gradient_clipping,
        reduce_bucket_size=zero.reduce_bucket_size if zero.reduce_bucket_size is not None
        else default_reduce_bucket_size(_trainable_elements(model, StagePlan(zero.stage).shard_world(world_size))),
        stage=zero.stage,
        loss_scaling=loss_scaling,
        delayed_update_after=_delayed_update_after(zero),
        offload_optimizer=_offloads(zero.offload_optimizer),
        offload_param=_offloads(zero.offload_param),
        gather_granularity=zero.gather_granularity,
        prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
        max_live_parameters=zero.stage3_max_live_parameters,
        coalesced_prefetch=zero.zeropp_coalesced_prefetch,
        coalesced_prefetch_asked=zero.zeropp_coalesced_prefetch and
        "zeropp_coalesced_prefetch" in zero.model_fields_set,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        model_persistence_threshold=zero.stage3_model_persistence_threshold,
        broadcast_rank0=cfg.broadcast_rank0_weights,
        # prescale_gradients: the whole mean before the reduction (DeepSpeed divides by the world there)
        grad_predivide=float(world_size) if cfg.prescale_gradients else cfg.gradient_predivide_factor,
        grad_sum=cfg.gradient_allreduce_op == "sum",
        ignore_unused_parameters=zero.ignore_unused_parameters,
        sanity_checks=zero.enable_sanity_checks,
        pin_memory=any(_offloads(s) and s.pin_memory for s in (zero.offload_optimizer, zero.offload_param)),
        print_every=cfg.steps_per_print if cfg.wall_clock_breakdown else 0,
        comm=_comm_settings(zero),
        offload=_offload_settings(zero),
        leaves=LeafSettings(tuple(zero.leaf_module.classes), tuple(zero.leaf_module.names),
                            tuple(zero.leaf_module.name_suffixes), zero.stage3_module_granularity_threshold),
    )


def _comm_settings(zero: ZeroConfig) -> CommSettings:
    p = zero.zeropp_loco_param
    return CommSettings(
        quantized_weights=zero.zero_quantized_weights, weight_bits=zero.zero_quantized_weights_bits,
        block_size=zero.quantization_block_size, hpz_partition_size=zero.zero_hpz_partition_size,
        quantized_gradients=zero.zero_quantized_gradients, gradient_bits=zero.zero_quantized_gradients_bits,
        loco=Loco(p.err_beta, p.reset_T) if p is not None else None, reduce_scatter=zero.reduce_scatter,
        quantized_frozen_weights=zero.zero_quantized_nontrainable_weights)


def _offload_settings(zero: ZeroConfig) -> OffloadSettings:
    opt, par = zero.offload_optimizer, zero.offload_param
    opt_nvme = opt is not None and opt.device == "nvme"
    par_nvme = par is not None and par.device == "nvme"
    return OffloadSettings(
        host_step=opt is not None and opt.device == "cpu",
        sub_group_size=int(zero.sub_group_size or 0),
        optimizer_nvme=NvmeFile(opt.nvme_path, "zero_optimization.offload_optimizer.nvme_path", opt.buffer_count)
        if opt_nvme else None,
        param_nvme=NvmeFile(par.nvme_path, "zero_optimization.offload_param.nvme_path", par.buffer_count,
                            par.buffer_size) if par_nvme else None)


def _precision(cfg: ZeroppConfig) -> tuple[torch.dtype, Optional[LossScaling]]:
    """The compute dtype and, for fp16, its loss scaling."""
    if cfg.fp16.enabled:
        f = cfg.fp16
        return torch.float16, LossScaling(f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis,
                                          f.min_loss_scale)
    return (torch.bfloat16 if cfg.bf16.enabled else torch.float32), None


def _offloads(section: object) -> bool:
    return section is not None and getattr(section, "device") != "none"


def _delayed_update_after(zero: ZeroConfig) -> Optional[int]:
    """Optimizer steps before delayed parameter updates start, or None when DPU is off."""
    off = zero.offload_optimizer
    return off.delayed_update_warmup_steps if off is not None and off.delayed_update else None


def _trainable_elements(model: nn.Module, shard_world: int) -> int:
    """Padded elements of the trainable parameters (Note [shard layout]): what the default bucket follows."""
    return sum(ShardSpec(p.numel(), p.shape, shard_world).padded for p in model.parameters() if p.requires_grad)
