#!/usr/bin/env python
"""Record DeepSpeed 0.19.8's learning-rate schedules step by step, so zeropp's can be checked against them
without DeepSpeed (tests/unit/test_lr_schedules.py).

Run it with a Python that has deepspeed==0.19.8 and torch installed (CPU only):

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/lr_schedules/make_traces.py

For every case below it builds the schedule with DeepSpeed's class (``deepspeed.runtime.lr_schedules.<type>``,
the class DeepSpeed's engine builds from a config's ``{"type", "params"}``) over a fresh torch optimizer and writes
into deepspeed-0.19.8.json, per case: the optimizer's group lrs (``lr``) and, for OneCycle, the groups' beta1
(``beta1``; SGD's momentum) and ``get_mom()``'s beta1 (``mom``), right after construction (index 0) and after
each of ``steps`` calls to ``step()``; whether ``get_last_lr()`` answered before the first step; ``get_lr()``
before the first step; and the state_dict after the last step. JSON floats round-trip exactly, so the test compares with ``==``. Under
``helpers``: the module's public names, ``add_tuning_arguments``' defaults, and what ``get_config_from_args`` and
``get_lr_from_config`` answer for each schedule and for the bad inputs they name.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import deepspeed  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402

OUT = Path(__file__).resolve().parent / "deepspeed-0.19.8.json"
STEPS = 100


def optimizer(kind: str) -> torch.optim.Optimizer:
    """The optimizers the cases run over (tests/unit/test_lr_schedules.py builds the same ones)."""
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    if kind == "adam":  # DeepSpeed's tests: Adam, lr 0.00015
        return torch.optim.Adam([p], lr=0.00015)
    if kind == "adam2":  # two groups with their own lr
        return torch.optim.Adam([{"params": [p], "lr": 0.1}, {"params": [q], "lr": 0.2}], betas=(0.9, 0.99))
    if kind == "sgd":  # no betas: OneCycle leaves the momentum alone
        return torch.optim.SGD([p], lr=0.1, momentum=0.9)
    raise ValueError(kind)


def cases() -> list[dict[str, Any]]:
    """DeepSpeed's test cases (tests/unit/runtime/test_lr_schedulers.py), its defaults and a few more."""
    out: list[dict[str, Any]] = []

    def add(kind: str, params: dict, opt: str = "adam", steps: int = STEPS) -> None:
        out.append({"type": kind, "params": params, "optimizer": opt, "steps": steps})

    add("WarmupLR", {})
    add("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 10})
    add("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 10})
    add("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1})
    add("LRRangeTest", {})
    for n in (10, 15, 19, 33):
        for curve in ("log", "linear"):
            add("WarmupLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2, "warmup_num_steps": n, "warmup_type": curve})
            add("WarmupDecayLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2, "warmup_num_steps": n,
                                  "total_num_steps": 2 * n, "warmup_type": curve})
    add("WarmupLR", {"warmup_num_steps": 1, "warmup_max_lr": 0.5})
    add("WarmupLR", {"warmup_min_lr": [0.01, 0.02], "warmup_num_steps": 7}, opt="adam2")
    add("WarmupLR", {"warmup_num_steps": 10, "last_batch_iteration": 4})
    add("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 5})
    add("WarmupDecayLR", {"total_num_steps": 8, "warmup_num_steps": 12, "warmup_type": "linear"})
    add("WarmupDecayLR", {"total_num_steps": 50, "warmup_num_steps": 5, "warmup_min_lr": [0.0, 0.001],
                          "warmup_max_lr": [0.1, 0.3]}, opt="adam2")
    for total, warm, cmin, wmin in ((100, 10, 0.1, 0.2), (200, 20, 0.1, 0.2), (500, 30, 0.0, 0.2),
                                    (600, 300, 0.1, 0.0), (600, 550, 0.0, 0.0), (40, 10, 0.1, 0.2), (10, 10, 0.1, 0.0)):
        add("WarmupCosineLR", {"total_num_steps": total, "warmup_num_steps": warm, "cos_min_ratio": cmin,
                               "warmup_min_ratio": wmin})
    add("WarmupCosineLR", {"total_num_steps": 60, "warmup_num_steps": 10, "warmup_type": "linear"}, opt="adam2")
    add("WarmupCosineLR", {"total_num_steps": 60, "warmup_num_steps": 10, "last_batch_iteration": 30})
    for lo, hi, rate, size, decay in ((1e-5, 1e-2, 1e-3, 10, 10), (1e-3, 1e-1, 0, 21, 21), (1e-3, 1e-1, 1e-1, 21, 21),
                                      (1e-5, 1e-1, 0, 10, 0)):
        add("OneCycle", {"cycle_min_lr": lo, "cycle_max_lr": hi, "decay_lr_rate": rate, "cycle_first_step_size": size,
                         "decay_step_size": decay})
    for lo, hi, rate, size in ((0.08, 0.09, 1e-3, 10), (0.08, 0.09, 0, 21)):
        add("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_min_mom": lo, "cycle_max_mom": hi,
                         "decay_mom_rate": rate, "cycle_first_step_size": size, "decay_step_size": size})
    base = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}
    add("OneCycle", {**base, "cycle_first_step_size": 8, "cycle_second_step_size": 8, "cycle_first_stair_count": 2})
    for first, second in ((10, 0), (10, 21), (2, 0), (0, 3)):
        add("OneCycle", {**base, "cycle_first_step_size": 10, "cycle_second_step_size": 21,
                         "cycle_first_stair_count": first, "cycle_second_stair_count": second})
    add("OneCycle", {**base, "cycle_first_step_size": 30, "cycle_second_step_size": 0, "decay_step_size": 7,
                     "decay_lr_rate": 0.5, "decay_mom_rate": 0.01})
    add("OneCycle", {**base, "cycle_first_step_size": 12, "cycle_second_step_size": 20, "decay_step_size": 3,
                     "decay_lr_rate": 0.2, "decay_mom_rate": 0.002, "cycle_first_stair_count": 3})
    add("OneCycle", {"cycle_min_lr": [0.001, 0.002], "cycle_max_lr": [0.01, 0.02], "cycle_min_mom": [0.8, 0.85],
                     "cycle_max_mom": [0.9, 0.95], "cycle_first_step_size": 5, "cycle_second_step_size": 5,
                     "decay_step_size": 4, "decay_lr_rate": 0.1, "decay_mom_rate": 0.01}, opt="adam2")
    add("OneCycle", {**base, "cycle_first_step_size": 10, "cycle_momentum": False, "decay_step_size": 5,
                     "decay_lr_rate": 0.3})
    add("OneCycle", {**base, "cycle_first_step_size": 10}, opt="sgd")
    add("OneCycle", {**base, "cycle_first_step_size": 10, "decay_step_size": 5, "decay_lr_rate": 0.1,
                     "last_batch_iteration": 14})
    for lo, rate, size, stairs in ((1e-4, 1e-5, 1, True), (1e-5, 1e-5, 1, False), (1e-4, 1e-3, 10, True),
                                   (1e-3, 1e-3, 10, False), (1e-2, 1e-2, 19, True), (1e-2, 1e-2, 19, False)):
        add("LRRangeTest", {"lr_range_test_min_lr": lo, "lr_range_test_step_rate": rate,
                            "lr_range_test_step_size": size, "lr_range_test_staircase": stairs})
    add("LRRangeTest", {"lr_range_test_min_lr": [1e-4, 1e-3], "lr_range_test_step_size": 5}, opt="adam2")
    add("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_staircase": True, "last_batch_iteration": 9})
    return out


def beta1(opt: torch.optim.Optimizer) -> list[float]:
    """Each group's beta1 (an SGD group's momentum, which OneCycle leaves alone)."""
    return [float(g["betas"][0] if "betas" in g else g["momentum"]) for g in opt.param_groups]


def trace(case: dict[str, Any]) -> dict[str, Any]:
    opt = optimizer(case["optimizer"])
    sched = getattr(lr_schedules, case["type"])(opt, **case["params"])
    one_cycle = case["type"] == "OneCycle"
    try:
        sched.get_last_lr()
        answered = True
    except AssertionError:
        answered = False
    out: dict[str, Any] = {**case, "get_last_lr_before_step": answered, "get_lr_before_step": sched.get_lr(),
                           "lr": [[float(g["lr"]) for g in opt.param_groups]]}
    if one_cycle:
        out["beta1"], out["mom"] = [beta1(opt)], [_mom(sched)]
    for _ in range(case["steps"]):
        sched.step()
        out["lr"].append([float(g["lr"]) for g in opt.param_groups])
        assert out["lr"][-1] == [float(x) for x in sched.get_last_lr()]
        if one_cycle:
            out["beta1"].append(beta1(opt))
            out["mom"].append(_mom(sched))
    out["state_dict"] = sched.state_dict()
    return out


def _mom(sched: Any) -> Any:
    mom = sched.get_mom()
    return None if mom is None else [float(m[0]) for m in mom]


def helpers() -> dict[str, Any]:
    """The module's names (not the modules and names it imports) and its command-line helpers' answers."""
    imported = {"argparse", "math", "logger", "Optimizer", "is_tensor"}
    args = lr_schedules.add_tuning_arguments(argparse.ArgumentParser()).parse_args([])
    out: dict[str, Any] = {"names": sorted(n for n in dir(lr_schedules) if not n.startswith("_") and n not in imported),
                           "defaults": dict(vars(args)), "config_from_args": {}, "lr_from_config": {}}
    for name in [*lr_schedules.VALID_LR_SCHEDULES, None, "Cosine"]:
        args.lr_schedule = name
        config, error = lr_schedules.get_config_from_args(args)
        out["config_from_args"][str(name)] = [config, error]
        if config is not None:
            out["lr_from_config"][str(name)] = list(lr_schedules.get_lr_from_config(config))
    bad = {"no type": {}, "no params": {"type": "OneCycle"}, "bad type": {"type": "X", "params": {}}}
    for label, config in bad.items():
        out["lr_from_config"][label] = list(lr_schedules.get_lr_from_config(config))
    return out


def main() -> None:
    assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
    traces = [trace(c) for c in cases()]
    assert all(math.isfinite(x) for t in traces for row in t["lr"] for x in row)
    doc = {"deepspeed": deepspeed.__version__, "helpers": helpers(), "traces": traces}
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"{len(traces)} traces -> {OUT} ({OUT.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
