"""Stage-3 gather granularity: one unit per transformer block or one per module moves the same bytes and
trains bit-identically (only the number and size of collectives differ); a block's submodule run on its own
raises an error naming both."""
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


def bypass(rank: int, world: int) -> str:
    engine, *_ = zeropp.initialize(model=Bypass(), config={"train_micro_batch_size_per_gpu": 1,
                                                           "zero_optimization": {"stage": 3}})
    try:
        engine(torch.ones(1, 4))
    except RuntimeError as err:
        return str(err)
    return "no error"


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


def test_a_block_submodule_run_on_its_own_is_a_clear_error():
    for res in results():
        assert "'blocks.0.0' ran outside the forward of 'blocks.0'" in res["bypass"]
        assert "gather_granularity" in res["bypass"]
