"""Frozen parameters in units of their own (Note [frozen units] in ``partition/unit.py``): a LoRA-style fine-tune
of a real ``transformers`` Llama, stage 3, 2 nodes x 2 ranks, bf16.

Against the same engine with every module's parameters in one unit (the layout before frozen units): the same
losses bit for bit, no gradient row for a frozen weight, each unit gathered once per backward, and the frozen
weights' exact fp32 values kept for checkpoints and export.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

import zeropp
from support.hf_models import hf_batch, hf_loss
from support.lora import lora_llama, train_lora
from support.world import run_world
from zeropp.partition.unit import FrozenUnit
from zeropp.zero import unit_build

WORLD, PER_NODE, MICRO, STEPS = 4, 2, 2, 5
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": PER_NODE, "zero_quantized_gradients": True}


def _engine(zero: dict, seed: int = 0, world: int = WORLD):
    cfg = {"train_batch_size": WORLD * MICRO, "train_micro_batch_size_per_gpu": WORLD * MICRO // world,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, **zero}, "topology": {"ranks_per_node": PER_NODE}}
    return zeropp.initialize(model=lora_llama(seed), config=cfg)[0]


def _whole(zero: dict):
    """The engine with each module's parameters in one unit, frozen or not (the layout before frozen units)."""
    split = unit_build._split_frozen
    unit_build._split_frozen = lambda state, params: [(params, False)]
    try:
        return _engine(zero)
    finally:
        unit_build._split_frozen = split


def _train(engine, rank: int, steps: int, first: int = 0) -> list[float]:
    return train_lora(engine, rank, steps, first, WORLD, WORLD * MICRO)


def _run(engine, rank: int) -> dict:
    losses = _train(engine, rank, STEPS)
    comm = engine.comm_report()
    return {
        "losses": losses, "memory": engine.model_state_bytes(),
        "forward": sum(comm["forward_gather"].values()), "backward": sum(comm["backward_gather"].values()),
        "backward_inter": comm["backward_gather"]["inter_node_bytes"],
        "trainable_rows": sum(u.row.numel for u in engine.units if u.steps),
        "all_rows": sum(u.row.numel for u in engine.units),
        "mixed": [u.module_name for u in engine.units
                  if 0 < sum(s.param.requires_grad for s in u.slots) < len(u.slots)],
        "frozen_units": sum(isinstance(u, FrozenUnit) for u in engine.units),
        "frozen_state": {n: t for n, t in engine.consolidated_state_dict().items() if "lora" not in n},
    }


def measure(rank: int, world: int, root: str) -> dict:
    out = {"apart": _run(_engine({}), rank), "whole": _run(_whole({}), rank),
           "zeropp_apart": _run(_engine(ZEROPP), rank), "zeropp_whole": _run(_whole(ZEROPP), rank)}
    # resume from a checkpoint into an engine started from another random base and adapters
    a = _engine(ZEROPP)
    _train(a, rank, 2)
    a.save_checkpoint(os.path.join(root, "ckpt"), tag="t")
    out["resume"] = {"a": _train(a, rank, 2, first=2)}
    b = _engine(ZEROPP, seed=1)
    b.load_checkpoint(os.path.join(root, "ckpt"), tag="t")
    out["resume"]["b"] = _train(b, rank, 2, first=2)
    return out


@functools.lru_cache(maxsize=1)
def results(root: str) -> list[dict]:
    return run_world(measure, WORLD, root, ranks_per_node=PER_NODE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return results(str(tmp_path_factory.mktemp("frozen_units")))


def test_frozen_parameters_get_units_of_their_own_and_the_same_losses(runs: list[dict]) -> None:
    for r in runs:
        apart, whole = r["apart"], r["whole"]
        assert whole["mixed"] and not apart["mixed"]  # q/v projections mixed adapters and frozen weights
        assert apart["frozen_units"] > 0 and whole["frozen_units"] == 0
        assert apart["losses"] == whole["losses"]  # the same sums and steps, bit for bit
        assert sum(apart["losses"][-2:]) < sum(apart["losses"][:2])
        assert r["zeropp_apart"]["losses"] == r["zeropp_whole"]["losses"]


def test_frozen_weights_hold_no_gradient_row(runs: list[dict]) -> None:
    for r in runs:
        for name in ("apart", "zeropp_apart"):
            run, whole = r[name], r[name.replace("apart", "whole")]
            assert run["memory"]["grad_shard"] == 2 * run["trainable_rows"]  # bf16 rows of the adapters only
            assert whole["memory"]["grad_shard"] == 2 * whole["all_rows"]
            assert run["trainable_rows"] * 10 < run["all_rows"]  # adapters: 224 of 6,424 row elements
            # masters and shards are the same bytes in both layouts
            for key in ("master_fp32", "shard_16bit"):
                assert run["memory"][key] == whole["memory"][key], key


def test_each_unit_is_gathered_once_per_backward(runs: list[dict]) -> None:
    for r in runs:
        apart, whole = r["apart"], r["whole"]
        assert apart["forward"] == whole["forward"]
        # each unit once per backward in both layouts: a unit mixing adapters and frozen weights is kept for its
        # inputs' gradient (Note [frozen units in backward]); it was gathered again once its adapters' were in
        assert apart["backward"] <= apart["forward"] and whole["backward"] <= whole["forward"]
        assert r["zeropp_apart"]["backward_inter"] == 0  # hpZ serves every frozen unit's backward gather


def test_frozen_weights_keep_their_exact_values(runs: list[dict]) -> None:
    init = {n: p.detach() for n, p in lora_llama(0).named_parameters() if not p.requires_grad}
    for r in runs:
        for name in ("apart", "zeropp_apart"):
            state = r[name]["frozen_state"]
            assert init.keys() <= state.keys()
            for n, t in init.items():
                assert torch.equal(state[n], t), n  # fp32, not their bf16 rounding


def test_resume_with_frozen_units_is_bit_identical(runs: list[dict]) -> None:
    for r in runs:
        assert r["resume"]["a"] == r["resume"]["b"]


def test_a_parameter_unfrozen_after_initialize_is_refused_by_name() -> None:
    engine = zeropp.initialize(model=lora_llama(0), config={
        "train_batch_size": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})[0]
    engine.module.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    x, y = hf_batch(0, 2)
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*frozen"):
        hf_loss(engine, x, y)
    with torch.no_grad():  # evaluation does not ask
        assert torch.isfinite(hf_loss(engine, x, y))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_requires_grad_changed_after_initialize_is_refused_at_every_stage(stage: int, change: str) -> None:
    # Before the check at step(), stages 0-2 dropped an unfrozen weight's gradient, and every stage went on
    # moving a weight frozen after initialize (its Adam moments and weight decay, with zero gradients).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model[0].requires_grad_(change == "freeze")
    engine = zeropp.initialize(model=model, config={
        "train_batch_size": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})[0]
    x = torch.randn(2, 8)
    for _ in range(2):  # moments for the weight that is frozen next
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    model[0].requires_grad_(change == "unfreeze")
    before = engine.consolidated_state_dict()["0.weight"].clone()
    what = "were frozen .* require grad now" if change == "unfreeze" else "required grad .* frozen now"
    with pytest.raises(RuntimeError, match=rf"\['0\.weight', '0\.bias'\] {what}"):
        engine.backward(engine(x).pow(2).mean())  # stage 3 refuses an unfrozen unit already in its forward
        engine.step()
    assert torch.equal(engine.consolidated_state_dict()["0.weight"], before)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_left_out_of_some_micro_steps_of_a_window_train_as_torch(stage: int) -> None:
    """DeepSpeed's "unbalanced gradients": ``requires_grad`` turned off for some micro-steps of an accumulation
    window, every parameter getting its gradient from the others. Each step equals torch's AdamW on the
    window's accumulated gradients."""
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def toggle(model: torch.nn.Module, micro: int) -> None:
        for j, p in enumerate(model.parameters()):
            p.requires_grad_(j % 2 == micro % 2)

    batches = [torch.randn(2, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    engine = zeropp.initialize(model=make(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}})[0]
    ref = make()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for i, x in enumerate(batches):
        toggle(engine.module, i)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        toggle(ref, i)
        (ref(x).pow(2).mean() / 2).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
        for model in (engine.module, ref):
            model.requires_grad_(True)
    got = engine.consolidated_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6)
