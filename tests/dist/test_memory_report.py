"""``engine.memory_report()`` on 2 nodes x 2 ranks (issue 18, point 3): every temporary buffer stays within its
bound, and the bounds depend on the configured bucket size and the largest unit, not on the model's size.

The same architecture with 8 and with 24 blocks (the larger one more than 10x the configured bounds in
elements) trains under plain ZeRO-3 and under ZeRO++ (qwZ + hpZ + qgZ): each reported buffer stays within
its bound, the total stays within the total bound, and the larger model's buffers are byte for byte the
smaller one's. Prefetching follows DeepSpeed's keys: ``stage3_prefetch_bucket_size: 0`` or a
``stage3_max_live_parameters`` smaller than what is gathered leaves one gather in flight instead of two (and
one two-hop gather's first hop instead of three).
Saved activations are measured (Note [activation meter]): with ``cpu_checkpointing`` through a link that
plays a separate device, what the compute device keeps is at most 1/L of the run without checkpointing.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeropp
from zeropp import checkpointing
from zeropp.offload.link import ThreadedLink
from support.world import run_world

BUCKET = 4096  # reduce_bucket_size, elements
DIM, HIDDEN, VOCAB, SEQ, MICRO = 32, 96, 16, 16, 2
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


class Stack(nn.Module):
    """An embedding and ``layers`` MLP blocks (one gather unit each), optionally checkpointed."""

    def __init__(self, layers: int, checkpointed: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
                                    for _ in range(layers))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + (checkpointing.checkpoint(block, h) if self.checkpointed else block(h))
        return (h @ self.emb.weight.t()).float().logsumexp(-1).mean()


def _config(zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": True}, "topology": {"ranks_per_node": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": BUCKET, **zero}}


def _train(rank: int, layers: int, zero: dict, checkpointed: bool = False, steps: int = 2) -> dict:
    torch.manual_seed(0)
    model = Stack(layers, checkpointed)
    elements = sum(p.numel() for p in model.parameters())
    engine, *_ = zeropp.initialize(model=model, config=_config(zero))
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = engine(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
        engine.backward(loss)
        engine.step()
    report = engine.memory_report()
    report["model_elements"] = elements
    report["largest_unit"] = max(sum(s.spec.padded for s in u.slots) for u in engine.units)
    return report


def worker(rank: int, world: int) -> dict:
    out = {}
    for name, zero in (("zero3", {}), ("zeropp", ZEROPP)):
        for layers in (8, 24):
            out[(name, layers)] = _train(rank, layers, zero)
    big = max(out[("zero3", 24)]["largest_unit"], 1)
    out["no_prefetch"] = _train(rank, 8, {"stage3_prefetch_bucket_size": 0})
    out["max_live"] = _train(rank, 8, {"stage3_max_live_parameters": big})  # no room for a second block
    checkpointing.configure()
    out["saved_plain"] = _train(rank, 8, {})
    out["saved_checkpointed"] = _train(rank, 8, {}, checkpointed=True)
    checkpointing.set_link(ThreadedLink(delay=0.0))  # a separate device: checkpoint inputs really go down
    checkpointing.configure(checkpoint_in_cpu=True)
    out["saved_cpu"] = _train(rank, 8, {}, checkpointed=True)
    checkpointing.set_link(None)
    checkpointing.configure()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_world(worker, 4, ranks_per_node=2, timeout=600)


@pytest.mark.parametrize("name", ["zero3", "zeropp"])
def test_every_buffer_stays_within_its_bound_on_a_model_ten_times_the_bounds(reports: list[dict],
                                                                              name: str) -> None:
    for rank, rep in enumerate(reports):
        big, small = rep[(name, 24)], rep[(name, 8)]
        assert big["model_elements"] >= 10 * (BUCKET + big["largest_unit"]), "the model is not 10x the bounds"
        for line, entry in big["buffers"].items():
            assert entry["bytes"] <= entry["bound"], (rank, line, entry)
        assert 0 < big["buffer_bytes"] <= big["buffer_bound"]
        # buffers follow the bucket size and the largest unit, not the number of units
        assert {k: v["bytes"] for k, v in big["buffers"].items()} == \
            {k: v["bytes"] for k, v in small["buffers"].items()}, rank
        assert big["buffer_bound"] == small["buffer_bound"]
        assert big["buffer_bytes"] < big["model_states"]["total"]


def test_the_zeropp_strategies_report_their_pools(reports: list[dict]) -> None:
    parts = {line: set(entry.get("parts", {})) for line, entry in reports[0][("zeropp", 24)]["buffers"].items()}
    assert any(k.startswith("qwz") for k in parts["forward_gather"]), parts
    assert any(k.startswith("hpz") for k in parts["backward_gather"]), parts
    assert any(k.startswith("qgz") for k in parts["reduce"]), parts


def test_prefetch_follows_deepspeeds_bounds(reports: list[dict]) -> None:
    for rep in reports:
        parts = rep[("zero3", 24)]["buffers"]["forward_gather"]["parts"]
        unit_bytes = rep[("zero3", 24)]["largest_unit"] * 2  # bf16
        assert parts["gather_out"] == 2 * unit_bytes  # the gather being finished and one prefetch
        # Note [two-hop gather]: first-hop rows (1/D of a unit) of that gather, the prefetch and the one after
        assert parts["gather_hop1"] == 3 * unit_bytes // 2
        for case in ("no_prefetch", "max_live"):  # one gather at a time
            parts = rep[case]["buffers"]["forward_gather"]["parts"]
            assert (parts["gather_out"], parts["gather_hop1"]) == (unit_bytes, unit_bytes // 2), case
        # the weights gathered at once: the embedding (read again by the head) and a block or two, not the model
        for key in (("zero3", 24), ("zeropp", 24)):
            assert 0 < rep[key]["gathered_weights_peak"] <= 3 * unit_bytes, key


def test_saved_activations_are_measured_and_cpu_checkpointing_moves_them_off_the_device(
        reports: list[dict]) -> None:
    layers = 8
    for rep in reports:
        plain, kept, host = (rep[k]["activations"] for k in ("saved_plain", "saved_checkpointed", "saved_cpu"))
        for a in (plain, kept, host):
            assert a["saved_now_device"] == 0 and a["saved_now_host"] == 0  # backward dropped everything
        assert kept["saved_peak_device"] < plain["saved_peak_device"]
        assert host["saved_peak_host"] > 0 and kept["saved_peak_host"] == 0
        one_input = MICRO * SEQ * DIM * 2  # a block's bf16 input
        assert host["saved_peak_host"] == layers * one_input
        assert host["saved_peak_device"] == kept["saved_peak_device"] - layers * one_input
        assert host["saved_peak_device"] <= plain["saved_peak_device"] / layers
