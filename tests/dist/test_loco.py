"""LoCo error feedback for qgZ (plus/loco.py): the mean is kept on 3 nodes x 2 ranks, what 2-bit rounding loses
comes back in later steps, the kept errors are exactly what each rank quantizes (bytes against the formula),
and the step counter zeroes them every ``reset_T`` steps."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from support.qgz_case import BLOCK, SEGMENTS, bucket_for, exact_mean
from support.world import run_world
from zeropp import topology
from zeropp.comm.ledger import CommLedger
from zeropp.comm.ops import Comm
from zeropp.plus.loco import BucketKeys, Loco, Shape, Stage, element_debt, map_states
from zeropp.plus.qgz import QuantizedReduce

STEPS = 12
NAMES = tuple(f"p{i}" for i in range(len(SEGMENTS)))


def _reduce_steps(rank: int, world: int, bits: int, beta: float | None) -> dict:
    """STEPS reductions of the same bucket; the per-step results and the kept errors' bytes."""
    topo = topology.build(ranks_per_node=2)
    comm = Comm(topo, CommLedger())
    loco = Loco(beta, 1000, BLOCK) if beta is not None else None
    qgz = QuantizedReduce(comm, bits, BLOCK, loco)
    bucket = bucket_for(rank, world, torch.float32)
    results = []
    for _ in range(STEPS):
        pending = qgz.start(bucket, SEGMENTS, NAMES)
        results.append(pending.finish().clone())
        pending.recycle()
        qgz.end_step()
    kept = loco.nbytes() if loco is not None else {}
    return {"results": results, "kept": kept, "nodes": topo.num_nodes, "d": topo.ranks_per_node}


@functools.lru_cache(maxsize=None)
def world6(bits: int, beta: float | None) -> list[dict]:
    return run_world(_reduce_steps, 6, bits, beta, ranks_per_node=2)


def _bytes(rows: int) -> int:
    """int8 errors of ``rows`` rows of every segment: one byte per element plus an fp32 scale per block."""
    return rows * sum(c + 4 * math.ceil(c / BLOCK) for c in SEGMENTS)


def _gain(got: torch.Tensor, want: torch.Tensor) -> float:
    """The least-squares factor ``a`` in ``got ~ a * want``: 1 for a mean, D or n for the public fault."""
    return float((got @ want) / (want @ want))


@pytest.mark.parametrize("bits,per_step", [(2, 0.5), (4, 0.1)])
def test_mean_is_kept_on_3_nodes_x_2(bits: int, per_step: float) -> None:
    """Each step's result is the mean, not D or n times it (the public fault): its gain against the exact mean
    is 1 within the rounding noise, and the average over steps has a gain of 1 within 2%."""
    exact = exact_mean(6, torch.float32)
    for rank, got in enumerate(world6(bits, 0.0)):
        want = exact[rank]
        for step in got["results"]:
            assert abs(_gain(step, want) - 1.0) < per_step, rank
        assert abs(_gain(torch.stack(got["results"]).mean(0), want) - 1.0) < 0.02, rank


def test_error_feedback_cancels_rounding_bias() -> None:
    """With a constant gradient, plain 2-bit qgZ repeats the same rounding error every step; with LoCo the
    running average of what arrives approaches the exact mean (several times closer after 12 steps)."""
    exact = exact_mean(6, torch.float32)
    for rank, (plain, loco) in enumerate(zip(world6(2, None), world6(2, 0.0))):
        want = exact[rank]
        err_plain = float((torch.stack(plain["results"]).mean(0) - want).norm())
        err_loco = float((torch.stack(loco["results"]).mean(0) - want).norm())
        assert err_loco < 0.4 * err_plain, (rank, err_loco, err_plain)


def test_moving_average_beta_still_helps() -> None:
    exact = exact_mean(6, torch.float32)
    for rank, (plain, loco) in enumerate(zip(world6(2, None), world6(2, 0.8))):
        want = exact[rank]
        err_plain = float((torch.stack(plain["results"]).mean(0) - want).norm())
        err_loco = float((torch.stack(loco["results"]).mean(0) - want).norm())
        assert err_loco < err_plain, (rank, err_loco, err_plain)


def test_kept_errors_are_what_each_rank_quantizes() -> None:
    """Per rank: the first stage keeps W rows (its own gradient, about M), the second n rows (its node's partial
    sums, about M / D), as int8 plus a scale per block; measured from the tensors."""
    for got in world6(2, 0.0):
        assert got["kept"] == {"loco_first": _bytes(6), "loco_second": _bytes(got["nodes"])}


def test_reset_every_T_steps() -> None:
    loco = Loco(0.5, 3, BLOCK)
    keys = BucketKeys(("a",), (10,))
    comp = loco.compensate(Stage.FIRST, keys, torch.ones(2, 10))
    loco.keep(Stage.FIRST, keys, comp, torch.zeros(2, 10))
    assert loco.nbytes()["loco_first"] > 0
    loco.end_step()
    loco.end_step()
    assert loco.nbytes()["loco_first"] > 0
    loco.end_step()
    assert loco.nbytes()["loco_first"] == 0


def test_non_finite_values_keep_the_old_error() -> None:
    loco = Loco(0.0, 100, BLOCK)
    keys = BucketKeys(("a",), (4,))
    comp = loco.compensate(Stage.FIRST, keys, torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    loco.keep(Stage.FIRST, keys, comp, torch.tensor([[0.5, 2.0, 3.0, 4.0]]))
    comp = loco.compensate(Stage.FIRST, keys, torch.tensor([[float("inf"), 0.0, 0.0, 0.0]]))
    loco.keep(Stage.FIRST, keys, comp, torch.zeros(1, 4))
    kept = loco.memories[Stage.FIRST].as_dense()["a"]
    assert torch.isfinite(kept).all()
    assert float(kept[0, 0]) == pytest.approx(0.5, rel=0.01)


@pytest.mark.parametrize("new", [(1, 2), (2, 1), (3, 2), (2, 2), (1, 4)])
def test_mapping_keeps_each_elements_debt(new: tuple[int, int]) -> None:
    """4 ranks as 2x2 -> another topology: per element, sum(e) / W over all kept errors is preserved (to the
    int8 storage's rounding)."""
    numel, old_shape = 203, Shape(2, 2)
    g = torch.Generator().manual_seed(3)
    old = []
    for p in range(old_shape.world):
        loco = Loco(0.8, 100, BLOCK)
        chunk = max(2, 2 * -(-numel // 8))  # ShardSpec.chunk on 4 ranks
        loco.memories[Stage.FIRST].write(BucketKeys(("w",), (chunk,)), torch.randn(4, chunk, generator=g))
        loco.memories[Stage.SECOND].write(BucketKeys(("w",), (chunk,)), torch.randn(2, chunk, generator=g))
        loco.steps = 5
        old.append(loco.state_dict())
    new_shape = Shape(*new)
    chunk = max(2, 2 * -(-numel // (2 * new_shape.world)))  # ShardSpec.chunk
    mapped = [map_states(old, old_shape, new_shape, r, {"w": (numel, chunk)}, BLOCK) for r in range(new_shape.world)]
    assert all(m["steps"] == 5 for m in mapped)
    torch.testing.assert_close(element_debt(mapped, new_shape, "w", numel), element_debt(old, old_shape, "w", numel),
                               atol=0.05, rtol=0)
    rows = new_shape.nodes if new_shape.has_second else None
    for m in mapped:
        assert m["first"]["w"][0].shape[0] == new_shape.world
        assert (m["second"]["w"][0].shape[0] if "w" in m["second"] else None) == rows


def test_a_new_loss_scale_rescales_the_kept_errors() -> None:
    """fp16: errors are kept in loss-scaled units; when the scale halves, so must they."""
    loco = Loco(0.0, 100, BLOCK)
    keys = BucketKeys(("a",), (4,))
    comp = loco.compensate(Stage.FIRST, keys, torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    loco.keep(Stage.FIRST, keys, comp, torch.tensor([[0.5, 2.0, 3.0, 3.0]]))
    before = loco.memories[Stage.FIRST].as_dense()["a"]
    loco.end_step(0.5)
    torch.testing.assert_close(loco.memories[Stage.FIRST].as_dense()["a"], before * 0.5)
