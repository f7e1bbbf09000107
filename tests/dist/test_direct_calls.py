"""Stage 3 with parts of a model called without the engine (Note [direct calls] in ``zero/param_use.py``):
``transformers``' ``generate()`` on T5 runs the encoder on its own, and the encoder's token embedding is
shared with the decoder and the output projection, so its weight belongs to the whole model's unit, which
no forward of the whole model gathers then. Evaluation code also calls one layer, or one sub-layer of a
block-granularity unit, directly. On 2 nodes x 2 ranks, after a training step: the same tokens and hidden
states as one process, nothing left gathered, no span learned from the direct calls, and training on
through the engine still matches. The first forward of all runs under ``torch.inference_mode()`` (Note
[inference mode] in ``zero/engine.py``): the buffers it makes must serve the training steps after it."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import zeropp
from support.hf_models import hf_batch, hf_loss, rank_mean, t5
from support.world import run_world

GB, LR, WORLD = 8, 3e-3, 4
PROMPT = 4, 6  # sequences x tokens
NEW = 4  # tokens generated, exactly: greedy, min = max
VARIANTS = {
    "zero3": {},
    "zero3_module": {"gather_granularity": "module"},
    "hpz": {"zero_hpz_partition_size": 2},
    "zeropp": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
}


def _train_step(model, step: int, rank: int | None = None) -> torch.Tensor:  # noqa: ANN001
    """One step's loss: through the engine on ``rank``'s slice, or (``rank`` None) the mean of the slices."""
    return rank_mean(functools.partial(hf_loss, model), *hf_batch(step, GB), WORLD, None if rank is None else [rank])


def _probe(model) -> dict:  # noqa: ANN001
    """The direct calls, under no_grad as evaluation runs them."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 97, PROMPT, generator=g)
    model.eval()
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=ids).last_hidden_state
        tokens = model.generate(input_ids=ids, min_new_tokens=NEW, max_new_tokens=NEW, do_sample=False)
        ff = model.encoder.block[0].layer[1](encoded)  # a sub-layer of a block unit
        logits = model.lm_head(encoded)  # the tied output projection alone: the whole model's unit
    model.train()
    return {"encoded": encoded, "tokens": tokens, "ff": ff, "logits": logits}


def case(rank: int, world: int, zero: dict) -> dict:
    torch.manual_seed(0)
    model = t5()
    cfg = {"train_batch_size": GB, "topology": {"ranks_per_node": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 20_000, **zero}}
    engine, *_ = zeropp.initialize(model=model, config=cfg)
    losses = []

    def step(k: int) -> None:
        loss = _train_step(engine, k, rank)
        engine.backward(loss)
        engine.step()
        value = loss.detach().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)

    with torch.inference_mode():  # the first forward ever: the buffers it makes serve the training steps
        evaluated = _train_step(engine, 0, rank).item()
    step(0)
    spans = sorted(u.module_name for u in engine.spans.learned)
    probe = _probe(model)
    left = [u.module_name for u in engine.units if u.state.value != "sharded"]
    step(1)
    return {"probe": probe, "losses": losses, "left_gathered": left, "evaluated": evaluated,
            "spans_before": spans, "spans_after": sorted(u.module_name for u in engine.spans.learned)}


def scenarios(rank: int, world: int) -> dict:
    return {"rank": rank, **{name: case(rank, world, zero) for name, zero in VARIANTS.items()}}


@functools.lru_cache(maxsize=None)
def results() -> list:
    return run_world(scenarios, WORLD, ranks_per_node=2)


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    torch.manual_seed(0)
    model = t5()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    with torch.no_grad():
        evaluated = [_train_step(model, 0, r).item() for r in range(WORLD)]
    losses = []
    for k in range(2):
        loss = _train_step(model, k)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if k == 0:
            probe = _probe(model)
    return {"probe": probe, "losses": losses, "evaluated": evaluated}


@pytest.mark.parametrize("variant", ["zero3", "zero3_module", "hpz"])
def test_direct_calls_give_what_one_process_gives(variant: str) -> None:
    want = reference()
    for res in results():
        got = res[variant]
        assert torch.equal(got["probe"]["tokens"], want["probe"]["tokens"]), variant
        for key in ("encoded", "ff", "logits"):
            torch.testing.assert_close(got["probe"][key], want["probe"][key], rtol=1e-5, atol=1e-5)
        for g, w in zip(got["losses"], want["losses"]):
            assert abs(g - w) / w <= 1e-5, (variant, got["losses"], want["losses"])
        # the untrained model's loss on this rank's slice, under inference mode
        assert abs(got["evaluated"] - want["evaluated"][res["rank"]]) <= 1e-5 * want["evaluated"][res["rank"]]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_direct_calls_leave_nothing_gathered_and_teach_no_span(variant: str) -> None:
    first = results()[0][variant]
    for res in results():
        got = res[variant]
        assert got["left_gathered"] == []
        assert got["spans_after"] == got["spans_before"]
        assert torch.equal(got["probe"]["tokens"], first["probe"]["tokens"])  # every rank generated the same
        assert got["probe"]["tokens"].shape == (PROMPT[0], NEW + 1)  # the decoder start token, then NEW
