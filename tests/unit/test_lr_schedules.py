"""DeepSpeed's learning-rate schedules (zeropp/optim.py, served as ``deepspeed.runtime.lr_schedules``).

* Values: every schedule, step by step, equals DeepSpeed 0.19.8's own values (tests/data/lr_schedules, recorded
  by make_traces.py with DeepSpeed's classes: its default params, its test file's cases and a few more), through
  the class at ``deepspeed.runtime.lr_schedules`` and through the config's ``scheduler`` section; lr, OneCycle's
  beta1 and ``get_mom()``, compared with ``==``. DeepSpeed's own test assertions
  (tests/unit/runtime/test_lr_schedulers.py) and closed forms of its formulas, written out here, check the same.
* Protocol: ``last_batch_iteration``, ``step(i)``, ``get_last_lr()`` before a step, tensor lrs, per-group lists,
  ``state_dict()`` round trips and resuming mid-run with the same lrs and betas.
* Config: each bad value names its key; the module's helpers and names are DeepSpeed's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from zeropp.config import ConfigError, load_config
from zeropp.optim import LRRangeTest, OneCycle, Schedule, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "data" / "lr_schedules" / "deepspeed-0.19.8.json")
                    .read_text())
TRACES = GOLDEN["traces"]
CLASSES = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def optimizer(kind: str) -> torch.optim.Optimizer:
    """make_traces.py's optimizers."""
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    if kind == "adam":
        return torch.optim.Adam([p], lr=0.00015)
    if kind == "adam2":
        return torch.optim.Adam([{"params": [p], "lr": 0.1}, {"params": [q], "lr": 0.2}], betas=(0.9, 0.99))
    assert kind == "sgd"
    return torch.optim.SGD([p], lr=0.1, momentum=0.9)


def lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def beta1(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["betas"][0] if "betas" in g else g["momentum"]) for g in opt.param_groups]


def run(sched: Any, opt: torch.optim.Optimizer, steps: int) -> dict[str, Any]:
    """What make_traces.py records, for a zeropp schedule."""
    try:
        sched.get_last_lr()
        answered = True
    except AssertionError:
        answered = False
    out: dict[str, Any] = {"get_last_lr_before_step": answered, "get_lr_before_step": sched.get_lr(),
                           "lr": [lrs(opt)], "beta1": [beta1(opt)], "mom": [_mom(sched)]}
    for _ in range(steps):
        sched.step()
        for key, value in (("lr", lrs(opt)), ("beta1", beta1(opt)), ("mom", _mom(sched))):
            out[key].append(value)
        assert sched.get_last_lr() == out["lr"][-1]
    out["state_dict"] = sched.state_dict()
    return out


def _mom(sched: Any) -> Any:
    mom = sched.get_mom() if isinstance(sched, OneCycle) else None
    return None if mom is None else [m[0] for m in mom]


def _same_as_deepspeed(got: dict[str, Any], want: dict[str, Any]) -> None:
    keys = ["lr", "get_last_lr_before_step", "get_lr_before_step", "state_dict"]
    keys += ["beta1", "mom"] if want["type"] == "OneCycle" else []
    for key in keys:
        if key in ("lr", "beta1", "mom"):
            bad = [i for i, (a, b) in enumerate(zip(got[key], want[key])) if a != b]
            assert not bad and len(got[key]) == len(want[key]), f"{key} differs from step {bad[:1]}: " \
                f"{got[key][bad[0]] if bad else None} vs DeepSpeed's {want[key][bad[0]] if bad else None}"
        else:
            assert got[key] == want[key], key


@contextlib.contextmanager
def quiet() -> Any:
    """DeepSpeed's warnings (OneCycle over SGD, total_num_steps under warmup_num_steps) are expected here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _case_id(t: dict[str, Any]) -> str:
    return t["type"] + "-" + ",".join(f"{k}={v}" for k, v in t["params"].items()) + f"-{t['optimizer']}"


# ---- DeepSpeed 0.19.8's own values --------------------------------------------------------------------------------
def test_the_recorded_values_cover_every_schedule_and_knob() -> None:
    assert GOLDEN["deepspeed"] == "0.19.8" and len(TRACES) >= 50
    assert {t["type"] for t in TRACES} == set(CLASSES)
    keys = {k for t in TRACES for k in t["params"]}
    for key in ("cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "decay_lr_rate",
                "decay_step_size", "cycle_first_step_size", "cycle_second_step_size", "cycle_first_stair_count",
                "cycle_second_stair_count", "lr_range_test_min_lr", "lr_range_test_step_size",
                "lr_range_test_step_rate", "lr_range_test_staircase", "last_batch_iteration", "warmup_min_ratio",
                "cos_min_ratio", "warmup_type"):
        assert key in keys, key
    # not vacuous: the schedules move (OneCycle's momentum too) and DeepSpeed's defaults are among the cases
    assert all(len({tuple(row) for row in t["lr"]}) > 1 for t in TRACES if t["type"] != "WarmupLR" or t["params"])
    assert any(len({tuple(row) for row in t["beta1"]}) > 5 for t in TRACES if t["type"] == "OneCycle")
    assert {"type": "LRRangeTest", "params": {}, "optimizer": "adam", "steps": 100}.items() <= TRACES[4].items()


@pytest.mark.parametrize("want", TRACES, ids=_case_id)
def test_the_class_at_deepspeeds_path_gives_deepspeeds_values(alias, want: dict[str, Any]) -> None:
    from deepspeed.runtime import lr_schedules
    opt = optimizer(want["optimizer"])
    with quiet():
        sched = getattr(lr_schedules, want["type"])(opt, **want["params"])
    _same_as_deepspeed(run(sched, opt, want["steps"]), want)


@pytest.mark.parametrize("want", TRACES, ids=_case_id)
def test_the_config_section_gives_deepspeeds_values(want: dict[str, Any]) -> None:
    cfg = load_config({"scheduler": {"type": want["type"], "params": want["params"]}}).scheduler
    opt = optimizer(want["optimizer"])
    with quiet():
        sched = build_scheduler(cfg, opt)
    assert type(sched).__name__ == want["type"]
    _same_as_deepspeed(run(sched, opt, want["steps"]), want)


# ---- DeepSpeed's own assertions (tests/unit/runtime/test_lr_schedulers.py) and its formulas written out ----------
def sgd(lr: float = 0.1, groups: int = 1) -> torch.optim.SGD:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr)


def adam(lr: float = 0.00015, groups: int = 1) -> torch.optim.Adam:
    return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr)


def after_each_step(sched: Schedule, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        sched.step()
        out.append(sched.get_lr()[0])
    return out


def before_each_step(sched: Schedule, steps: int, read: Any = None) -> list[Any]:
    out = []
    for _ in range(steps):
        out.append(read(sched) if read else sched.get_lr()[0])
        sched.step()
    return out


def increasing(values: list[float]) -> bool:
    return all(a < b for a, b in zip(values, values[1:]))


def decreasing(values: list[float]) -> bool:
    return all(a > b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("n", [10, 15, 19, 33])
@pytest.mark.parametrize("curve", ["log", "linear"])
def test_warmup_reaches_max_at_its_length_and_decay_falls_after(n: int, curve: str) -> None:
    lr = after_each_step(WarmupLR(adam(), 0.1, 0.2, n, curve), 2 * n)
    assert lr[0] == 0.1 and lr[n] == 0.2 and all(x == 0.2 for x in lr[n:])
    for i in range(1, n):  # the curve itself, after i + 1 steps (last_batch_iteration i)
        w = math.log(i + 1) / math.log(n) if curve == "log" else i / n
        assert lr[i] == pytest.approx(0.1 + 0.1 * w, rel=1e-12)
    decay = after_each_step(WarmupDecayLR(adam(), 2 * n, 0.1, 0.2, n, curve), 4 * n)
    assert decay[0] == 0.1 and decay[n] == 0.2 and decreasing(decay[n:2 * n + 1])
    assert decay[2 * n] == 0.1 and decay[-1] == 0.1  # back at warmup_min_lr at total_num_steps, and held


@pytest.mark.parametrize("min_lr, rate, size, stairs", [(1e-4, 1e-5, 1, True), (1e-5, 1e-5, 1, False),
                                                        (1e-4, 1e-3, 10, True), (1e-3, 1e-3, 10, False),
                                                        (1e-2, 1e-2, 19, True), (1e-2, 1e-2, 19, False)])
def test_range_test_starts_at_min_and_grows(min_lr: float, rate: float, size: int, stairs: bool) -> None:
    lr = before_each_step(LRRangeTest(adam(), min_lr, size, rate, stairs), max(50, 2 * size))
    assert lr[0] == min_lr
    if stairs:
        assert all(lr[i] == lr[j] for i in range(0, len(lr), size) for j in range(i, min(i + size, len(lr))))
        assert lr[size - 1] < lr[size]
    else:
        assert increasing(lr)
    k = len(lr) - 1  # lr(i) = min * (1 + rate * u), u = (i + 1) / size (floored in stairs); read at i = k - 1
    assert lr[k] == pytest.approx(min_lr * (1 + rate * (k // size if stairs else k / size)), rel=1e-12)


@pytest.mark.parametrize("lo, hi, rate, size, decay", [(1e-5, 1e-2, 1e-3, 10, 10), (1e-3, 1e-1, 0, 21, 21),
                                                       (1e-3, 1e-1, 1e-1, 21, 21), (1e-5, 1e-1, 0, 10, 0)])
def test_one_cycle_lr_rises_falls_and_decays(lo: float, hi: float, rate: float, size: int, decay: int) -> None:
    lr = before_each_step(OneCycle(adam(), lo, hi, rate, size, decay_step_size=decay), max(50, 3 * size))
    assert lr[0] == lo and lr[size] == hi
    assert increasing(lr[:size]) and decreasing(lr[size:2 * size])
    for k in range(2 * size):  # read at last_batch_iteration k - 1: b = k steps into the cycle
        scale = k / size if k <= size else (2 * size - k) / size
        assert lr[k] == pytest.approx(lo + (hi - lo) * scale, rel=1e-9, abs=1e-15)
    if rate > 0:
        assert decreasing(lr[2 * size:])
        d = len(lr) - 1 - 2 * size  # the last read is at last_batch_iteration len - 2: d = it - 2 size + 1
        assert lr[-1] == pytest.approx(lo / (1 + rate * d / decay), rel=1e-12)
    else:
        assert all(x == lo for x in lr[2 * size:])


@pytest.mark.parametrize("lo, hi, rate, size", [(0.08, 0.09, 1e-3, 10), (0.08, 0.09, 0, 21)])
def test_one_cycle_momentum_falls_rises_and_decays(lo: float, hi: float, rate: float, size: int) -> None:
    opt = adam()
    sched = OneCycle(opt, 1e-3, 1e-2, cycle_first_step_size=size, decay_step_size=size, cycle_min_mom=lo,
                     cycle_max_mom=hi, decay_mom_rate=rate)
    assert opt.param_groups[0]["betas"] == (lo, 0.99)  # DeepSpeed sets cycle_min_mom at construction
    moms = before_each_step(sched, max(50, 3 * size), lambda s: s.get_mom()[0][0])
    assert moms[0] == hi and moms[size] == lo
    assert decreasing(moms[:size]) and increasing(moms[size:2 * size])
    assert opt.param_groups[0]["betas"][1] == 0.99  # DeepSpeed's fixed beta2, not Adam's 0.999
    if rate > 0:
        assert increasing(moms[2 * size:])
        d = len(moms) - 1 - 2 * size
        assert moms[-1] == pytest.approx(hi * (1 + rate * d / size), rel=1e-12)


@pytest.mark.parametrize("total, n, cos_min, warm_min", [(100, 10, 0.1, 0.2), (200, 20, 0.1, 0.2),
                                                         (500, 30, 0.0, 0.2), (600, 300, 0.1, 0.0),
                                                         (600, 550, 0.0, 0.0)])
def test_warmup_cosine_starts_peaks_and_ends_where_deepspeed_does(total: int, n: int, cos_min: float,
                                                                  warm_min: float) -> None:
    lr = after_each_step(WarmupCosineLR(adam(0.0015), total, warm_min, n, cos_min), total + 20)
    assert abs(lr[0] - 0.0015 * warm_min) < 1e-7 and abs(lr[n - 1] - 0.0015) < 1e-7
    assert abs(lr[total - 1] - 0.0015 * cos_min) < 1e-7 and all(x == lr[total - 1] for x in lr[total:])
    assert increasing(lr[:n]) and decreasing(lr[n:total])
    i = (n + total) // 2  # the cosine written out, at last_batch_iteration i
    cosine = (1 + math.cos(math.pi * (i - n + 1) / (total - n))) / 2
    assert lr[i] == pytest.approx(0.0015 * (cos_min + (1 - cos_min) * cosine), rel=1e-12)


def test_warmup_cosine_with_no_decay_window_stays_at_its_floor() -> None:
    sched = WarmupCosineLR(adam(0.01), total_num_steps=10, warmup_num_steps=10, cos_min_ratio=0.1)
    for step in range(10, 15):
        sched.step(step)
        assert sched.get_lr_ratio() == pytest.approx(0.1)


def test_warmup_cosine_linear_curve_and_every_group() -> None:
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.0015},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.003}])
    sched = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10, warmup_type="linear")
    assert sched.get_lr_ratio() == 0.0 and sched.get_last_lr() == [0.0, 0.0] and lrs(opt) == [0.0, 0.0]
    for step in range(10):
        sched.step(step)
        assert sched.get_lr_ratio() == pytest.approx(step / 10)
        assert lrs(opt) == pytest.approx([0.0015 * step / 10, 0.003 * step / 10])


def test_warmup_takes_each_groups_own_lr_when_no_max_is_given() -> None:
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
    sched = WarmupLR(opt, warmup_num_steps=10)
    assert sched.max_lrs == [0.1, 0.2] and lrs(opt) == [0.0, 0.0]
    sched.step(10)
    assert sched.get_lr() == pytest.approx([0.1, 0.2]) and lrs(opt) == pytest.approx([0.1, 0.2])


def _stairs(first: int, steps: int = 16, first_size: int = 8, second_size: int = 8,
            second: int | None = None) -> list[float]:
    sched = OneCycle(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.001, betas=(0.9, 0.99)),
                     cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=first_size,
                     cycle_second_step_size=second_size, cycle_first_stair_count=first, cycle_second_stair_count=second)
    return after_each_step(sched, steps)


def test_one_cycle_stairs_hold_the_lr_flat() -> None:
    continuous, stairs = _stairs(0), _stairs(2)
    assert len(set(continuous[:8])) == 8 and stairs != continuous and stairs[0] == stairs[1]
    assert len(set(stairs[:8])) < len(set(continuous[:8])) and _stairs(8) == continuous
    # asymmetric: batch-aligned stairs are the continuous schedule (the peak is not floored away), and each
    # half's count acts on that half only
    base = _stairs(0, 31, 10, 21, 0)
    aligned = _stairs(10, 31, 10, 21, 21)
    assert aligned == pytest.approx(base) and aligned[9] == pytest.approx(0.01)
    first_only, second_only = _stairs(2, 31, 10, 21, 0), _stairs(0, 31, 10, 21, 3)
    assert first_only[:10] != base[:10] and first_only[10:] == base[10:]
    assert second_only[:10] == base[:10] and second_only[10:30] != base[10:30]


def test_one_cycle_per_group_lists_and_their_lengths() -> None:
    def two() -> torch.optim.Adam:
        return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                                 {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}], betas=(0.9, 0.99))
    opt = two()
    sched = OneCycle(opt, [0.001, 0.002], [0.01, 0.02], cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95],
                     cycle_first_step_size=5, cycle_second_step_size=5)
    assert lrs(opt) == pytest.approx([0.001, 0.002]) and beta1(opt) == pytest.approx([0.8, 0.85])
    sched.step(4)
    assert lrs(opt) == pytest.approx([0.01, 0.02]) and beta1(opt) == pytest.approx([0.8, 0.85])
    sched.step(9)
    assert lrs(opt) == pytest.approx([0.001, 0.002]) and beta1(opt) == pytest.approx([0.9, 0.95])
    for key in ("cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom"):
        kwargs = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 5, key: [0.1, 0.2, 0.3]}
        with pytest.raises(ValueError, match=key):
            OneCycle(two(), **kwargs)


@pytest.mark.parametrize("cls", [WarmupLR, WarmupDecayLR, WarmupCosineLR])
@pytest.mark.parametrize("bad", [None, -5, 0])
def test_warmup_schedules_refuse_a_warmup_that_is_not_a_positive_integer(cls: type, bad: Any) -> None:
    kwargs = {"total_num_steps": 100} if cls is not WarmupLR else {}
    with pytest.raises(ValueError, match="warmup_num_steps"):
        cls(adam(), warmup_num_steps=bad, **kwargs)


def test_step_sizes_deepspeed_refuses_and_the_one_it_allows() -> None:
    for bad in (0, -5):
        with pytest.raises(ValueError, match="lr_range_test_step_size"):
            LRRangeTest(sgd(), lr_range_test_step_size=bad)
    for first, second in ((0, 0), (0, None), (-1, None), (0, 100), (100, -1)):
        with pytest.raises(ValueError, match="cycle_"):
            OneCycle(sgd(), 0.001, 0.1, cycle_first_step_size=first, cycle_second_step_size=second)
    with quiet():  # SGD has no betas: no momentum cycle
        sched = OneCycle(sgd(), 0.001, 0.1, cycle_first_step_size=100, cycle_second_step_size=0)  # no falling half
    assert sched.step_ratio == 1.0 and sched.get_lr() == [pytest.approx(0.001)]
    assert after_each_step(sched, 3)[-1] > 0.001


def test_one_cycle_over_an_optimizer_without_betas_warns_and_leaves_momentum() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match="cycle_momentum is off"):
        sched = OneCycle(opt, 0.001, 0.1, cycle_first_step_size=4, cycle_min_mom=[1, 2, 3])  # lists unread then
    after_each_step(sched, 5)
    assert sched.get_mom() is None and opt.param_groups[0]["momentum"] == 0.9 and "betas" not in opt.param_groups[0]


@pytest.mark.parametrize("cls, kwargs, first, second", [
    (LRRangeTest, {}, 1e-3, 1e-3 * (1 + 2 / 2000)),
    (OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10, "cycle_momentum": False},
     0.01, 0.01 + 0.09 * 2 / 10),
    (WarmupLR, {"warmup_num_steps": 10}, 0.0, 0.1 * math.log(2) / math.log(10)),
    (WarmupDecayLR, {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_max_lr": 0.1}, 0.0,
     0.1 * math.log(2) / math.log(10)),
    (WarmupCosineLR, {"total_num_steps": 100, "warmup_num_steps": 10}, 0.0, 0.1 * math.log(2) / math.log(10)),
])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_a_tensor_lr_is_filled_in_place(cls: type, kwargs: dict, first: float, second: float,
                                        shape: tuple) -> None:
    lr = torch.full(shape, 0.1, dtype=torch.float64)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = cls(opt, **kwargs)
    assert opt.param_groups[0]["lr"] is lr and lr.shape == shape and lr.item() == pytest.approx(first)
    sched.step(1)
    assert opt.param_groups[0]["lr"] is lr and lr.dtype == torch.float64 and lr.item() == pytest.approx(second)


# ---- the protocol: last_batch_iteration, get_last_lr, state_dict, resume ------------------------------------------
def test_last_batch_iteration_counts_steps_from_minus_one_and_step_can_jump() -> None:
    opt = adam()
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    assert sched.last_batch_iteration == -1 and sched.last_epoch == 0 and sched.state_dict() == {
        "last_batch_iteration": -1}
    sched.step()
    sched.step()
    assert sched.last_batch_iteration == 1 and sched.last_epoch == 2 and lrs(opt) == [pytest.approx(0.01)]
    sched.step(15)  # DeepSpeed's step(last_batch_iteration)
    assert sched.state_dict() == {"last_batch_iteration": 15} and lrs(opt) == [pytest.approx(0.05)]
    assert sched.get_last_lr() == lrs(opt) == sched.get_lr()


def test_get_last_lr_before_a_step_is_deepspeeds_assertion() -> None:
    assert WarmupLR(adam()).get_last_lr() == [0.0]  # written at construction
    for sched in (OneCycle(adam(), 0.001, 0.01), WarmupLR(adam(), warmup_num_steps=10, last_batch_iteration=4)):
        with pytest.raises(AssertionError, match="need to call step"):  # transformers' Trainer catches this text
            sched.get_last_lr()


def test_a_schedule_started_mid_run_leaves_the_lr_until_its_first_step() -> None:
    opt = adam(lr=0.5)
    sched = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear", last_batch_iteration=4)
    assert lrs(opt) == [0.5] and sched.get_lr() == [pytest.approx(0.04)]
    sched.step()
    assert lrs(opt) == [pytest.approx(0.05)] and sched.last_batch_iteration == 5


RESUMED = [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 16}),
    ("WarmupDecayLR", {"total_num_steps": 24, "warmup_num_steps": 4, "warmup_max_lr": 0.1}),
    ("WarmupCosineLR", {"total_num_steps": 24, "warmup_num_steps": 4, "warmup_min_ratio": 0.1}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 3, "cycle_second_step_size": 4,
                  "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01, "cycle_first_stair_count": 2}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
]


@pytest.mark.parametrize("kind, params", RESUMED, ids=[k for k, _ in RESUMED])
@pytest.mark.parametrize("at", [0, 5, 9])
def test_state_dict_round_trips_and_a_resumed_run_goes_on_with_the_same_lrs_and_betas(kind: str, params: dict,
                                                                                      at: int) -> None:
    cfg = load_config({"scheduler": {"type": kind, "params": params}}).scheduler
    opt = optimizer("adam2")
    sched = build_scheduler(cfg, opt)
    for _ in range(at):
        sched.step()
    # what a checkpoint keeps: the scheduler's state and the optimizer's groups, through JSON
    saved = json.loads(json.dumps({"sched": sched.state_dict(), "opt": opt.state_dict()["param_groups"]}))
    assert saved["sched"] == {"last_batch_iteration": at - 1}
    opt2 = optimizer("adam2")
    sched2 = build_scheduler(cfg, opt2)
    opt2.load_state_dict({"state": {}, "param_groups": saved["opt"]})
    before = lrs(opt2)
    sched2.load_state_dict(saved["sched"])
    assert lrs(opt2) == before  # as DeepSpeed's, loading moves the position, not the optimizer
    assert sched2.state_dict() == sched.state_dict() and sched2.get_lr() == sched.get_lr()
    seen = set()
    for _ in range(12):
        assert lrs(opt2) == lrs(opt) and beta1(opt2) == beta1(opt)
        seen.add((tuple(lrs(opt)), tuple(beta1(opt))))
        sched.step()
        sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()
    assert len(seen) > 3  # not vacuous: the lr (and OneCycle's beta1) moved over the resumed steps
    if kind == "OneCycle":
        assert len({b for _, b in seen}) > 3 and sched2.get_mom() == sched.get_mom()


def test_torch_style_state_that_zeropp_saved_before_still_loads() -> None:
    sched = WarmupLR(adam(), warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    sched.load_state_dict({"last_epoch": 8, "_step_count": 9, "min_lrs": [0.0], "max_lrs": [0.1]})
    assert sched.last_batch_iteration == 7
    with pytest.raises(KeyError, match="last_batch_iteration"):
        sched.load_state_dict({"epoch": 3})


def test_a_wrapped_optimizer_is_unwrapped_and_anything_else_refused() -> None:
    opt = adam()

    class View:  # a ZeRO optimizer view, accelerate's AcceleratedOptimizer
        optimizer = opt
    sched = WarmupLR(View(), warmup_max_lr=0.1, warmup_num_steps=2)
    assert sched.optimizer is opt
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        WarmupLR(object())


# ---- the config section: every schedule loads with DeepSpeed's defaults; a bad value names its key ---------------
def test_each_type_loads_with_deepspeeds_defaults() -> None:
    want = {
        "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
                     "last_batch_iteration": -1},
        "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                        "lr_range_test_staircase": False, "last_batch_iteration": -1},
        "OneCycle": {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                     "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                     "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                     "decay_mom_rate": 0.0, "last_batch_iteration": -1},
    }
    for kind, params in want.items():
        given = {"cycle_min_lr": 0, "cycle_max_lr": 0.1} if kind == "OneCycle" else {}
        cfg = load_config({"scheduler": {"type": kind, "params": given}}).scheduler
        assert cfg.params.model_dump() == params, kind
    assert load_config({"scheduler": {"type": "onecycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1}}}
                       ).scheduler.type == "OneCycle"  # spelled in any case, as the other sections' types


@pytest.mark.parametrize("kind, params, message", [
    ("OneCycle", {"cycle_max_lr": 0.1}, "scheduler.params.cycle_min_lr: required key is missing"),
    ("OneCycle", {"cycle_min_lr": -1, "cycle_max_lr": 0.1},
     "scheduler.params.cycle_min_lr: got -1; accepted: a number >= 0"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": "0.1"}, "scheduler.params.cycle_max_lr: expected a number"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": [0.1, None]}, "scheduler.params.cycle_max_lr: expected a number"),
    ("OneCycle", {"cycle_min_lr": [], "cycle_max_lr": 0.1}, "scheduler.params.cycle_min_lr: got an empty list"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_first_step_size": 0},
     "scheduler.params.cycle_first_step_size: got 0; accepted: an integer >= 1"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_second_step_size": -1},
     "scheduler.params.cycle_second_step_size: got -1; accepted: an integer >= 0"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_first_stair_count": 1.5},
     "scheduler.params.cycle_first_stair_count: expected an integer"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "decay_step_size": -1},
     "scheduler.params.decay_step_size: got -1"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_min_mom": 1.0},
     "scheduler.params.cycle_min_mom: got 1.0; accepted: a number >= 0 and < 1"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_max_mom": [0.9, 1.5]},
     "scheduler.params.cycle_max_mom: got 1.5"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "decay_mom_rate": -0.1},
     "scheduler.params.decay_mom_rate: got -0.1"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_momentum": "yes"},
     "scheduler.params.cycle_momentum: expected true or false"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_min_momentum": 0.8},
     "scheduler.params.cycle_min_momentum: unknown key"),
    ("LRRangeTest", {"lr_range_test_step_size": 0}, "scheduler.params.lr_range_test_step_size: got 0"),
    ("LRRangeTest", {"lr_range_test_step_rate": -1}, "scheduler.params.lr_range_test_step_rate: got -1"),
    ("LRRangeTest", {"lr_range_test_min_lr": "1e-3"}, "scheduler.params.lr_range_test_min_lr: expected a number"),
    ("LRRangeTest", {"lr_range_test_staircase": 2}, "scheduler.params.lr_range_test_staircase: expected true or false"),
    ("WarmupLR", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps: got 0"),
    ("WarmupLR", {"last_batch_iteration": -2}, "scheduler.params.last_batch_iteration: got -2"),
    ("WarmupDecayLR", {"warmup_max_lr": [0.1, -0.1], "total_num_steps": 5}, "scheduler.params.warmup_max_lr: got -0.1"),
    ("Cyclic", {}, "scheduler.type: unknown scheduler type 'Cyclic'; accepted: WarmupLR, WarmupDecayLR, "
                   "WarmupCosineLR, OneCycle, LRRangeTest"),
])
def test_a_bad_value_names_its_key(kind: str, params: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"scheduler": {"type": kind, "params": params}})
    assert str(err.value).startswith(message), str(err.value)


def test_a_per_group_list_of_the_wrong_length_names_its_key_when_the_schedule_is_built() -> None:
    cfg = load_config({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": [0.1, 0.2, 0.3],
                                                                      "cycle_max_lr": 1.0}}}).scheduler
    with pytest.raises(ConfigError, match=r"^scheduler.params.cycle_min_lr: 3 values for 2 optimizer param groups; "
                                          r"accepted: a number, or a list of 2$"):
        build_scheduler(cfg, optimizer("adam2"))
    sched = build_scheduler(cfg, optimizer("adam2").__class__(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(3)], lr=0.5))
    assert sched.min_lrs == [0.1, 0.2, 0.3] and sched.max_lrs == [1.0] * 3


def test_last_batch_iteration_in_the_config_resumes_as_deepspeed_does() -> None:
    cfg = load_config({"scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear", "last_batch_iteration": 4}}}).scheduler
    opt = adam(lr=0.5)
    sched = build_scheduler(cfg, opt)
    assert sched.last_batch_iteration == 4 and lrs(opt) == [0.5]
    sched.step()
    assert lrs(opt) == [pytest.approx(0.05)]


# ---- the module's other names: DeepSpeed's ------------------------------------------------------------------------
def test_the_module_has_deepspeeds_names_and_nothing_is_missing(alias) -> None:
    import deepspeed
    from deepspeed.runtime import lr_schedules
    from zeropp.deepspeed.missing import MISSING
    assert set(lr_schedules.__all__) == set(GOLDEN["helpers"]["names"])
    assert all(hasattr(lr_schedules, name) for name in GOLDEN["helpers"]["names"])
    assert "deepspeed.runtime.lr_schedules" not in MISSING and deepspeed.add_tuning_arguments is \
        lr_schedules.add_tuning_arguments
    assert (lr_schedules.CYCLE_MIN_MOM, lr_schedules.WARMUP_LOG_RATE, lr_schedules.LR_SCHEDULE) == (
        "cycle_min_mom", "log", "lr_schedule")
    with pytest.raises(AttributeError, match="no attribute 'CosineLR'"):
        lr_schedules.CosineLR  # noqa: B018


def test_command_line_helpers_answer_as_deepspeeds(alias) -> None:
    from deepspeed.runtime import lr_schedules
    want = GOLDEN["helpers"]
    parser = lr_schedules.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert vars(args) == want["defaults"]
    assert [g.title for g in parser._action_groups][-1] == "Convergence Tuning"
    for name, answer in want["config_from_args"].items():
        args.lr_schedule = None if name == "None" else name
        config, error = lr_schedules.get_config_from_args(args)
        assert [config, error] == answer, name
        if config is not None:
            assert list(lr_schedules.get_lr_from_config(config)) == want["lr_from_config"][name], name
    bad = {"no type": {}, "no params": {"type": "OneCycle"}, "bad type": {"type": "X", "params": {}}}
    for label, config in bad.items():
        assert list(lr_schedules.get_lr_from_config(config)) == want["lr_from_config"][label]
    flags = parser.parse_args(["--lr_schedule", "LRRangeTest", "--lr_range_test_staircase",
                               "--lr_range_test_step_size", "7"])
    config, _ = lr_schedules.get_config_from_args(flags)
    assert config["params"]["lr_range_test_staircase"] is True and config["params"]["lr_range_test_step_size"] == 7
    assert load_config({"scheduler": config}).scheduler.params.lr_range_test_step_size == 7  # a config zeropp loads
    params: dict = {}
    lr_schedules.override_params(flags, params)
    assert params["lr_range_test_step_size"] == 7 and params["warmup_num_steps"] == 1000
    assert "cycle_momentum" not in params  # DeepSpeed's override_1cycle_params does not copy the flag


def test_update_lr_and_get_torch_optimizer(alias) -> None:
    from deepspeed.runtime import lr_schedules
    lr = torch.tensor(0.1, dtype=torch.float64)
    groups = [{"lr": lr}, {"lr": 0.2}]
    out = lr_schedules.update_lr(groups, [torch.tensor([0.3]), 0.4])
    assert out[0] is lr and lr.item() == pytest.approx(0.3) and out[1] == 0.4
    opt = adam()

    class Wrapper:
        optimizer = opt
    assert lr_schedules.get_torch_optimizer(opt) is opt and lr_schedules.get_torch_optimizer(Wrapper()) is opt
    with pytest.raises(TypeError):
        lr_schedules.get_torch_optimizer(object())


# ---- through the engine (a world of one): the optimizer step uses the schedule; a checkpoint resumes it -----------
@pytest.fixture(scope="module")
def world_of_one() -> Any:
    import torch.distributed as dist
    created = not dist.is_initialized()
    if created:  # an in-process store: no port to collide with other tests
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


ONE_CYCLE = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 2, "cycle_second_step_size": 3,
             "decay_step_size": 1, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01, "cycle_min_mom": 0.85,
             "cycle_max_mom": 0.95}
STEPS, SAVE_AT = 9, 4


def _engine(scheduler: Any = None, stage: int = 3, as_callable: bool = False) -> Any:
    import zeropp
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.5}}}
    if scheduler is None:
        config["scheduler"] = {"type": "OneCycle", "params": ONE_CYCLE}
        engine, *_ = zeropp.initialize(model=model, config=config)
    else:  # a script's own schedule over its own optimizer, built before initialize or by it
        opt = torch.optim.Adam(model.parameters(), lr=0.5)
        given = scheduler if as_callable else scheduler(opt)
        engine, *_ = zeropp.initialize(model=model, optimizer=opt, lr_scheduler=given, config=config)
    return engine


def _train(engine: Any, steps: range) -> list[tuple[list[float], list[float], float]]:
    """(lrs, beta1s, loss) of each optimizer step, as the step used them."""
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        opt = engine.master_optimizer
        out.append((lrs(opt), beta1(opt), loss.item()))
        engine.step()
    return out


def _reference(steps: int) -> list[tuple[list[float], list[float]]]:
    """What DeepSpeed's OneCycle writes, over a plain Adam, before each of ``steps`` optimizer steps."""
    opt = adam(lr=0.5)
    sched = OneCycle(opt, **ONE_CYCLE)
    out = []
    for _ in range(steps):
        out.append((lrs(opt), beta1(opt)))
        sched.step()
    return out


def test_the_engine_steps_with_the_configs_one_cycle_and_resumes_it_from_a_checkpoint(world_of_one,
                                                                                      tmp_path: Path) -> None:
    engine = _engine()
    assert isinstance(engine.lr_scheduler, OneCycle)
    run = _train(engine, range(STEPS))
    assert [(lr, b1) for lr, b1, _ in run] == _reference(STEPS)  # lr and betas as DeepSpeed sets them
    assert len({b1[0] for _, b1, _ in run}) > 5 and run[0][1] == [0.85]
    engine.destroy()

    first = _engine()
    _train(first, range(SAVE_AT))
    first.save_checkpoint(str(tmp_path), tag="mid")
    first.destroy()
    resumed = _engine()
    assert lrs(resumed.master_optimizer) == [0.001]  # a fresh schedule, until the checkpoint loads
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    assert resumed.lr_scheduler.state_dict() == {"last_batch_iteration": SAVE_AT - 1}
    rest = _train(resumed, range(SAVE_AT, STEPS))
    assert [(lr, b1) for lr, b1, _ in rest] == [(lr, b1) for lr, b1, _ in run[SAVE_AT:]]
    assert [loss for *_, loss in rest] == pytest.approx([loss for *_, loss in run[SAVE_AT:]], rel=1e-6)
    resumed.destroy()


@pytest.mark.parametrize("as_callable", [False, True], ids=["built-before", "callable"])
def test_a_schedule_the_script_builds_drives_the_engines_optimizer(world_of_one, alias, as_callable: bool) -> None:
    from deepspeed.runtime.lr_schedules import OneCycle as ScriptsOneCycle
    built = []

    def build(opt: torch.optim.Optimizer) -> Any:
        built.append(ScriptsOneCycle(opt, **ONE_CYCLE))
        return built[-1]
    engine = _engine(scheduler=build, stage=2, as_callable=as_callable)
    assert engine.lr_scheduler is built[0] and engine.lr_scheduler.optimizer is engine.master_optimizer
    run = _train(engine, range(STEPS))
    assert [(lr, b1) for lr, b1, _ in run] == _reference(STEPS)
    assert engine.lr_scheduler.state_dict() == {"last_batch_iteration": STEPS - 1}
    engine.destroy()
