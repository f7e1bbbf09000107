"""torch.compile with stage 3 and ZeRO++ (Note [compiled regions] in ``zero/compiled.py``), on 2 nodes x 2 ranks
with qwZ, hpZ and qgZ on: every way a user compiles (the model whole before ``initialize``, ``block.compile()``
before it, ``engine.compile`` per block, the config's ``compile`` section) trains with the eager losses, and
from the third step on Dynamo compiles nothing more (torch's own counters); a new batch length compiles once
more. The collective order check still refuses ranks that ran different modules. ``aot_eager`` traces forward
and backward through AOTAutograd, so graph breaks and recompiles are real; its kernels are eager torch's, so the
losses are equal. ``inductor``, which generates and compiles C++ here, runs the demo GPT per block on 2 ranks in
fp32."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import zeropp
from support.hf_models import VOCAB, gpt2, hf_batch, llama
from support.world import run_world
from zeropp.tools.demo.data import corpus_tokens, get_batch
from zeropp.tools.demo.model import GPT, GPTConfig
from zeropp.partition.access import ParameterAccessError
from zeropp.zero.order_check import CollectiveOrderError

STEPS = 3
PLUS = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


def config(stage: int = 3, **extra: object) -> dict:
    zero = {"stage": stage, **(PLUS if stage == 3 else {})}
    zero.update(extra.pop("zero", {}))  # type: ignore[arg-type]
    return {"train_micro_batch_size_per_gpu": 2, "topology": {"ranks_per_node": 2}, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero, **extra}


class ReadsChild(nn.Module):
    """A parent whose forward reads its child's weight outside the child's forward (an output projection
    tied by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        logits = h @ self.emb.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def gpt2_checkpointed() -> nn.Module:
    model = gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def demo() -> nn.Module:
    return GPT(GPTConfig(block_size=32, n_layer=2, n_embd=32))


def demo_batch(step: int, rank: int, world: int) -> tuple:
    return get_batch(corpus_tokens(), step, 2 * world, 32, seed=1, rank=rank, world_size=world)


def hf_rank_batch(step: int, rank: int, world: int) -> tuple:
    x, y = hf_batch(step, 2 * world)
    return x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]


def child_batch(step: int, rank: int, world: int) -> tuple:
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randint(0, 64, (2, 8), generator=g)
    return x, torch.roll(x, 1, 1)


def train(rank: int, world: int, make: object, batch: object, cfg: dict, how: str) -> dict:
    """``how``: "eager", "whole" (torch.compile before initialize), "blocks" (``block.compile()`` on each
    block before initialize), "engine" (engine.compile after it) or "config" (the config's compile section)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = make()  # type: ignore[operator]
    if how == "whole":
        model = torch.compile(model, backend="aot_eager")
    if how == "blocks":
        for blocks in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
            for block in blocks:
                block.compile(backend="aot_eager")
    if how.startswith("config"):
        backend = how.partition("_")[2] or "aot_eager"
        cfg = {**cfg, "compile": {"enabled": True, "backend": backend}}
    engine, *_ = zeropp.initialize(model=model, config=cfg)
    if how == "engine":
        engine.compile(backend="aot_eager")
    losses, graphs = [], []
    for step in range(STEPS):
        x, y = batch(step, rank, world)  # type: ignore[operator]
        loss = engine(x, y) if make in (demo, ReadsChild) else engine(input_ids=x, labels=y).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    names = list(engine.consolidated_state_dict())
    out = {"losses": losses, "graphs": graphs, "compiled": engine.is_compiled, "names": names}
    if cfg["zero_optimization"]["stage"] == 3:  # the reads-between-passes net still holds under compile
        try:
            next(engine.module.parameters()).sum()
        except ParameterAccessError:
            out["refused"] = True
    engine.close()
    return out


CASES = {
    "demo_whole": (demo, demo_batch, config(), "whole"),
    "gpt2_engine": (gpt2, hf_rank_batch, config(), "engine"),
    "llama_config": (llama, hf_rank_batch, config(), "config"),
    "gpt2_checkpointed_blocks": (gpt2_checkpointed, hf_rank_batch, config(), "blocks"),
    "reads_child": (ReadsChild, child_batch, config(zero={"gather_granularity": "module"}), "whole"),
    "offload_engine": (demo, demo_batch, config(zero={"offload_optimizer": {"device": "cpu"}}), "engine"),
    "stage2_whole": (demo, demo_batch, config(stage=2), "whole"),
}


class TwoPaths(nn.Module):
    """Two same-sized blocks that one rank may run in the other order (``swap``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, swap: bool) -> torch.Tensor:
        h = self.a(self.b(x)) if swap else self.b(self.a(x))
        return self.head(h).pow(2).mean()


def swapped_after_warm_up(rank: int, world: int) -> dict:
    """Rank 1 runs the blocks in the other order at step 3, once the model runs compiled: the collective
    order check must still refuse the step on every rank (2 ranks on one node, stage 3)."""
    torch.manual_seed(0)
    cfg = config(zero={"zero_quantized_weights": False, "zero_hpz_partition_size": 1,
                       "zero_quantized_gradients": False}) | {"topology": {"ranks_per_node": 1}}
    engine, *_ = zeropp.initialize(model=torch.compile(TwoPaths(), backend="aot_eager"), config=cfg)
    error = None
    for step in range(STEPS):
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x, swap=rank == 1 and step == 2))
        try:
            engine.step()
        except CollectiveOrderError as e:
            error = (step, str(e))
            break
    engine.close()
    return {"error": error}


def new_batch_shapes(rank: int, world: int) -> list[int]:
    """Per-block compiled demo GPT at sequence length 32 for 3 steps, then 16, 24 and 8: the graphs counted
    after each step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    engine, *_ = zeropp.initialize(model=demo(), config=config())
    engine.compile(backend="aot_eager")
    graphs = []
    for step, length in enumerate((32, 32, 32, 16, 24, 8)):
        x, y = demo_batch(step, rank, world)
        loss = engine(x[:, :length], y[:, :length])
        engine.backward(loss)
        engine.step()
        graphs.append(counters["stats"]["unique_graphs"])
    engine.close()
    return graphs


def scenarios(rank: int, world: int) -> dict:
    out: dict = {}
    for name, (make, batch, cfg, how) in CASES.items():
        out[name] = {"eager": train(rank, world, make, batch, cfg, "eager"),
                     "compiled": train(rank, world, make, batch, cfg, how)}
    out["shapes"] = new_batch_shapes(rank, world)
    return out


@functools.lru_cache(maxsize=None)
def results() -> list:
    return run_world(scenarios, 4)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_training_matches_eager_without_recompiles(case):
    for res in results():
        eager, compiled = res[case]["eager"], res[case]["compiled"]
        assert compiled["compiled"] and not eager["compiled"]
        assert eager["graphs"] == [0] * STEPS
        assert compiled["graphs"][0] == 0  # the first step runs eagerly and learns the external reads
        assert compiled["graphs"][1] > 0
        assert compiled["graphs"][2:] == [compiled["graphs"][1]] * (STEPS - 2)  # nothing compiled from step 3 on
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
        assert compiled["names"] == eager["names"]  # no "_orig_mod." in what the engine saves
        assert bool(compiled.get("refused")) == bool(eager.get("refused")) == (case != "stage2_whole")


def test_collective_order_check_still_refuses_under_compile():
    for res in run_world(swapped_after_warm_up, 2):
        assert res["error"] is not None  # every rank, in the step where rank 1 swapped
        assert res["error"][0] == 2 and "same modules" in res["error"][1]


def test_a_new_batch_shape_recompiles_once():
    for res in results():
        graphs = res["shapes"]
        assert graphs[0] == 0 < graphs[1] == graphs[2]
        assert graphs[3] > graphs[2]  # the first new length compiles again, with the length dynamic
        assert graphs[4] == graphs[5] == graphs[3]  # later lengths reuse it


def inductor(rank: int, world: int) -> dict:
    fp32 = {"bf16": {"enabled": False}}
    return {how: train(rank, world, demo, demo_batch, {**config(zero={"zero_quantized_weights": False,
                                                                       "zero_hpz_partition_size": 1,
                                                                       "zero_quantized_gradients": False}), **fp32,
                                                       "topology": {"ranks_per_node": 1}},
                       how if how == "eager" else "config_inductor")
            for how in ("eager", "inductor")}


def test_inductor_per_block_matches_eager_in_fp32_without_recompiles():
    for res in run_world(inductor, 2):
        eager, compiled = res["eager"], res["inductor"]
        assert compiled["compiled"] and compiled["graphs"][0] == 0 < compiled["graphs"][1]
        assert compiled["graphs"][2:] == [compiled["graphs"][1]] * (STEPS - 2)
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)


def llama4() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        use_cache=False))


def graphs_per_block(rank: int, world: int) -> dict:
    """Dynamo's graphs for a 4-layer Llama compiled per block: plain torch (no zeropp, one forward and
    backward) against zeropp's ``engine.compile`` after 3 steps (Note [exit hooks in compiled regions])."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    out = {}
    for system in ("torch", "zeropp"):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = llama4()
        x, y = hf_rank_batch(0, rank, world)
        if system == "torch":
            for layer in model.model.layers:
                layer.compile(backend="aot_eager")
            model(input_ids=x, labels=y).loss.backward()
        else:
            engine, *_ = zeropp.initialize(model=model, config=config())
            engine.compile(backend="aot_eager")
            for step in range(STEPS):
                x, y = hf_rank_batch(step, rank, world)
                engine.backward(engine(input_ids=x, labels=y).loss)
                engine.step()
            engine.close()
        out[system] = counters["stats"]["unique_graphs"]
    return out


def test_blocks_compiled_in_place_share_their_graphs_as_in_plain_torch():
    # each block's hooks called whatever the forward does used to be guarded by their ids: one graph per block
    for res in run_world(graphs_per_block, 2):
        assert res["torch"] >= 1
        assert res["zeropp"] == res["torch"]
