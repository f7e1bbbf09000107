"""LoCo's kept errors in checkpoints: a resume on the same topology continues bit for bit; on 2 ranks a
4-rank checkpoint's errors are mapped (each element's debt kept, Note [mapping kept errors]) or, from a
checkpoint saved without LoCo, start from zero with a warning."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import zeropp
from support.models import TiedNet
from support.train import config, train_steps
from support.world import run_world
from zeropp.plus.loco import Shape, Stage, element_debt

GB = 8
BF16 = {"bf16": {"enabled": True}}
LOCO = {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4,
        "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1000}}


def _engine(loco: bool, ranks_per_node: int):
    torch.manual_seed(0)
    zero = LOCO if loco else {"zero_quantized_gradients": True}
    cfg = {**config(GB, **zero), **BF16, "topology": {"ranks_per_node": ranks_per_node}}
    engine, *_ = zeropp.initialize(model=TiedNet(), config=cfg)
    return engine


def _kept(engine) -> dict:
    loco = engine.strategies.reduce.loco
    return {s.value: loco.memories[s].as_dense() for s in Stage}


def four_ranks(rank: int, world: int, root: str) -> dict:
    a = _engine(True, 2)
    train_steps(a, rank, world, 3, GB)
    a.save_checkpoint(os.path.join(root, "loco"), tag="t")
    saved = {"state": a.strategies.reduce.state_dict()["loco"], "kept": _kept(a)}
    chunks = [s.spec.chunk for u in a.units for s in u.slots if s.param.requires_grad]
    # first stage: W rows of each chunk, second: n rows; int8 plus an fp32 scale per block of 2048
    formula = sum((world + world // 2) * (c + 4 * -(-c // 2048)) for c in chunks)
    memory = {"measured": a.model_state_bytes()["reduce_state"], "formula": formula}
    after_a = train_steps(a, rank, world, 3, GB)
    b = _engine(True, 2)
    b.load_checkpoint(os.path.join(root, "loco"), tag="t")
    loaded = b.strategies.reduce.state_dict()["loco"]
    after_b = train_steps(b, rank, world, 3, GB)
    plain = _engine(False, 2)
    train_steps(plain, rank, world, 1, GB)
    plain.save_checkpoint(os.path.join(root, "plain"), tag="t")
    return {"saved": saved, "loaded": loaded, "after_a": after_a, "after_b": after_b, "memory": memory,
            "numels": {n: p.numel() for n, p in a.module.named_parameters()}}


def two_ranks(rank: int, world: int, root: str) -> dict:
    out = {}
    for name in ("loco", "plain"):
        e = _engine(True, 1)  # 2 nodes x 1: no second stage any more
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            e.load_checkpoint(os.path.join(root, name), tag="t")
        out[name] = {"warnings": [str(w.message) for w in caught if "LoCo" in str(w.message)],
                     "kept": _kept(e), "steps": e.strategies.reduce.state_dict()["loco"]["steps"]}
        out[name]["losses"] = train_steps(e, rank, world, 2, GB)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list, list]:
    root = str(tmp_path_factory.mktemp("loco"))
    four = run_world(four_ranks, 4, root, ranks_per_node=2)
    two = run_world(two_ranks, 2, root, ranks_per_node=1)
    return four, two


def test_resume_is_bit_for_bit(runs) -> None:
    four, _ = runs
    for r in four:
        assert r["after_a"] == r["after_b"]
        for stage in ("first", "second"):
            assert r["saved"]["state"][stage].keys() == r["loaded"][stage].keys() and r["saved"]["state"][stage]
            for name, (data, scales) in r["saved"]["state"][stage].items():
                assert torch.equal(data, r["loaded"][stage][name][0])
                assert torch.equal(scales, r["loaded"][stage][name][1])


def test_kept_errors_in_the_memory_report_equal_the_formula(runs) -> None:
    """Per rank: (W + n) int8 rows of every trainable chunk plus their scales: about M + M / D bytes."""
    four, _ = runs
    for r in four:
        assert r["memory"]["measured"] == r["memory"]["formula"] > 0


def test_four_to_two_maps_each_elements_debt(runs) -> None:
    four, two = runs
    numels = four[0]["numels"]
    old = [r["saved"]["state"] for r in four]
    assert all(not r["loco"]["warnings"] for r in two)
    assert all(r["loco"]["steps"] == 3 for r in two)
    checked = 0
    for name, numel in numels.items():
        if name not in old[0]["first"]:
            continue
        want = element_debt(old, Shape(2, 2), name, numel)
        got = sum(r["loco"]["kept"]["first"][name].reshape(-1)[:numel] for r in two) / 2
        assert not two[0]["loco"]["kept"]["second"]  # 2 x 1 has no second stage
        tol = 0.02 * float(want.abs().max()) + 1e-12
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        checked += 1
    assert checked > 0


def test_checkpoint_without_loco_resets_with_a_warning(runs) -> None:
    _, two = runs
    for r in two:
        assert len(r["plain"]["warnings"]) == 1 and "starts from zero" in r["plain"]["warnings"][0]
        assert r["plain"]["steps"] == 0
        assert all(len(r["plain"]["kept"][s]) == 0 for s in ("first", "second")) or r["plain"]["losses"]
        assert all(torch.isfinite(torch.tensor(r["plain"]["losses"])))
