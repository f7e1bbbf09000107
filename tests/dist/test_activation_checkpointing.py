"""Activation checkpointing under stage 3 and ZeRO++ on 2 nodes x 2 ranks (issue 18, point 1).

GPT-2 and Llama from ``transformers`` with ``gradient_checkpointing_enable()`` (torch's non-reentrant and
reentrant checkpoint), and a research-style model calling ``zeropp.checkpointing.checkpoint`` (DeepSpeed's
name), train exactly as the same runs without checkpointing: in fp32 with hpZ the rerun reads the very
weights the first forward read (hpZ's secondary shards hold the forward's gathered values), so losses and
final weights are bit-identical; with bf16 and all of ZeRO++ within rounding. The rerun's gathers stay
inside the node with hpZ: the ledger shows no inter-node byte in the backward gathers.

``cpu_checkpointing`` (the config's ``activation_checkpointing`` section, which ``initialize`` hands to
``zeropp.checkpointing.configure``) keeps the checkpoint inputs on the host; on these CPU ranks a
``ThreadedLink`` plays the separate device, so the inputs really go down and come back (late, NaN until
their copy ran). It trains bit for bit as the run without checkpointing, for the research model and for
GPT-2 routed through ``zeropp.checkpointing.gradient_checkpointing_enable``, and its ledger equals plain
checkpointing's byte for byte: the host copies add no collective.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeropp
from zeropp import checkpointing
from zeropp.offload.link import ThreadedLink
from support.hf_models import FAMILIES, hf_batch, hf_loss
from support.world import run_world

STEPS, GB = 3, 8
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
BF16_TOL = 4 * 2**-8  # as tests/dist/test_transformers.py


class Checkpointed(nn.Module):
    """Research code's pattern: each block run through deepspeed.checkpointing.checkpoint."""

    def __init__(self, vocab: int = 97, dim: int = 32, layers: int = 3, use_api: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                                  nn.Dropout(0.1), nn.Linear(2 * dim, dim)) for _ in range(layers))
        self.use_api = use_api

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        for block in self.blocks:
            h = h + (zeropp.checkpointing.checkpoint(block, h) if self.use_api else block(h))
        logits = h @ self.emb.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _config(bf16: bool, mode: str) -> dict:
    cfg = {"train_batch_size": GB, "bf16": {"enabled": bf16}, "topology": {"ranks_per_node": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 20_000, **ZEROPP}}
    if mode == "cpu":
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    return cfg


def _model(family: str, mode: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "research":
        return Checkpointed(use_api=mode != "off")
    model = FAMILIES[family]()
    if mode == "cpu":
        checkpointing.gradient_checkpointing_enable(model)  # Hugging Face's layers through zeropp's checkpoint
    elif mode != "off":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    return model


def train(rank: int, world: int, family: str, mode: str, bf16: bool) -> dict:
    model = _model(family, mode)
    checkpointing.configure()  # the defaults: an earlier case's settings must not carry over
    link = ThreadedLink(delay=0.0)
    checkpointing.set_link(link)
    engine, *_ = zeropp.initialize(model=model, config=_config(bf16, mode))
    assert checkpointing.settings().cpu_checkpointing == (mode == "cpu")
    m, losses, backward_inter, ledgers = GB // world, [], [], []
    for step in range(STEPS):
        torch.manual_seed(100 + step)  # dropout (the research model): the same masks with and without
        x, y = hf_batch(step, GB)
        xs, ys = x[rank * m:(rank + 1) * m], y[rank * m:(rank + 1) * m]
        loss = engine(xs, ys) if family == "research" else hf_loss(engine, xs, ys)
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
        backward_inter.append(engine.comm_report()["backward_gather"]["inter_node_bytes"])
        ledgers.append(engine.comm_report())
    state = engine.consolidated_state_dict()
    checkpointing.set_link(None)
    return {"losses": losses, "backward_inter": backward_inter, "ledgers": ledgers, "copies": link.copies,
            "state": {k: v.clone() for k, v in state.items()} if rank == 0 else None}


CASES = [("gpt2", "non_reentrant"), ("gpt2", "reentrant"), ("llama", "non_reentrant"), ("research", "api"),
         ("research", "cpu"), ("gpt2", "cpu")]


def all_cases(rank: int, world: int) -> dict:
    out = {}
    for family, mode in CASES + [(f, "off") for f in ("gpt2", "llama", "research")]:
        for bf16 in (False, True):
            out[(family, mode, bf16)] = train(rank, world, family, mode, bf16)
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_world(all_cases, 4, ranks_per_node=2, timeout=900)[0]  # rank 0's results


@pytest.mark.parametrize("family, mode", CASES)
def test_fp32_with_hpz_is_bit_identical_to_no_checkpointing(runs: dict, family: str, mode: str) -> None:
    on, off = runs[(family, mode, False)], runs[(family, "off", False)]
    assert on["losses"] == off["losses"]
    for key, value in off["state"].items():
        assert torch.equal(on["state"][key], value), key


@pytest.mark.parametrize("family, mode", CASES)
def test_bf16_zeropp_within_rounding(runs: dict, family: str, mode: str) -> None:
    on, off = runs[(family, mode, True)], runs[(family, "off", True)]
    for a, b in zip(on["losses"], off["losses"]):
        assert abs(a - b) <= BF16_TOL * abs(b), (on["losses"], off["losses"])


@pytest.mark.parametrize("family, mode", CASES)
def test_rerun_gathers_stay_inside_the_node(runs: dict, family: str, mode: str) -> None:
    for bf16 in (False, True):
        assert runs[(family, mode, bf16)]["backward_inter"] == [0] * STEPS


@pytest.mark.parametrize("family, plain", [("research", "api"), ("gpt2", "non_reentrant")])
def test_cpu_checkpointing_moves_the_inputs_and_adds_no_collective(runs: dict, family: str, plain: str) -> None:
    for bf16 in (False, True):
        host, device = runs[(family, "cpu", bf16)], runs[(family, plain, bf16)]
        blocks = 3 if family == "research" else 2
        assert host["copies"] == STEPS * 2 * blocks  # every block's input went down and came back
        assert device["copies"] == 0
        assert host["ledgers"] == device["ledgers"]  # byte for byte, every phase and link, every step
