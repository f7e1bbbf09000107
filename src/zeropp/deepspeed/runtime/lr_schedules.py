"""``deepspeed.runtime.lr_schedules``: DeepSpeed's five learning-rate schedules and the module's helpers, as
DeepSpeed 0.19.8 has them.

The classes are zeropp's (``zeropp/optim.py``: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``,
``LRRangeTest``), with DeepSpeed's constructor signatures, formulas and protocol, so a script builds one over its
optimizer and hands it to ``deepspeed.initialize(..., lr_scheduler=sched)`` (zeropp moves it onto the optimizer it
rebuilds over its fp32 masters). ``VALID_LR_SCHEDULES`` names them (accelerate checks ``type(obj).__name__`` in it
for every object it prepares); the key-name constants, ``add_tuning_arguments`` (the command-line flags),
``get_config_from_args`` and ``get_lr_from_config`` behave as DeepSpeed's.
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

import torch

from zeropp.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, driven_optimizer

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"

CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"

CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"

TOTAL_NUM_STEPS = "total_num_steps"

__all__ = [
    "VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
    "add_tuning_arguments", "parse_arguments", "get_config_from_args", "get_lr_from_config", "override_params",
    "override_lr_range_test_params", "override_1cycle_params", "override_warmupLR_params",
    "override_warmupCosineLR_params", "update_lr", "get_torch_optimizer",
    "LR_SCHEDULE", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR",
    "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE", "LR_RANGE_TEST_STAIRCASE",
    "EDGE_VALUE", "MID_VALUE", "CYCLE_FIRST_STEP_SIZE", "CYCLE_FIRST_STAIR_COUNT", "CYCLE_SECOND_STEP_SIZE",
    "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE", "CYCLE_MIN_LR", "CYCLE_MAX_LR", "DECAY_LR_RATE",
    "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS",
    "WARMUP_TYPE", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO", "COS_MIN_RATIO",
    "TOTAL_NUM_STEPS",
]

# ---- command-line flags -----------------------------------------------------------------------------------------
#: (flag, argparse keywords, help) of DeepSpeed 0.19.8's add_tuning_arguments, in its order and with its defaults;
#: the defaults are the command line's, not the classes' (cycle_momentum is off here and on in OneCycle)
_FLAGS: tuple[tuple[str, dict[str, Any], str], ...] = (
    (LR_SCHEDULE, {"type": str, "default": None}, "the schedule to train with (one of VALID_LR_SCHEDULES)"),
    (LR_RANGE_TEST_MIN_LR, {"type": float, "default": 0.001}, "LRRangeTest: lr at the start"),
    (LR_RANGE_TEST_STEP_RATE, {"type": float, "default": 1.0}, "LRRangeTest: growth per step_size steps"),
    (LR_RANGE_TEST_STEP_SIZE, {"type": int, "default": 1000}, "LRRangeTest: steps per unit of growth"),
    (LR_RANGE_TEST_STAIRCASE, {"default": False, "action": "store_true"}, "LRRangeTest: grow by whole stairs"),
    (CYCLE_FIRST_STEP_SIZE, {"type": int, "default": 1000}, "OneCycle: steps of the rising half"),
    (CYCLE_FIRST_STAIR_COUNT, {"type": int, "default": -1}, "OneCycle: stairs of the rising half"),
    (CYCLE_SECOND_STEP_SIZE, {"type": int, "default": -1}, "OneCycle: steps of the falling half"),
    (CYCLE_SECOND_STAIR_COUNT, {"type": int, "default": -1}, "OneCycle: stairs of the falling half"),
    (DECAY_STEP_SIZE, {"type": int, "default": 1000}, "OneCycle: steps per unit of the post-cycle decay"),
    (CYCLE_MIN_LR, {"type": float, "default": 0.01}, "OneCycle: lowest lr"),
    (CYCLE_MAX_LR, {"type": float, "default": 0.1}, "OneCycle: highest lr"),
    (DECAY_LR_RATE, {"type": float, "default": 0.0}, "OneCycle: post-cycle lr decay rate"),
    ("cycle_momentum", {"default": False, "action": "store_true"}, "OneCycle: cycle the momentum too"),
    (CYCLE_MIN_MOM, {"type": float, "default": 0.8}, "OneCycle: lowest momentum"),
    (CYCLE_MAX_MOM, {"type": float, "default": 0.9}, "OneCycle: highest momentum"),
    (DECAY_MOM_RATE, {"type": float, "default": 0.0}, "OneCycle: post-cycle momentum decay rate"),
    (WARMUP_MIN_LR, {"type": float, "default": 0}, "WarmupLR: lr at the start of warmup"),
    (WARMUP_MAX_LR, {"type": float, "default": 0.001}, "WarmupLR: lr at the end of warmup"),
    (WARMUP_NUM_STEPS, {"type": int, "default": 1000}, "WarmupLR: warmup length in steps"),
    (WARMUP_TYPE, {"type": str, "default": WARMUP_LOG_RATE}, "WarmupLR: warmup curve, log or linear"),
    (WARMUP_MIN_RATIO, {"type": float, "default": 0.01}, "WarmupCosineLR: lr ratio at the start of warmup"),
    (COS_MIN_RATIO, {"type": float, "default": 0.01}, "WarmupCosineLR: lr ratio at the end of the cosine"),
)
#: the params each override_* function copies from the command line (DeepSpeed's own sets: `cycle_momentum` is
#: not among OneCycle's, so the flag never reaches a config built from the command line, as in DeepSpeed)
_RANGE_TEST_KEYS = (LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE)
_ONE_CYCLE_KEYS = (CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT,
                   DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE, CYCLE_MIN_MOM, CYCLE_MAX_MOM,
                   DECAY_MOM_RATE)
_WARMUP_KEYS = (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE)
_WARMUP_COSINE_KEYS = (WARMUP_NUM_STEPS, WARMUP_TYPE, WARMUP_MIN_RATIO, COS_MIN_RATIO)  # ratios, no lr


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's schedule flags (``--lr_schedule``, ``--cycle_min_lr``, ...) to ``parser`` as the group
    "Convergence Tuning"; returns ``parser``."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    for flag, kwargs, text in _FLAGS:
        group.add_argument(f"--{flag}", help=text, **kwargs)
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """``sys.argv``'s schedule flags, and the arguments that are not ones."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def _copy_set(args: Any, params: dict, keys: tuple[str, ...]) -> None:
    """Copy into ``params`` each of ``keys`` that ``args`` has and is not None."""
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            params[key] = value


def override_lr_range_test_params(args: Any, params: dict) -> None:
    """LRRangeTest's params from the command line ``args``, where set, into ``params``."""
    _copy_set(args, params, _RANGE_TEST_KEYS)


def override_1cycle_params(args: Any, params: dict) -> None:
    """OneCycle's params from ``args``, where set, into ``params``."""
    _copy_set(args, params, _ONE_CYCLE_KEYS)


def override_warmupLR_params(args: Any, params: dict) -> None:  # noqa: N802 (DeepSpeed's name)
    """WarmupLR's (and WarmupDecayLR's) params from ``args``, where set, into ``params``."""
    _copy_set(args, params, _WARMUP_KEYS)


def override_warmupCosineLR_params(args: Any, params: dict) -> None:  # noqa: N802 (DeepSpeed's name)
    """WarmupCosineLR's params from ``args``, where set, into ``params``."""
    _copy_set(args, params, _WARMUP_COSINE_KEYS)


def override_params(args: Any, params: dict) -> None:
    """Every schedule's params from ``args``, where set, into ``params``."""
    for override in (override_lr_range_test_params, override_1cycle_params, override_warmupLR_params,
                     override_warmupCosineLR_params):
        override(args, params)


def get_config_from_args(args: Any) -> tuple[Optional[dict], Optional[str]]:
    """``({"type": ..., "params": {...}}, None)`` from the command line's ``--lr_schedule`` and its schedule's
    flags, or ``(None, why)``: DeepSpeed's pair, with its messages."""
    name = getattr(args, LR_SCHEDULE, None)
    if name is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if name not in VALID_LR_SCHEDULES:
        return None, f"{name} is not supported LR schedule"
    params: dict = {}
    override = {LR_RANGE_TEST: override_lr_range_test_params, ONE_CYCLE: override_1cycle_params,
                WARMUP_COSINE_LR: override_warmupCosineLR_params}.get(name, override_warmupLR_params)
    override(args, params)
    return {"type": name, "params": params}, None


def get_lr_from_config(config: dict) -> tuple[Any, str]:
    """``(lr, "")``: the lr a scheduler section peaks at (LRRangeTest's start, OneCycle's cycle_max_lr, warmup's
    warmup_max_lr), or ``(None, why)`` (WarmupCosineLR's params hold ratios, no lr): DeepSpeed's pair."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    name, params = config["type"], config["params"]
    if name not in VALID_LR_SCHEDULES:
        return None, f"{name} is not a valid LR schedule"
    if name == WARMUP_COSINE_LR:
        return None, f"{WARMUP_COSINE_LR} scales the optimizer learning rate by a ratio, so its params define no lr"
    key = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(name, WARMUP_MAX_LR)
    return params[key], ""


def update_lr(param_groups: list[dict], lrs: list[Any]) -> list[Any]:
    """Set each group's lr to ``lrs``' (a tensor lr filled in place) and return the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def get_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """``optimizer`` if it is a torch optimizer, else the one it holds as ``.optimizer``; TypeError otherwise."""
    return driven_optimizer(optimizer)
