"""`zeropp plan`'s memory model against the engine: `plan.memory.model_states` equals
`engine.model_state_bytes()` kind by kind, for every stage, each ZeRO++ technique and their combination, two hpZ
group sizes, int4 weights / int8 gradients, optimizer offload, and fp32, on 4 ranks of 2 per node.

Measured after a backward and before its step, on the second step (Adam's moments exist by then): the point
where a step holds the most model states (stages 0-1 hold whole gradients; hpZ's slices exist since forward).
"""
from __future__ import annotations

import functools

import pytest
import torch

import zeropp
from support.models import TiedNet, rank_slice, tied_batch
from support.train import ADAMW
from support.world import run_world
from zeropp.tools.plan.choices import Choice, config_json
from zeropp.tools.plan.memory import KINDS, model_states

WORLD, PER_NODE, GB = 4, 2, 8
CASES = {
    "stage0": (Choice(0), True), "stage1": (Choice(1), True), "stage2": (Choice(2), True),
    "zero3": (Choice(3), True), "qwz": (Choice(3, qwz_bits=8), True), "hpz2": (Choice(3, hpz=2), True),
    "hpz4": (Choice(3, hpz=4), True), "qgz": (Choice(3, qgz_bits=4), True),
    "all": (Choice(3, 8, 2, 4), True), "bits": (Choice(3, 4, 2, 8), True),
    "offload3": (Choice(3, 8, 2, 4, offload=True), True), "offload2": (Choice(2, offload=True), True),
    "fp32_zero3_hpz": (Choice(3, hpz=2), False), "fp32_stage1": (Choice(1), False),
}


def measure(rank: int, world: int) -> dict:
    out = {}
    for name, (choice, bf16) in CASES.items():
        cfg = config_json(choice, GB // world, 1, PER_NODE, bucket=50, bf16=bf16)
        cfg["optimizer"] = dict(ADAMW)
        torch.manual_seed(0)
        engine, *_ = zeropp.initialize(model=TiedNet(vocab=13, dim=9, hidden=21), config=cfg)
        for step in range(2):
            idx, tgt = tied_batch(step, GB)
            engine.backward(engine(rank_slice(idx, rank, world), rank_slice(tgt, rank, world)))
            if step == 1:
                out[name] = {"measured": engine.model_state_bytes(),
                             "numels": [p.numel() for p in engine.module.parameters()]}
            engine.step()
        engine.close()
    return out


@functools.lru_cache(maxsize=1)
def results() -> list[dict]:
    return run_world(measure, WORLD, ranks_per_node=PER_NODE)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_memory_equals_engine_model_state_bytes(case: str) -> None:
    choice, bf16 = CASES[case]
    for rank_result in results():
        got = rank_result[case]
        predicted = model_states(got["numels"], choice, WORLD, bf16=bf16, separate_device=False)
        measured = got["measured"]
        assert {k: measured[k] for k in KINDS} == {k: predicted[k] for k in KINDS}, (case, measured)
        assert measured["total"] == predicted["total"] > 0
