"""Stage-3 gather granularity: one unit per transformer block or one per module moves the same bytes and
trains bit-identically (only the number and size of collectives differ); a block's submodule run on its own
gathers its block on demand. DeepSpeed's granularity threshold makes blocks leaves by its own rule, and its
persistence threshold keeps small units gathered between steps (Note [persistent units]): fewer gathers,
the same losses."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import zeropp
from support.world import run_world
from zeropp.tools.demo.data import corpus_tokens, get_batch
from zeropp.tools.demo.model import GPT, GPTConfig
from zeropp.partition.assign import granularities

CFG = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "topology": {"ranks_per_node": 2},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                             "zero_quantized_gradients": True}}


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, n_layer=3, n_embd=48))


def block_score() -> float:
    """A block's granularity by DeepSpeed's rule (checked by hand in test_partition_assign.py)."""
    gpt = model()
    return granularities(gpt)[gpt.transformer.h[0]]


def train(rank: int, world: int, granularity: str, **zero: int) -> dict:
    cfg = {**CFG, "zero_optimization": {**CFG["zero_optimization"], "gather_granularity": granularity, **zero}}
    engine, *_ = zeropp.initialize(model=model(), config=cfg)
    tokens = corpus_tokens()
    losses = []
    for step in range(3):
        x, y = get_batch(tokens, step, 2 * world, 32, seed=1, rank=rank, world_size=world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "units": len(engine.units), "comm": engine.comm_report(),
            "kept": sorted(u.module_name for u in engine.units if u in engine.state.kept),
            "gathered": sorted(u.module_name for u in engine.units if u.state.value == "gathered")}


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
            "bypass": bypass(rank, world),
            # LayerNorms (2 x 48 elements) persist, Linears (>= 2,352) do not
            "persist": train(rank, world, "module", stage3_param_persistence_threshold=96),
            "granular": train(rank, world, "module", stage3_module_granularity_threshold=int(block_score()))}


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


def test_the_granularity_threshold_makes_each_block_a_leaf():
    for res in results():
        assert res["granular"]["units"] == res["block"]["units"]
        assert res["granular"]["losses"] == res["block"]["losses"]
        assert res["granular"]["comm"] == res["block"]["comm"]


def test_persistent_units_are_gathered_once_per_step_and_train_the_same():
    for res in results():
        persist, module = res["persist"], res["module"]
        lns = [f"transformer.h.{i}.{ln}" for i in range(3) for ln in ("ln_1", "ln_2")] + ["transformer.ln_f"]
        assert persist["kept"] == sorted(lns)
        assert persist["gathered"] == persist["kept"]  # held past the step; the others released
        # the LayerNorms' weights change every step: equal losses mean each step's first use re-gathered them
        assert persist["losses"] == module["losses"]
        gathered = lambda c: sum(v for phase, links in c.items() if "gather" in phase for v in links.values())
        assert 0 < gathered(persist["comm"]) < gathered(module["comm"])
