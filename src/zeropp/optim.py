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

Schedules are DeepSpeed's five (deepspeed/runtime/lr_schedules.py): WarmupLR, WarmupDecayLR, WarmupCosineLR,
OneCycle (with its momentum cycle) and LRRangeTest, with DeepSpeed's formulas, arguments, defaults and protocol
(`last_batch_iteration`, `step()`, `get_lr()`, `get_last_lr()`, `state_dict()`; see `Schedule`). They are also
`deepspeed.runtime.lr_schedules`'s classes. Call `scheduler.step()` once after each optimizer step (the engine
does for the config's and for one handed to `initialize`).
"""

from __future__ import annotations

import abc
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from zeropp.config.schema import AdamOptimizerConfig, AdamParams, OptimizerConfig, SGDOptimizerConfig
from zeropp.config.scheduler import (
    LRRangeTestConfig,
    OneCycleConfig,
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupDecayLRConfig,
    WarmupLRConfig,
)
from zeropp.config.loader import ConfigError, NotSupportedError

__all__ = [
    "build_optimizer", "build_scheduler", "default_optimizer_config", "UncorrectedAdam", "Schedule", "WarmupLR",
    "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "warmup_fraction", "driven_optimizer",
    "per_group", "write_lrs", "WARMUP_TYPES",
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
# The five schedules follow DeepSpeed's protocol (deepspeed/runtime/lr_schedules.py), not torch's LRScheduler:
# `last_batch_iteration` is the index of the last step taken (-1 before the first), `step()` advances it and
# writes the lr of the new index into the optimizer, `get_lr()` is the lr at the current index, and
# `state_dict()` is `{"last_batch_iteration": n}`. Each formula is evaluated in DeepSpeed's order of
# operations, so the values are DeepSpeed's to the last bit (tests/unit/test_lr_schedules.py holds
# DeepSpeed 0.19.8's own values).
WARMUP_TYPES = ("log", "linear")


def warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup curve at `iteration` (>= 0): 0 at the start, rising towards 1 at `warmup_steps`.

    "log": log(iteration + 1) / log(warmup_steps); "linear": iteration / warmup_steps.
    """
    if warmup_type == "log":
        return 1.0 / math.log(warmup_steps) * math.log(iteration + 1)
    return iteration / warmup_steps


def driven_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer a schedule writes to: `optimizer`, or the one a wrapper holds as `.optimizer` (a ZeRO
    optimizer view, accelerate's AcceleratedOptimizer), as DeepSpeed unwraps it."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer (nor holds one as .optimizer)")


def per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    """`value` for every param group: a number broadcast, or a list/tuple with one per group (checked)."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name}: expected {groups} values (one per param group), got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * groups


def write_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> list[float]:
    """Set each group's lr; a tensor lr is filled in place, since its owner may hold it (as DeepSpeed does)."""
    for group, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return list(lrs)


def _warmup_type(warmup_type: str) -> str:
    """DeepSpeed's rule for an unknown curve: warn and warm up on the log curve (the config refuses it)."""
    if warmup_type in WARMUP_TYPES:
        return warmup_type
    warnings.warn(f"unknown warmup_type {warmup_type!r}: warming up on the 'log' curve (DeepSpeed's default)",
                  stacklevel=3)
    return "log"


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class Schedule(abc.ABC):
    """A learning-rate schedule over a torch optimizer, in DeepSpeed's protocol.

    `last_batch_iteration` is the index of the last step taken: -1 before the first `step()`. Constructed at
    -1, a schedule writes its starting lr into the optimizer; constructed at another index (a resumed run) it
    leaves the optimizer alone until the first `step()`. Call `step()` once after every optimizer step.
    """

    def __init__(self, optimizer: Any, last_batch_iteration: int = -1) -> None:
        self.optimizer = driven_optimizer(optimizer)
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr: list[float] | None = None

    @abc.abstractmethod
    def lr_at(self, iteration: int) -> list[float]:
        """Every group's lr at `last_batch_iteration == iteration` (-1: before the first step)."""

    def get_lr(self) -> list[float]:
        """The lr of every group at the current `last_batch_iteration`."""
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lr this schedule last wrote. Before any, AssertionError "need to call step() first", DeepSpeed's
        error, which transformers' Trainer catches by its text."""
        if self._last_lr is None:
            raise AssertionError("need to call step() first")
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to `last_batch_iteration` (default: the next index) and write its lr into the optimizer."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else int(last_batch_iteration)
        self._apply()

    def _apply(self) -> None:
        self._last_lr = write_lrs(self.optimizer, self.get_lr())

    @property
    def last_epoch(self) -> int:
        """torch's name: how many `step()` calls a schedule started at -1 has had (`last_batch_iteration + 1`)."""
        return self.last_batch_iteration + 1

    def state_dict(self) -> dict[str, int]:
        """`{"last_batch_iteration": n}`, DeepSpeed's scheduler state."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position, as DeepSpeed does: the optimizer's lr comes back with the optimizer's own state,
        and the next `step()` writes the next one. Reads the torch-style state that zeropp saved before
        (`last_epoch`) too."""
        if "last_batch_iteration" in state:
            self.last_batch_iteration = int(state["last_batch_iteration"])
        elif "last_epoch" in state:
            self.last_batch_iteration = int(state["last_epoch"]) - 1
        else:
            raise KeyError(f"{type(self).__name__}.load_state_dict: no 'last_batch_iteration' in {sorted(state)}")


class WarmupLR(Schedule):
    """DeepSpeed's WarmupLR: from `warmup_min_lr` up to `warmup_max_lr` over `warmup_num_steps`, then hold.

    With n = max(2, warmup_num_steps): lr(i) = min + (max - min) * w(i) for i < n (`warmup_fraction`), then
    max; lr(-1) = min. `warmup_max_lr=None` takes each group's lr; the lrs may be per-group lists.
    """

    def __init__(self, optimizer: Any, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        _positive_int(warmup_num_steps, "warmup_num_steps")
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)  # the log curve divides by log(n)
        self.warmup_type = _warmup_type(warmup_type)
        if self.last_batch_iteration == -1:
            self._apply()

    def _gamma(self, iteration: int) -> float:
        """Fraction of the way from the min to the max lr at `iteration` (>= 0)."""
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR, then linear decay back to `warmup_min_lr` at `total_num_steps`.

    After warmup gamma(i) = max(0, (total - i) / max(1, total - n)).
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}",
                          stacklevel=2)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return max(0.0, float(self.total_num_steps - iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(Schedule):
    """DeepSpeed's WarmupCosineLR: lr = the group's lr at construction * ratio.

    The ratio warms up from `warmup_min_ratio` to 1 over n = max(2, `warmup_num_steps`) steps, then follows
    half a cosine down to `cos_min_ratio` at `total_num_steps` and stays there. Before the first step it is 0.
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        _positive_int(warmup_num_steps, "warmup_num_steps")
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}",
                          stacklevel=2)
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        if self.last_batch_iteration == -1:
            self._apply()

    def ratio_at(self, iteration: int) -> float:
        """The multiplier of the groups' lr at `iteration`."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            ratio = warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + ratio * (1. - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        # clamped: past total_num_steps the ratio stays at cos_min_ratio instead of rising again
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * cosine)

    def get_lr_ratio(self) -> float:
        """The multiplier at the current `last_batch_iteration` (DeepSpeed's name)."""
        return self.ratio_at(self.last_batch_iteration)

    def lr_at(self, iteration: int) -> list[float]:
        ratio = self.ratio_at(iteration)
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(Schedule):
    """DeepSpeed's LRRangeTest: the lr grows from `lr_range_test_min_lr` to find the largest that still trains
    (Smith, arXiv 1803.09820): lr(i) = min_lr * (1 + step_rate * u(i)), with u(i) = (i + 1) / step_size, or
    its floor when `lr_range_test_staircase`."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if self.last_batch_iteration == -1:
            self._last_lr = write_lrs(self.optimizer, self.min_lr)

    def lr_at(self, iteration: int) -> list[float]:
        interval = float(iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [lr * increase for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance to `batch_iteration` (default: the next index) and write its lr (DeepSpeed's argument name)."""
        super().step(batch_iteration)


class OneCycle(Schedule):
    """DeepSpeed's OneCycle (1Cycle, Smith, arXiv 1803.09820): one cycle of the lr, from `cycle_min_lr` up to
    `cycle_max_lr` over `cycle_first_step_size` steps and back over `cycle_second_step_size`, then a decay.

    In the cycle, with b = i + 1 and x the fraction of the cycle b has run: scale = x / r on the way up (r the
    first half's share of the cycle), (x - 1) / (r - 1) on the way down; lr = min + (max - min) * scale. A
    stair count k > 0 holds the scale on floor(k * position in the half) / k. After the cycle, d = i - cycle + 1
    steps on: lr = min / (1 + decay_lr_rate * d / decay_step_size) (no decay when either is 0).

    With `cycle_momentum` (and an optimizer with betas) each group's betas become (m, 0.99), DeepSpeed's fixed
    beta2: m = max_mom - (max_mom - min_mom) * scale in the cycle, then max_mom * (1 + decay_mom_rate * d /
    decay_step_size). Construction at -1 sets the lr to `cycle_min_lr` and beta1 to `cycle_min_mom` (while
    the cycle's start is `cycle_max_mom`, as in DeepSpeed); `get_last_lr()` is there after the first `step()`.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: float | list[float], cycle_max_lr: float | list[float],
                 decay_lr_rate: float = 0., cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float | list[float] = 0.8,
                 cycle_max_mom: float | list[float] = 0.9, decay_mom_rate: float = 0.,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:  # the scale divides by the first half's share of the cycle
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_step_size == 0 or decay_lr_rate == 0
        self.skip_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
        self.decay_mom_rate = decay_mom_rate
        self.cycle_momentum = bool(cycle_momentum) and self._has_betas()
        self.min_moms: list[tuple[float, float]] = []
        self.max_moms: list[tuple[float, float]] = []
        if self.cycle_momentum:  # DeepSpeed pairs every cycled beta1 with beta2 0.99, whatever the optimizer's
            self.min_moms = [(m, 0.99) for m in per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")]
        if self.last_batch_iteration == -1:
            write_lrs(self.optimizer, self.min_lrs)
            if self.cycle_momentum:
                self._write_betas(self.min_moms)

    def _has_betas(self) -> bool:
        if "betas" in self.optimizer.defaults:
            return True
        warnings.warn(f"OneCycle: cycle_momentum is off: {type(self.optimizer).__name__} has no betas",
                      stacklevel=3)
        return False

    def scale_at(self, iteration: int) -> float:
        """How far up the cycle (0 at min lr, 1 at max lr) `iteration` is, for an iteration in the cycle."""
        batch = iteration + 1
        x = 1. + batch / self.total_size - math.floor(1 + batch / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # from the integer position, not from `scale`: at a half's end the float scale can fall 1e-16 short
            # of a stair and its floor would drop a whole stair (DeepSpeed's fix)
            at = batch % self.total_size
            if at <= self.first_step_size:
                position = at * stairs / self.first_step_size
            else:
                position = (self.total_size - at) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self.scale_at(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def mom_at(self, iteration: int) -> list[tuple[float, float]] | None:
        """Every group's betas at `iteration`; None without `cycle_momentum`."""
        if not self.cycle_momentum:
            return None
        if iteration < self.total_size:
            scale = self.scale_at(iteration)
            return [(hi - (hi - lo) * scale, low_b2) for (lo, low_b2), (hi, _) in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [(hi * factor, b2) for hi, b2 in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The betas at the current `last_batch_iteration` (None without `cycle_momentum`)."""
        return self.mom_at(self.last_batch_iteration)

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance to `batch_iteration` (default: the next index); write its lr and betas (DeepSpeed's name)."""
        super().step(batch_iteration)

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            self._write_betas(self.get_mom())

    def _write_betas(self, betas: list[tuple[float, float]]) -> None:
        for group, pair in zip(self.optimizer.param_groups, betas):
            group["betas"] = pair


_SCHEDULES: dict[type, type[Schedule]] = {
    WarmupLRConfig: WarmupLR, WarmupDecayLRConfig: WarmupDecayLR, WarmupCosineLRConfig: WarmupCosineLR,
    OneCycleConfig: OneCycle, LRRangeTestConfig: LRRangeTest,
}


def build_scheduler(cfg: SchedulerConfig | None, optimizer: torch.optim.Optimizer) -> Schedule | None:
    """The schedule `cfg` describes, driving `optimizer`; None when `cfg` is None (constant lr).

    Its parameters are DeepSpeed's keyword arguments, as DeepSpeed passes `scheduler.params` to the class. A
    per-group list whose length is not the optimizer's number of param groups raises `ConfigError` naming it.
    """
    if cfg is None:
        return None
    schedule = _SCHEDULES.get(type(cfg))
    if schedule is None:
        raise NotSupportedError(f"scheduler.type: not supported yet: {cfg.type!r}; accepted: "
                                + ", ".join(t.__name__ for t in _SCHEDULES.values()))
    groups = len(driven_optimizer(optimizer).param_groups)
    kwargs = {}
    for key, value in cfg.params.model_dump().items():
        if isinstance(value, tuple):
            if len(value) != groups:
                raise ConfigError(f"scheduler.params.{key}: {len(value)} values for {groups} optimizer param "
                                  f"groups; accepted: a number, or a list of {groups}")
            value = list(value)
        kwargs[key] = value
    return schedule(optimizer, **kwargs)
