"""A transformers recipe whose ranks run different layers: BART with LayerDrop (``encoder_layerdrop``,
``decoder_layerdrop``), which draws ``torch.rand`` per layer on each rank, so each rank skips other layers.

At stage 2 each gradient reduces by its place (Note [positional buckets]): the run trains as one process that
runs each rank's micro-batch with that rank's draws and steps on the mean gradient (a layer no rank ran has a
zero gradient, not none: the engine steps every trainable parameter, as DeepSpeed does). With buckets filled in
arrival order, the first step whose ranks dropped different layers was refused (same-sized layers) and, where
the skipped parameters changed the buckets' sizes, gloo aborted a rank.
"""
from __future__ import annotations

import pytest
import torch

import zeropp
from support.world import run_world

STEPS = 5


def model() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=64, d_model=16, encoder_layers=3, decoder_layers=3, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.5,
                     decoder_layerdrop=0.5, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2)
    return BartForConditionalGeneration(cfg)


def batch(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(3, 64, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids.flip(1)}


def draws(step: int, rank: int) -> None:
    """The rank's LayerDrop draws for this step (a seed of its own, as each rank's generator would be)."""
    torch.manual_seed(10_000 + 100 * step + rank)


def train(rank: int, world: int) -> list[float]:
    m = model()
    m.train()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 4000}}  # several buckets a backward
    engine, *_ = zeropp.initialize(model=m, config=cfg)
    losses = []
    for step in range(STEPS):
        draws(step, rank)
        loss = engine(**batch(step, rank)).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.close()
    return losses


def reference(world: int) -> tuple[list[list[float]], list[list[list[int]]]]:
    """Each rank's losses, and the layers each rank ran in each step."""
    m = model()
    m.train()
    layers = list(m.model.encoder.layers) + list(m.model.decoder.layers)
    ran: list[int] = []
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: ran.append(i))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    out: list[list[float]] = [[] for _ in range(world)]
    used: list[list[list[int]]] = []
    for step in range(STEPS):
        opt.zero_grad()
        used.append([])
        for rank in range(world):
            draws(step, rank)
            ran.clear()
            loss = m(**batch(step, rank)).loss
            (loss / world).backward()
            out[rank].append(float(loss.detach()))
            used[-1].append(list(ran))
        for p in m.parameters():  # a layer no rank ran is stepped with zeros, as the engine steps it (and DeepSpeed)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return out, used


def test_bart_with_layerdrop_trains_at_stage_2_as_one_process() -> None:
    ref, used = reference(2)
    assert sum(a != b for a, b in used) >= 3, used  # the ranks did run different layers
    out = run_world(train, 2, timeout=240)
    for rank in range(2):
        assert out[rank] == pytest.approx(ref[rank], rel=1e-5, abs=1e-6), (rank, out[rank], ref[rank])
