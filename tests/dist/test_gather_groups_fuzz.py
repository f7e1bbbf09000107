"""Ranks that diverge at random never end in a signal or a hang: at stage 3 with gather groups (Note [gather
groups]), at stage 2 with gradients reduced by place (Note [positional buckets]); and what they train on is right.

Each case builds residual blocks of random small widths, some frozen, and from step 2 on rank 1 swaps two blocks,
shuffles them all, or leaves a frozen block out; at stage 2 it may also leave out any block. Every rank must end
each step the same way: the step trains on (a divergence that pairs every collective), or the collective order
check refuses it by name. Every step trained on must give the losses of one process that runs each rank's order
and steps on the mean of their gradients. At stage 2 every case trains on.

Measured before: at stage 3 one unit at a time (``zeropp_coalesced_prefetch: false``) the 24 stage 3 cases all
ended in a signal (gloo's SIGABRT in its size check, once a SIGSEGV), which is why no case runs that way here; at
stage 2 with buckets filled in arrival order, a trainable block left out on one rank ended in SIGABRT.

Twelve seeds for stage 3, each at one of the two group sizes in ``make test`` (every seed at both under
``pytest -m full_matrix``), twelve for stage 2, and one seed of each kind with its outcome.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch
from torch import nn

import zeropp
from support.matrix import Matrix
from support.world import run_world
from zeropp.zero.order_check import CollectiveOrderError

STEPS = 5
BUCKETS = (300, 100_000)  # stage3_prefetch_bucket_size: several groups, or the whole model in one


class Blocks(nn.Module):
    def __init__(self, widths: list[int], frozen: list[int]) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, w), nn.ReLU(), nn.Linear(w, 16)) for w in widths)
        for i in frozen:
            self.blocks[i].requires_grad_(False)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        h = self.inp(x)
        for i in order:
            h = h + self.blocks[i](h)
        return self.head(h).pow(2).mean()


def case(seed: int) -> tuple[list[int], list[int]]:
    rnd = random.Random(seed)
    n = rnd.randint(4, 10)
    widths = [rnd.choice([2, 3, 4, 6]) for _ in range(n)]
    return widths, [i for i in range(n) if rnd.random() < 0.4]


def order_of(seed: int, step: int, rank: int, n: int, frozen: list[int], stage: int) -> list[int]:
    order = list(range(n))
    r = random.Random(seed * 1000 + step * 10 + rank)
    if step >= 2 and rank == 1 and r.random() < 0.7:
        # (stage 3 refuses a trainable block left out, and ends in gloo's SIGABRT where the sizes differ)
        kind = r.choice(["swap", "skip_frozen", "shuffle"] + (["skip"] if stage < 3 else []))
        if kind == "swap":
            i, j = r.sample(range(n), 2)
            order[i], order[j] = order[j], order[i]
        elif kind == "skip_frozen" and frozen:
            order.remove(r.choice(frozen))
        elif kind == "skip":
            order.remove(r.choice(order))
        else:
            r.shuffle(order)
    return order


def data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def reference(seed: int, stage: int, world: int = 2) -> list[list[float]]:
    """One process: each rank's loss per step, SGD on the mean of the ranks' gradients."""
    widths, frozen = case(seed)
    torch.manual_seed(0)
    model = Blocks(widths, frozen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    out: list[list[float]] = [[] for _ in range(world)]
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world):
            loss = model(data(step, rank), order_of(seed, step, rank, len(widths), frozen, stage))
            (loss / world).backward()
            out[rank].append(float(loss.detach()))
        opt.step()
    return out


def train(rank: int, world: int, seed: int, bucket: int, stage: int) -> tuple[list[str], list[float]]:
    widths, frozen = case(seed)
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_prefetch_bucket_size": bucket}}
    if stage < 3:  # several reduce buckets a step, so that places matter
        cfg["zero_optimization"]["reduce_bucket_size"] = bucket
    engine, *_ = zeropp.initialize(model=Blocks(widths, frozen), config=cfg)
    out, losses = [], []
    for step in range(STEPS):
        loss = engine(data(step, rank), order_of(seed, step, rank, len(widths), frozen, stage))
        engine.backward(loss)
        try:
            engine.step()
        except CollectiveOrderError as e:
            assert "same modules" in str(e)
            out.append("refused")
            break
        out.append("trained")
        losses.append(float(loss.detach()))
    engine.close()
    return out, losses


def _check(seed: int, bucket: int, stage: int = 3) -> list[str]:
    results = run_world(functools.partial(train, seed=seed, bucket=bucket, stage=stage), 2, timeout=120)
    assert results[0][0] == results[1][0], results  # every rank ends each step the same way
    ref = reference(seed, stage)
    for rank, (_, losses) in enumerate(results):  # and what it trained on is right
        assert losses == pytest.approx(ref[rank][: len(losses)], rel=1e-5, abs=1e-7), (rank, losses, ref[rank])
    return results[0][0]


REFUSED_AT_2 = ["trained", "trained", "refused"]
TRAINS_ON = ["trained"] * STEPS


# one seed of each kind in make test: 0 shuffles all blocks, trainable ones among them (refused, in one group or
# several); 9 leaves a frozen block out (trains on); 8 shuffles blocks so that the trainable ones keep their order:
# with several groups the gathers differ (refused), in one group nothing a rank issues differs (trains on)
@pytest.mark.parametrize("seed,bucket,expected", [(0, 300, REFUSED_AT_2), (0, 100_000, REFUSED_AT_2),
                                                  (9, 300, TRAINS_ON), (9, 100_000, TRAINS_ON),
                                                  (8, 300, REFUSED_AT_2), (8, 100_000, TRAINS_ON)])
def test_a_divergent_rank_is_refused_by_name_or_trains_on(seed: int, bucket: int, expected: list[str]) -> None:
    assert _check(seed, bucket) == expected


@Matrix(seed=list(range(12)), bucket=list(BUCKETS)).parametrize  # each seed in make test, both sizes under full_matrix
def test_every_rank_ends_each_step_the_same_way(seed: int, bucket: int) -> None:
    assert _check(seed, bucket)[:2] == ["trained", "trained"]  # the ranks agree until rank 1 diverges at step 2


@pytest.mark.parametrize("seed", range(12))
def test_stage_2_trains_every_divergence_right(seed: int) -> None:
    """Stage 2 reduces gradients by place."""
    assert _check(seed, 300, stage=2) == TRAINS_ON
