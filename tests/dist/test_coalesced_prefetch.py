"""Coalesced prefetch (``zeropp_coalesced_prefetch``, Note [coalesced prefetch] in ``zero/memory.py``): on one node,
a prefetch takes the small units that followed the next one last time into one collective. Losses are the ones of
the same run without prefetch (an all-gather only moves bytes), the collectives per step fall from one per unit to a
few, the buffers stay within their bound, and a unit prefetched but not run this time (a block skipped) is drained
without harm."""
from __future__ import annotations

import functools

import torch
from torch import nn

import zeropp
from support.world import run_world
from zeropp.comm.ledger import Phase
from zeropp.tools.cluster_bench.models import LaunchBound

BLOCKS, STEPS = 12, 4


class SkipsABlock(LaunchBound):
    """Skips block 5 on odd steps (a layer drop): a prefetch made from the last order brings a unit not run."""

    def __init__(self) -> None:
        super().__init__(BLOCKS, 32)
        self.skip = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for i, block in enumerate(self.transformer.h):
            if not (self.skip and i == 5):
                x = block(x)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(rank: int, prefetch: bool, skipping: bool) -> dict:
    torch.manual_seed(0)
    model = SkipsABlock() if skipping else LaunchBound(BLOCKS, 32)
    zero = {"stage": 3, "zeropp_coalesced_prefetch": True} if prefetch else \
        {"stage": 3, "stage3_prefetch_bucket_size": 0}
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zeropp.initialize(model=model, config=cfg)
    losses, calls = [], []
    for step in range(STEPS):
        model.skip = skipping and step % 2 == 1
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 256, (2, 17), generator=g)
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        calls.append(sum(t.calls for (phase, _), t in engine.ledger.last_step.items()
                         if phase is Phase.FORWARD_GATHER))
    buffers = engine.memory_report()["buffers"]
    out = {"losses": losses, "forward_gathers": calls, "units": len(engine.units),
           "within": all(b["bytes"] <= b["bound"] for b in buffers.values())}
    engine.close()
    return out


def worker(rank: int, world: int) -> dict:
    return {(prefetch, skipping): train(rank, prefetch, skipping)
            for prefetch in (True, False) for skipping in (False, True)}


@functools.lru_cache(maxsize=None)
def results() -> list:
    return run_world(worker, 2)


def test_coalesced_gathers_give_the_losses_of_gathers_one_at_a_time():
    for res in results():
        for skipping in (False, True):
            assert res[(True, skipping)]["losses"] == res[(False, skipping)]["losses"], skipping


def test_a_step_gathers_its_small_units_in_a_few_collectives():
    for res in results():
        alone, coalesced = res[(False, False)], res[(True, False)]
        assert alone["forward_gathers"][1:] == [alone["units"]] * (STEPS - 1)  # one collective per unit
        # from the second step on (the first learns the order): the first unit, then one batch
        assert all(n <= 3 for n in coalesced["forward_gathers"][1:]), coalesced["forward_gathers"]
        assert coalesced["within"] and alone["within"]


def test_a_prefetched_unit_the_model_skips_is_drained():
    for res in results():
        skipped = res[(True, True)]
        assert skipped["within"]
        assert skipped["forward_gathers"][1] < skipped["units"]


def warns_where_nothing_coalesces(rank: int, world: int) -> list[str]:
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zeropp.initialize(model=LaunchBound(2, 16), config={
            "train_micro_batch_size_per_gpu": 2, "topology": {"ranks_per_node": 2},
            "zero_optimization": {"stage": 3, "zeropp_coalesced_prefetch": True}})
    engine.close()
    return [str(w.message) for w in caught if "zeropp_coalesced_prefetch" in str(w.message)]


def test_the_switch_says_when_it_has_no_effect():
    # 2 nodes x 2 ranks: the world's gathers take two hops, which are not coalesced; the key is not ignored silently
    for messages in run_world(warns_where_nothing_coalesces, 4, ranks_per_node=2):
        assert len(messages) == 1 and "no effect" in messages[0] and "two-hop" in messages[0]
