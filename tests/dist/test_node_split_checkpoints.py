"""``activation_checkpointing.partition_activations: "node"`` (Note [node-split checkpoints] in
``activation/split.py``) on 2 nodes x 2 ranks, stage 3 + ZeRO++, a research-style model whose blocks run
through ``zeropp.checkpointing.checkpoint``.

Against plain checkpointing: the same losses and weights bit for bit (the split only moves the inputs); the
split's bytes travel inside the node only; and when the two ranks of a node train micro-batches of different
sizes (3 and 1 sequences), each keeps the node's mean of the checkpoint inputs (2 sequences' worth) instead
of its own. ``true`` keeps DeepSpeed's meaning (whole checkpoints, a warning); bad combinations are refused.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import zeropp
from support.world import run_world
from zeropp import checkpointing
from zeropp.deepspeed.missing import DeepSpeedAPIError
from zeropp.activation import checkpointing as core
from zeropp.activation.split import piece_sizes

STEPS, SEQ, DIM, LAYERS = 3, 16, 32, 3
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


class Blocks(nn.Module):
    def __init__(self, vocab: int = 97) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                                                  nn.Linear(2 * DIM, DIM)) for _ in range(LAYERS))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        for block in self.blocks:
            h = h + zeropp.checkpointing.checkpoint(block, h)
        logits = h @ self.emb.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _train(rank: int, split: bool, micro: int) -> dict:
    torch.manual_seed(0)
    model = Blocks()
    section = {"partition_activations": "node"} if split else {}
    engine, *_ = zeropp.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "topology": {"ranks_per_node": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "activation_checkpointing": section,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 20_000, **ZEROPP}})
    losses, other = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 97, (micro, SEQ), generator=g)
        before = engine.ledger.current_report()["other"]
        loss = engine(x, x)
        engine.backward(loss)
        after = engine.ledger.current_report()["other"]
        other.append({k: after[k] - before[k] for k in after})
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "state": engine.consolidated_state_dict(), "other": other,
            "saved_peak": engine.memory_report()["activations"]["saved_peak_device"]}


def worker(rank: int, world: int) -> dict:
    out = {"plain": _train(rank, False, 2), "split": _train(rank, True, 2)}
    uneven = 3 if rank % 2 == 0 else 1  # the node's ranks: 3 and 1 sequences
    out["uneven_plain"], out["uneven_split"] = _train(rank, False, uneven), _train(rank, True, uneven)
    checkpointing.configure()
    return out


@functools.lru_cache(maxsize=1)
def results() -> list[dict]:
    return run_world(worker, 4, ranks_per_node=2)


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return results()


def test_split_checkpoints_train_bit_identically(runs: list[dict]) -> None:
    for r in runs:
        for case in ("", "uneven_"):
            plain, split = r[case + "plain"], r[case + "split"]
            assert plain["losses"] == split["losses"], case
            assert all(torch.equal(plain["state"][k], split["state"][k]) for k in plain["state"]), case


def test_the_split_travels_inside_the_node(runs: list[dict]) -> None:
    one_input = 2 * SEQ * DIM * 4  # a block's fp32 input at 2 sequences
    for r in runs:
        for step in r["split"]["other"]:
            # per block input, received: the peer's half at the split, this rank's half back at the rerun,
            # and the peer's 8-byte size
            assert step == {"intra_node_bytes": LAYERS * (one_input + 8), "inter_node_bytes": 0}
        for step in r["plain"]["other"]:
            assert step == {"intra_node_bytes": 0, "inter_node_bytes": 0}


def test_uneven_ranks_each_keep_the_nodes_mean(runs: list[dict]) -> None:
    per_sequence = SEQ * DIM * 4 * LAYERS  # the 3 block inputs of one sequence, fp32
    for rank, r in enumerate(runs):
        mine = 3 if rank % 2 == 0 else 1
        # without the split each rank keeps its own inputs (and the rest of the saved activations)
        rest = r["uneven_plain"]["saved_peak"] - mine * per_sequence
        assert rest >= 0
        kept = sum(piece_sizes(n * SEQ * DIM, 2)[rank % 2] for n in (3, 1)) * 4 * LAYERS
        assert kept == 2 * per_sequence  # the node's mean: (3 + 1) / 2 sequences
        assert r["uneven_split"]["saved_peak"] == rest + kept, rank
    big = runs[0]
    assert big["uneven_split"]["saved_peak"] < big["uneven_plain"]["saved_peak"]


def test_true_keeps_deepspeeds_meaning_and_bad_combinations_are_refused() -> None:
    with pytest.warns(zeropp.config.ConfigWarning, match="model-parallel"):
        core._warned.discard("partition")
        checkpointing.configure(partition_activations=True)
    assert checkpointing.settings().partition_activations is True
    for bad in ({"checkpoint_in_cpu": True}, {"contiguous_checkpointing": True, "num_checkpoints": 2}):
        with pytest.raises(DeepSpeedAPIError, match="partition_activations"):
            checkpointing.configure(partition_activations="node", **bad)
    with pytest.raises(DeepSpeedAPIError, match="true, false or"):
        checkpointing.configure(partition_activations="rows")
    with pytest.raises(zeropp.config.ConfigError, match="partition_activations"):
        zeropp.config.load_config({"train_batch_size": 1, "activation_checkpointing": {"partition_activations": 2}})
    checkpointing.configure()
