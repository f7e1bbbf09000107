"""Stage-3 gather granularity: one unit per transformer block or one per module moves the same bytes and
trains bit-identically (only the number and size of collectives differ); a block's submodule run on its own
gathers its block on demand."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import zeropp
from support.world import run_world
from zeropp.demo.data import corpus_tokens, get_batch
from zeropp.demo.model import GPT, GPTConfig

CFG = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "topology": {"ranks_per_node": 2},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                             "zero_quantized_gradients": True}}


def train(rank: int, world: int, granularity: str) -> dict:
    cfg = {**CFG, "zero_optimization": {**CFG["zero_optimization"], "gather_granularity": granularity}}
    torch.manual_seed(0)
    engine, *_ = zeropp.initialize(model=GPT(GPTConfig(block_size=32, n_layer=3, n_embd=48)), config=cfg)
    tokens = corpus_tokens()
    losses = []
    for step in range(3):
        x, y = get_batch(tokens, step, 2 * world, 32, seed=1, rank=rank, world_size=world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "units": len(engine.units), "comm": engine.comm_report()}


class Bypass(nn.Module):
    """Calls a block's inner Linear directly, skipping the block's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0][0](x)).sum()


def bypass(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Bypass()
    want = model(torch.ones(1, 4)).item()
    engine, *_ = zeropp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                        "zero_optimization": {"stage": 3}})
    got = []
    for _ in range(2):  # the second forward releases the block where the first one learned to
        loss = engine(torch.ones(1, 4))
        engine.backward(loss)
        got.append(loss.item())
    return {"want": want, "got": got, "gathered": [u.state.value for u in engine.units]}


def scenarios(rank: int, world: int) -> dict:
    return {"block": train(rank, world, "block"), "module": train(rank, world, "module"),
            "bypass": bypass(rank, world)}


@functools.lru_cache(maxsize=None)
def results() -> list:
    return run_world(scenarios, 4)


def test_block_and_module_units_train_identically_with_the_same_bytes():
    for res in results():
        assert res["block"]["units"] < res["module"]["units"]  # 3 layers: 6 units instead of 21
        assert res["block"]["losses"] == res["module"]["losses"]
        assert res["block"]["comm"] == res["module"]["comm"]


def test_a_block_submodule_run_on_its_own_gathers_its_block():
    for res in results():
        assert res["bypass"]["got"] == [res["bypass"]["want"]] * 2
        assert set(res["bypass"]["gathered"]) == {"sharded"}  # nothing left gathered after the pass
