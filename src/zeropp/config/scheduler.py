"""The `scheduler` section: DeepSpeed's five learning-rate schedules and their `params`, keys as DeepSpeed's.

Each `params` model holds the keyword arguments of its schedule's class (`zeropp.optim`, DeepSpeed's
`deepspeed/runtime/lr_schedules.py`), with DeepSpeed's defaults: DeepSpeed's engine passes `scheduler.params` to
the class as they are, and `zeropp.optim.build_scheduler` does the same. The lrs and momenta DeepSpeed takes per
param group may be lists. Kept apart from `schema.py` (whose field helpers it uses), which it would push past
the house's file length.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BeforeValidator, Discriminator, Tag, field_validator, model_validator

from zeropp.config.schema import (
    STATUS_NOT_YET,
    DSBool,
    DSInt,
    F,
    Number,
    Section,
    _show,
    _tagger,
    _typed_section_defaults,
    problem,
)

__all__ = [
    "SCHEDULER_TYPES", "SCHEDULER_TAGS", "AnySchedulerConfig", "SchedulerConfig", "WarmupLRConfig",
    "WarmupDecayLRConfig", "WarmupCosineLRConfig", "OneCycleConfig", "LRRangeTestConfig", "OtherSchedulerConfig",
    "WarmupLRParams", "WarmupDecayLRParams", "WarmupCosineLRParams", "OneCycleParams", "LRRangeTestParams",
]

SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
"""DeepSpeed's five schedules (deepspeed/runtime/lr_schedules.py), all built by `zeropp.optim.build_scheduler`."""


def _per_group(value: Any, below_one: bool = False) -> Any:
    """A number >= 0 (< 1 for a momentum), or a non-empty list of them, one per optimizer param group, as
    DeepSpeed's schedules take them; a list comes back as a tuple (sections are frozen)."""
    accepted = f"a number >= 0{' and < 1' if below_one else ''}, or a list of them (one per param group)"
    values = value if isinstance(value, list) else [value]
    if not values:
        raise problem("got an empty list", accepted)
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise problem(f"expected a number, got {_show(v)}", accepted)
        if v < 0 or (below_one and v >= 1):
            raise problem(f"got {_show(v)}", accepted)
        out.append(float(v))
    return tuple(out) if isinstance(value, list) else out[0]


PerGroupLR = Annotated[Union[float, tuple[float, ...]], BeforeValidator(_per_group)]
PerGroupMomentum = Annotated[Union[float, tuple[float, ...]], BeforeValidator(lambda v: _per_group(v, True))]
_LIST_DOC = " A list gives one value per optimizer param group."
_RESUME_DOC = ("DeepSpeed's resume index (the last step taken): -1 starts the schedule, setting the lr; another "
               "value leaves the lr until the first step(), which goes on from there.")


class WarmupLRParams(Section):
    """`scheduler.params` for WarmupLR: warm up from warmup_min_lr to warmup_max_lr, then hold."""

    warmup_min_lr: PerGroupLR = F(0.0, doc="Learning rate at the start of warmup." + _LIST_DOC)
    warmup_max_lr: PerGroupLR | None = F(None, doc="lr after warmup; null = the optimizer's." + _LIST_DOC)
    warmup_num_steps: DSInt = F(1000, ge=1, doc="Warmup length in steps (at least 2 is used).")
    warmup_type: Literal["log", "linear"] = F("log", doc="Warmup curve: log(i+1)/log(n) or i/n.")
    last_batch_iteration: DSInt = F(-1, ge=-1, doc=_RESUME_DOC)


class WarmupDecayLRParams(WarmupLRParams):
    """`scheduler.params` for WarmupDecayLR: WarmupLR, then linear decay back to warmup_min_lr."""

    total_num_steps: DSInt = F(ge=1, doc="Step at which the decay reaches warmup_min_lr (required).")
    warmup_max_lr: PerGroupLR = F(0.001, doc="Learning rate after warmup (DeepSpeed default 0.001)." + _LIST_DOC)


class WarmupCosineLRParams(Section):
    """`scheduler.params` for WarmupCosineLR: ratios of the optimizer's lr, warmup then cosine decay."""

    total_num_steps: DSInt = F(ge=1, doc="Step at which the cosine reaches cos_min_ratio (required).")
    warmup_min_ratio: Number = F(0.0, ge=0, doc="lr ratio at the start of warmup.")
    warmup_num_steps: DSInt = F(1000, ge=1, doc="Warmup length in steps (at least 2 is used).")
    cos_min_ratio: Number = F(0.0001, ge=0, doc="lr ratio at the end of the cosine decay.")
    warmup_type: Literal["log", "linear"] = F("log", doc="Warmup curve: log(i+1)/log(n) or i/n.")
    last_batch_iteration: DSInt = F(-1, ge=-1, doc=_RESUME_DOC)


class OneCycleParams(Section):
    """`scheduler.params` for OneCycle: one cycle of lr (and, inversely, Adam's beta1), then a slow decay."""

    cycle_min_lr: PerGroupLR = F(doc="Lowest lr of the cycle, where it starts and ends (required)." + _LIST_DOC)
    cycle_max_lr: PerGroupLR = F(doc="Highest lr of the cycle, at the end of its first half (required)." + _LIST_DOC)
    decay_lr_rate: Number = F(0.0, ge=0, doc="After the cycle: lr = cycle_min_lr / (1 + rate * d / step_size).")
    cycle_first_step_size: DSInt = F(2000, ge=1, doc="Steps of the cycle's first (rising lr) half.")
    cycle_second_step_size: DSInt | None = F(None, ge=0, doc="Steps of the falling half; null = the first's.")
    cycle_first_stair_count: DSInt = F(0, doc="Stairs over the first half (lr flat on each); <= 0: every step.")
    cycle_second_stair_count: DSInt | None = F(None, doc="Stairs over the second half; null = the first's.")
    decay_step_size: DSInt = F(0, ge=0, doc="step_size of the decays (d: steps since the cycle); 0: no decay.")
    cycle_momentum: DSBool = F(True, doc="Cycle the groups' betas as (beta1, 0.99), beta1 against the lr (an "
                               "optimizer without betas, e.g. SGD, is left alone with a warning).")
    cycle_min_mom: PerGroupMomentum = F(0.8, doc="beta1 at the lr's peak, and before the first step." + _LIST_DOC)
    cycle_max_mom: PerGroupMomentum = F(0.9, doc="beta1 at the cycle's start and end." + _LIST_DOC)
    decay_mom_rate: Number = F(0.0, ge=0, doc="After it: beta1 = cycle_max_mom * (1 + rate * d / step_size).")
    last_batch_iteration: DSInt = F(-1, ge=-1, doc=_RESUME_DOC)


class LRRangeTestParams(Section):
    """`scheduler.params` for LRRangeTest: lr grows from lr_range_test_min_lr, to find the largest that trains."""

    lr_range_test_min_lr: PerGroupLR = F(0.001, doc="lr at the start." + _LIST_DOC)
    lr_range_test_step_size: DSInt = F(2000, ge=1, doc="Steps per unit of increase (of step_rate * min_lr).")
    lr_range_test_step_rate: Number = F(1.0, ge=0, doc="Growth per unit, in units of lr_range_test_min_lr.")
    lr_range_test_staircase: DSBool = F(False, doc="Grow by whole stairs of step_size steps, not every step.")
    last_batch_iteration: DSInt = F(-1, ge=-1, doc=_RESUME_DOC)


class SchedulerConfig(Section):
    """`scheduler`: `{"type": ..., "params": {...}}` with DeepSpeed's scheduler and parameter names."""

    type: str = F(doc="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest.")
    params: Any = F(doc="Scheduler parameters; keys depend on the type.")
    known_types: ClassVar[tuple[str, ...]] = SCHEDULER_TYPES

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        return _typed_section_defaults(data, cls.known_types)


class WarmupLRConfig(SchedulerConfig):
    """`scheduler` with type WarmupLR."""

    type: Literal["WarmupLR"] = F(doc="WarmupLR.")
    params: WarmupLRParams = F(default_factory=WarmupLRParams, doc="WarmupLR parameters.")


class WarmupDecayLRConfig(SchedulerConfig):
    """`scheduler` with type WarmupDecayLR."""

    type: Literal["WarmupDecayLR"] = F(doc="WarmupDecayLR.")
    params: WarmupDecayLRParams = F(doc="WarmupDecayLR parameters.")


class WarmupCosineLRConfig(SchedulerConfig):
    """`scheduler` with type WarmupCosineLR."""

    type: Literal["WarmupCosineLR"] = F(doc="WarmupCosineLR.")
    params: WarmupCosineLRParams = F(doc="WarmupCosineLR parameters.")


class OneCycleConfig(SchedulerConfig):
    """`scheduler` with type OneCycle."""

    type: Literal["OneCycle"] = F(doc="OneCycle.")
    params: OneCycleParams = F(doc="OneCycle parameters.")


class LRRangeTestConfig(SchedulerConfig):
    """`scheduler` with type LRRangeTest."""

    type: Literal["LRRangeTest"] = F(doc="LRRangeTest.")
    params: LRRangeTestParams = F(default_factory=LRRangeTestParams, doc="LRRangeTest parameters.")


class OtherSchedulerConfig(SchedulerConfig):
    """`scheduler` whose type is none of DeepSpeed's schedules: always refused, naming `scheduler.type`."""

    type: str = F(doc="Not a schedule type (always refused).", status=STATUS_NOT_YET)
    params: dict[str, Any] = F(default_factory=dict, doc="Not validated.", status=STATUS_NOT_YET)

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        raise problem(f"unknown scheduler type {v!r}", ", ".join(SCHEDULER_TYPES))


# Pydantic puts the tag into error locations; `zeropp.config` drops it from the JSON paths it reports and maps it
# back to the model when it lists the accepted keys (as `schema.UNION_TAGS` for the optimizer).
SCHEDULER_TAGS: dict[str, type[Section]] = {
    "<WarmupLR>": WarmupLRConfig, "<WarmupDecayLR>": WarmupDecayLRConfig, "<WarmupCosineLR>": WarmupCosineLRConfig,
    "<OneCycle>": OneCycleConfig, "<LRRangeTest>": LRRangeTestConfig, "<scheduler>": OtherSchedulerConfig,
}
AnySchedulerConfig = Annotated[
    Union[tuple(Annotated[model, Tag(tag)] for tag, model in SCHEDULER_TAGS.items())],  # type: ignore[misc]
    Discriminator(_tagger({t.lower(): f"<{t}>" for t in SCHEDULER_TYPES}, "<scheduler>")),
]
