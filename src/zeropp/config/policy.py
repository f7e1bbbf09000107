"""The engine's policy: the config settled against the world and the model, once (:func:`resolve`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from zeropp.zero.loss_scaler import LossScaler


@dataclass(frozen=True)
class StagePlan:
    """What one ZeRO stage partitions (ZeRO, Rajbhandari et al. 2020, section 5: P_os, P_os+g, P_os+g+p)."""

    stage: int

    @property
    def shards_optimizer(self) -> bool:
        """Stages 1-3: fp32 masters and optimizer state are cut over the world (stage 0: a group of one)."""
        return self.stage >= 1

    @property
    def reduces_as_ready(self) -> bool:
        """Stages 2-3: gradients are reduced into shards while backward runs, not kept whole until the step."""
        return self.stage >= 2

    @property
    def shards_weights(self) -> bool:
        """Stage 3: full weights exist only around each module's forward and backward."""
        return self.stage == 3


@dataclass(frozen=True)
class TrainPolicy:
    """The numeric settings of a training step."""

    compute_dtype: torch.dtype = torch.float32
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    reduce_bucket_size: Optional[int] = None  # 16-bit gradient elements in buckets; None: sized from the model
    stage: int = 3
    loss_scaler: Optional[LossScaler] = None  # fp16 only
    delayed_update_after: Optional[int] = None  # DPU: optimizer steps before updates run in the background
    offload_optimizer: bool = False  # fp32 masters, optimizer state and gradient rows on the host
    offload_param: bool = False  # stage 3's 16-bit shards on the host (or on NVMe through the residency)
    gather_granularity: str = "block"  # stage 3 units: one per block (ModuleList child) or per module
    prefetch_bucket_size: int = 50_000_000  # stage 3: most elements one prefetch may gather (0: none)
    max_live_parameters: int = 1_000_000_000  # stage 3: gathered + in-flight elements a prefetch may reach
    persistence_threshold: int = 0  # stage 3: units this small stay gathered until the step (Note [persistent units])
    model_persistence_threshold: int = 2**63 - 1  # stage 3: the most elements persistent units hold together
    broadcast_rank0: bool = True  # take rank 0's weights at construction (Note [one model at initialize])
    grad_predivide: float = 1.0  # gradients divided by this before the reduction (DeepSpeed's predivide factor)
    grad_sum: bool = False  # the step uses the ranks' summed gradient instead of their mean
    ignore_unused_parameters: bool = True  # stages 1-2, False: a trainable parameter without gradient raises
    sanity_checks: bool = False  # any write in a read-only GatheredParameters raises, not only a changed value
