"""Unit tests for zeropp.optim: optimizer choice (DeepSpeed's Adam rules) and DeepSpeed's lr schedules."""

from __future__ import annotations

import math

import pytest
import torch

from zeropp.config import NotSupportedError, parse_config
from zeropp.optim import (
    Schedule,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_optimizer,
    build_scheduler,
)


def optimizer_cfg(section: dict):
    return parse_config({"optimizer": section}).optimizer


def scheduler_cfg(section: dict):
    return parse_config({"scheduler": section}).scheduler


def one_param(value: float = 1.0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full((3,), value))


def step_with_zero_grad(opt: torch.optim.Optimizer, p: torch.nn.Parameter) -> float:
    p.grad = torch.zeros_like(p)
    opt.step()
    return p.detach()[0].item()


# ------------------------------------------------------------------------------------------- optimizers
def test_default_optimizer_is_adamw_lr_1e_3_without_weight_decay() -> None:
    opt = build_optimizer(None, [one_param()])
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["weight_decay"] == 0.0
    assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-8


def test_adam_defaults_to_decoupled_weight_decay_like_deepspeed() -> None:
    p = one_param()
    opt = build_optimizer(optimizer_cfg({"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.1}}), [p])
    assert type(opt) is torch.optim.AdamW
    # zero gradient: only the decoupled decay moves the weight, by lr * wd * w = 0.01
    assert step_with_zero_grad(opt, p) == pytest.approx(0.99)


def test_adam_w_mode_false_is_l2_adam() -> None:
    p = one_param()
    section = {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.1, "adam_w_mode": False}}
    opt = build_optimizer(optimizer_cfg(section), [p])
    assert type(opt) is torch.optim.Adam
    # L2: grad = wd * w = 0.1; Adam's first step moves by lr * m_hat / sqrt(v_hat) = lr
    assert step_with_zero_grad(opt, p) == pytest.approx(0.9, abs=1e-6)


def test_adamw_ignores_adam_w_mode_false() -> None:
    section = {"type": "AdamW", "params": {"adam_w_mode": False, "torch_adam": True, "amsgrad": True}}
    opt = build_optimizer(optimizer_cfg(section), [one_param()])
    assert type(opt) is torch.optim.AdamW and opt.defaults["amsgrad"] is True


def test_sgd_params_pass_through() -> None:
    section = {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}}
    opt = build_optimizer(optimizer_cfg(section), [one_param()])
    assert type(opt) is torch.optim.SGD
    assert (opt.defaults["lr"], opt.defaults["momentum"], opt.defaults["nesterov"]) == (0.5, 0.9, True)


def test_param_groups_are_accepted() -> None:
    groups = [{"params": [one_param()]}, {"params": [one_param()], "lr": 0.5}]
    opt = build_optimizer(optimizer_cfg({"type": "AdamW", "params": {"lr": 0.1}}), groups)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]


def test_fused_is_chosen_only_on_a_gpu_and_only_when_unset() -> None:
    # host masters keep torch's default (the bit-exact reference paths); tests/gpu checks the GPU's fused choice
    opt = build_optimizer(optimizer_cfg({"type": "AdamW"}), (p for p in [one_param()]))
    assert opt.defaults["fused"] is None and len(opt.param_groups[0]["params"]) == 1
    groups = ({"params": (p for p in [one_param(), one_param()])} for _ in range(2))  # generators all the way
    opt = build_optimizer(optimizer_cfg({"type": "Adam", "params": {"foreach": True}}), groups)
    assert opt.defaults["foreach"] is True and opt.defaults["fused"] is None
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]


@pytest.mark.parametrize("section", [{"type": "Lamb"}])
def test_unsupported_optimizer_settings_raise(section: dict) -> None:
    with pytest.raises(NotSupportedError):
        build_optimizer(optimizer_cfg(section), [one_param()])


# ------------------------------------------------------------------------------------------- schedulers
def sgd(lr: float = 0.1, groups: int = 1) -> torch.optim.SGD:
    return torch.optim.SGD([{"params": [one_param()]} for _ in range(groups)], lr=lr)


def lr_after_steps(sched: Schedule, n: int) -> float:
    opt = sched.optimizer
    for _ in range(n):
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


def test_no_scheduler_section_gives_none() -> None:
    assert build_scheduler(None, sgd()) is None


def test_warmup_lr_log_matches_hand_values() -> None:
    sched = build_scheduler(scheduler_cfg({"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10}}), sgd())
    assert isinstance(sched, WarmupLR)
    assert sched.lr_at(-1) == [0.0] and sched.lr_at(0) == [0.0]
    assert sched.lr_at(4)[0] == pytest.approx(0.01 * 0.6989700043)  # log(5)/log(10)
    assert sched.lr_at(9)[0] == pytest.approx(0.01)
    assert sched.lr_at(500)[0] == pytest.approx(0.01)


def test_warmup_lr_linear_defaults_max_to_optimizer_lr() -> None:
    sched = build_scheduler(scheduler_cfg({"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}}), sgd(lr=0.05))
    assert sched.lr_at(2)[0] == pytest.approx(0.01 + 0.04 * 0.5)
    assert sched.lr_at(4)[0] == pytest.approx(0.05)


def test_stepping_follows_deepspeed_iteration_count() -> None:
    """After n scheduler steps the lr is DeepSpeed's at last_batch_iteration n - 1."""
    sched = build_scheduler(scheduler_cfg({"type": "WarmupLR", "params": {
        "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}}), sgd())
    opt = sched.optimizer
    assert opt.param_groups[0]["lr"] == 0.0  # like DeepSpeed right after construction
    assert lr_after_steps(sched, 1) == pytest.approx(0.0)
    assert lr_after_steps(sched, 1) == pytest.approx(0.01)
    assert lr_after_steps(sched, 5) == pytest.approx(0.06)
    assert lr_after_steps(sched, 100) == pytest.approx(0.1)


def test_warmup_decay_lr_hand_values() -> None:
    sched = build_scheduler(scheduler_cfg({"type": "WarmupDecayLR", "params": {
        "total_num_steps": 20, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}}), sgd())
    assert isinstance(sched, WarmupDecayLR)
    expected = {-1: 0.0, 5: 0.05, 10: 0.1, 15: 0.05, 19: 0.01, 20: 0.0, 30: 0.0}
    for it, lr in expected.items():
        assert sched.lr_at(it)[0] == pytest.approx(lr), it


def test_warmup_decay_lr_default_max_is_1e_3_and_decays_to_min() -> None:
    sched = build_scheduler(scheduler_cfg({"type": "WarmupDecayLR", "params": {
        "total_num_steps": 10, "warmup_min_lr": 1e-4, "warmup_num_steps": 2}}), sgd(lr=0.5))
    assert sched.lr_at(2)[0] == pytest.approx(1e-3)
    assert sched.lr_at(10)[0] == pytest.approx(1e-4)


def test_warmup_cosine_lr_hand_values() -> None:
    sched = build_scheduler(scheduler_cfg({"type": "WarmupCosineLR", "params": {
        "total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear"}}), sgd(lr=0.1))
    assert isinstance(sched, WarmupCosineLR)
    assert sched.lr_at(-1) == [0.0]
    assert sched.lr_at(2)[0] == pytest.approx(0.04)
    # first cosine step: progress 1/15, ratio = 1e-4 + (1 - 1e-4) * (1 + cos(12 deg)) / 2
    assert sched.lr_at(5)[0] == pytest.approx(0.098907489, rel=1e-7)
    # progress 8/15: (1 + cos(96 deg)) / 2 = 0.4477357685
    assert sched.lr_at(12)[0] == pytest.approx(0.1 * (1e-4 + 0.9999 * 0.4477357685), rel=1e-7)
    assert sched.lr_at(19)[0] == pytest.approx(1e-5)
    assert sched.lr_at(100)[0] == pytest.approx(1e-5)  # clamped at the floor, no second cosine


def test_warmup_cosine_lr_min_ratio_and_log_warmup() -> None:
    sched = WarmupCosineLR(sgd(lr=1.0), total_num_steps=100, warmup_min_ratio=0.1, warmup_num_steps=10)
    assert sched.ratio_at(0) == pytest.approx(0.1)
    assert sched.ratio_at(4) == pytest.approx(0.1 + 0.9 * math.log(5) / math.log(10))


def test_cosine_scales_each_param_group() -> None:
    opt = sgd(lr=0.1, groups=2)
    opt.param_groups[1]["lr"] = 1.0
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=4, warmup_type="linear")
    assert sched.lr_at(2) == pytest.approx([0.05, 0.5])


def test_single_warmup_step_is_treated_as_two() -> None:
    sched = WarmupLR(sgd(), warmup_max_lr=1.0, warmup_num_steps=1)
    assert sched.warmup_num_steps == 2 and sched.lr_at(1)[0] == pytest.approx(1.0)


def test_scheduler_state_round_trip() -> None:
    section = {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5}}
    first = build_scheduler(scheduler_cfg(section), sgd())
    lr_after_steps(first, 7)
    second = build_scheduler(scheduler_cfg(section), sgd())
    second.load_state_dict(first.state_dict())
    assert lr_after_steps(second, 3) == pytest.approx(lr_after_steps(first, 3))


def test_direct_construction_warns_on_unknown_warmup_type_and_warms_up_on_log() -> None:
    # DeepSpeed's class falls back to the log curve (the config refuses the value, naming the key)
    with pytest.warns(UserWarning, match="warmup_type 'cosine'"):
        sched = WarmupLR(sgd(), warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="cosine")
    assert sched.warmup_type == "log" and sched.lr_at(4)[0] == pytest.approx(math.log(5) / math.log(10))


# ------------------------------------------------------------------------------ Adam without bias correction
def _uncorrected_reference(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, betas: tuple[float, float],
                           eps: float, wd: float, adamw: bool) -> torch.Tensor:
    """DeepSpeed FusedAdam with bias_correction=False, written out in float64."""
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    for g in grads:
        g = g.double() if adamw else g.double() + wd * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        update = m / (v.sqrt() + eps) + (wd * p if adamw else 0)
        p = p - lr * update
    return p


@pytest.mark.parametrize("kind, adam_w_mode", [("Adam", True), ("Adam", False), ("AdamW", True)])
def test_bias_correction_false_steps_without_correction(kind: str, adam_w_mode: bool) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    p0 = p.detach().clone()
    params = {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1, "bias_correction": False,
              "adam_w_mode": adam_w_mode}
    opt = build_optimizer(optimizer_cfg({"type": kind, "params": params}), [p])
    grads = [torch.randn(64) for _ in range(5)]
    for g in grads:
        p.grad = g.clone()
        opt.step()
    decoupled = kind == "AdamW" or adam_w_mode
    want = _uncorrected_reference(p0, grads, 0.01, (0.8, 0.99), 1e-6, 0.1, decoupled)
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)
    # and it is not torch's corrected Adam: the first steps differ by about 1 / (1 - beta1)
    ref = torch.nn.Parameter(p0.clone())
    torch_opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([ref], lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                                                      weight_decay=0.1)
    for g in grads:
        ref.grad = g.clone()
        torch_opt.step()
    assert (ref.detach() - p.detach()).abs().max() > 1e-3
    state = opt.state_dict()["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"].item() == 5.0
