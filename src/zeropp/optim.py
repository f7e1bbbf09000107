"""Optimizer and learning-rate scheduler factories for the `optimizer` / `scheduler` config sections.

Optimizers are torch's (zeropp steps them on the fp32 master shard):

* `Adam`: DeepSpeed semantics. `adam_w_mode` defaults to true, so weight decay is *decoupled*
  (torch.optim.AdamW); `"adam_w_mode": false` gives L2-style decay (torch.optim.Adam).
* `AdamW`: always torch.optim.AdamW, whatever `adam_w_mode` says (as in DeepSpeed).
* `SGD`: torch.optim.SGD.
* no `optimizer` section: torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).

`weight_decay` defaults to 0.0 for Adam/AdamW, as DeepSpeed's FusedAdam does (torch's AdamW would use
0.01). DeepSpeed's `torch_adam` key is accepted and changes nothing: zeropp always uses torch's Adam. On a GPU,
with neither `fused` nor `foreach` set, it is torch's fused implementation (one kernel for the step, as
DeepSpeed's FusedAdam is its default there).

Schedulers reimplement DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR formulas
(deepspeed/runtime/lr_schedules.py) as `torch.optim.lr_scheduler.LRScheduler` subclasses. DeepSpeed
counts `last_batch_iteration` from -1 (its value at construction) while torch's `last_epoch` is already 0
after construction, so these classes evaluate DeepSpeed's formula at `last_batch_iteration =
last_epoch - 1`: after n calls to `step()` the lr equals DeepSpeed's after n calls to its `step()`.
Call `scheduler.step()` once after each optimizer step, as with DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from zeropp.config.schema import (
    AdamOptimizerConfig,
    AdamParams,
    OptimizerConfig,
    SchedulerConfig,
    SGDOptimizerConfig,
    WarmupCosineLRConfig,
    WarmupDecayLRConfig,
    WarmupLRConfig,
)
from zeropp.config.loader import NotSupportedError

__all__ = [
    "build_optimizer", "build_scheduler", "default_optimizer_config", "WarmupLR", "WarmupDecayLR",
    "WarmupCosineLR", "warmup_fraction", "UncorrectedAdam",
]

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]

# Keys that DeepSpeed reads itself and that torch's constructors do not take.
_NOT_TORCH_KEYS = {"torch_adam", "adam_w_mode", "bias_correction"}


# ------------------------------------------------------------------------------------------- optimizers
def default_optimizer_config() -> AdamOptimizerConfig:
    """The optimizer used when the config has no `optimizer` section: AdamW, lr 1e-3, no weight decay."""
    return AdamOptimizerConfig(type="AdamW", params=AdamParams())


def build_optimizer(cfg: OptimizerConfig | None, params: Params, host_adam: bool = False,
                    threads: int | None = None) -> torch.optim.Optimizer:
    """A torch optimizer over `params` (tensors or param-group dicts) as `cfg` describes.

    ``host_adam`` (optimizer offload): Adam/AdamW run as zeropp's `CpuAdam`, bit-identical to torch's and
    one pass over memory; ``threads`` caps its kernel threads (a delayed update leaves cores to compute).
    Raises `NotSupportedError` for a DeepSpeed-only optimizer type (e.g. Lamb).
    """
    cfg = cfg if cfg is not None else default_optimizer_config()
    if isinstance(cfg, AdamOptimizerConfig):
        return _build_adam(cfg, params, host_adam, threads)
    if isinstance(cfg, SGDOptimizerConfig):
        kwargs = cfg.params.model_dump(exclude_none=True)
        return torch.optim.SGD(params, **kwargs)
    raise NotSupportedError(f"optimizer.type: not supported yet: {cfg.type!r}; accepted: Adam, AdamW, SGD")


def _build_adam(cfg: AdamOptimizerConfig, params: Params, host_adam: bool = False,
                threads: int | None = None) -> torch.optim.Optimizer:
    """torch AdamW unless type is Adam with adam_w_mode false (DeepSpeed's rule); `CpuAdam` for offload;
    `UncorrectedAdam` for ``bias_correction: false``."""
    kwargs = cfg.params.model_dump(exclude=_NOT_TORCH_KEYS, exclude_none=True)
    decoupled = cfg.type == "AdamW" or cfg.params.adam_w_mode
    if not cfg.params.bias_correction:  # amsgrad/maximize with it are refused by config.check_supported
        for key in ("amsgrad", "maximize", "foreach", "fused"):
            kwargs.pop(key, None)
        # also under offload: CpuAdam's fused kernel always corrects; this runs on the host masters as they are
        return UncorrectedAdam(params, adamw=decoupled, **kwargs)
    if host_adam:
        from zeropp.offload.cpu_adam import CpuAdam  # builds its kernel on first use only

        for key in ("amsgrad", "maximize", "foreach", "fused"):  # the first two: refused by check_supported
            kwargs.pop(key, None)
        return CpuAdam(params, adamw=decoupled, threads=threads, **kwargs)
    params = [dict(p, params=[p["params"]] if isinstance(p["params"], torch.Tensor) else list(p["params"]))
              if isinstance(p, dict) else p for p in params]
    if "fused" not in kwargs and "foreach" not in kwargs and _all_cuda_float(params):
        # one kernel for the whole step, as DeepSpeed's FusedAdam on a GPU; torch's default (foreach) took
        # 23.6 ms a step on a 1.24B model's fp32 master on an H200, fused 10.1 ms
        kwargs["fused"] = True
    return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **kwargs)


def _all_cuda_float(params: list[Any]) -> bool:
    """Whether every tensor in ``params`` (tensors or param-group dicts) is a floating CUDA tensor."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return bool(tensors) and all(t.is_cuda and t.is_floating_point() for t in tensors)


class UncorrectedAdam(torch.optim.Optimizer):
    """Adam / AdamW without bias correction: DeepSpeed FusedAdam's ``bias_correction=False``.

    Per step: ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2``, then ``p -= lr * m /
    (sqrt(v) + eps)``, with no division of ``m`` and ``v`` by ``1 - beta**t`` (early steps are smaller than
    Adam's). Weight decay is decoupled (``p *= 1 - lr * wd``) when ``adamw``, else added to the gradient.
    ``state_dict()`` has torch's Adam layout (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints
    re-shard its moments as they do torch's (a checkpoint of another optimizer family does not load into it).
    """

    def __init__(self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw: bool = True) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"UncorrectedAdam: invalid lr={lr}, betas={betas}, eps={eps} or "
                             f"weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "adamw": adamw})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # torch's layout: a float32 0-dim step and two moment buffers
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                grad = p.grad
                if wd != 0:
                    if group["adamw"]:
                        p.mul_(1 - lr * wd)
                    else:
                        grad = grad.add(p, alpha=wd)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-lr)
        return loss


# ------------------------------------------------------------------------------------------- schedulers
def warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup curve, 0 at iteration 0 rising towards 1 at `warmup_steps`.

    "log": log(iteration + 1) / log(warmup_steps); "linear": iteration / warmup_steps.
    """
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


def _current_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each group's starting lr (its `initial_lr` when a scheduler already set one)."""
    return [float(group.get("initial_lr", group["lr"])) for group in optimizer.param_groups]


class _ConfigSchedule(LRScheduler):
    """Shared plumbing: `lr_at(i)` is DeepSpeed's lr at `last_batch_iteration == i`."""

    def lr_at(self, iteration: int) -> list[float]:
        """Learning rate of every param group at DeepSpeed iteration `iteration` (-1 = before any step)."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """The lr for the current `last_epoch` (DeepSpeed iteration `last_epoch - 1`)."""
        return self.lr_at(self.last_epoch - 1)

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()


class WarmupLR(_ConfigSchedule):
    """DeepSpeed's WarmupLR: from `warmup_min_lr` up to `warmup_max_lr` over `warmup_num_steps`, then hold.

    `warmup_max_lr=None` uses each group's lr. Fewer than 2 warmup steps are treated as 2 (DeepSpeed does
    too: log warmup divides by log(steps)).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log") -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        maxes = _current_lrs(optimizer) if warmup_max_lr is None else [warmup_max_lr] * len(
            optimizer.param_groups)
        self.min_lrs = [float(warmup_min_lr)] * len(optimizer.param_groups)
        self.max_lrs = [float(m) for m in maxes]
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    def _gamma(self, iteration: int) -> float:
        """Fraction of the way from min to max lr at `iteration` (>= 0)."""
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR, then linear decay back to `warmup_min_lr` at `total_num_steps`.

    After warmup gamma = max(0, (total - i) / max(1, total - warmup)).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log") -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_ConfigSchedule):
    """DeepSpeed's WarmupCosineLR: lr = group lr * ratio.

    The ratio warms up from `warmup_min_ratio` to 1 over `warmup_num_steps`, then follows half a cosine
    down to `cos_min_ratio` at `total_num_steps` and stays there. Before the first step the ratio is 0.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log") -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.peak_lrs = _current_lrs(optimizer)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    def ratio_at(self, iteration: int) -> float:
        """The multiplier of the groups' lr at DeepSpeed iteration `iteration`."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            frac = warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, iteration: int) -> list[float]:
        ratio = self.ratio_at(iteration)
        return [peak * ratio for peak in self.peak_lrs]


def build_scheduler(cfg: SchedulerConfig | None, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
    """The lr scheduler `cfg` describes, driving `optimizer`; None when `cfg` is None (constant lr).

    Raises `NotSupportedError` for a DeepSpeed-only type (OneCycle, LRRangeTest) or a
    `last_batch_iteration` other than -1.
    """
    if cfg is None:
        return None
    classes = {WarmupLRConfig: WarmupLR, WarmupDecayLRConfig: WarmupDecayLR, WarmupCosineLRConfig: WarmupCosineLR}
    schedule = classes.get(type(cfg))
    if schedule is None:
        raise NotSupportedError(f"scheduler.type: not supported yet: {cfg.type!r}; accepted: WarmupLR, "
                                "WarmupDecayLR, WarmupCosineLR")
    if cfg.params.last_batch_iteration != -1:
        raise NotSupportedError("scheduler.params.last_batch_iteration: not supported yet: "
                                f"{cfg.params.last_batch_iteration}; accepted: -1 (resume via state_dict)")
    return schedule(optimizer, **cfg.params.model_dump(exclude={"last_batch_iteration"}))
