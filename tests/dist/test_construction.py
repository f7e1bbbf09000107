"""Big models built the way users build them (docs/architecture.md, Construction): ``zero.Init`` with
DeepSpeed's semantics, meta-device construction that never starts from uninitialized memory, one model on
every rank at ``initialize`` (rank 0's), and pretrained weights read straight into the ranks' chunks.

One world of 2 nodes x 2 ranks runs every scenario (and one of 2 ranks the ``zero.Init`` parity again);
memory is measured first in each, as the rise of the kernel's RSS high-water mark over the rank's RSS before
the measured stretch (support/rss.py)."""
from __future__ import annotations

import functools
import gc
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeropp
from support.construction_models import (Broken, EqualBlocks, HandNet, WithRotary, WithSkippedParam, hand_batch,
                                         readme_init)
from support.hf_models import bert, gpt2, hf_batch, hf_loss, llama, t5
from support.rss import MALLOC_ENV, current_rss, peak_rss, reset_peak_rss
from support.world import run_world

MiB = 2**20
NODES = {"topology": {"ranks_per_node": 2}}
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
FAMILIES = {"llama": llama, "gpt2": gpt2, "t5": t5, "bert": bert}


def config(bf16: bool = False, stage: int = 3, **zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": bf16}, **NODES,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, **zero}}


def state_of(engine) -> dict:
    return {k: v.clone() for k, v in engine.consolidated_state_dict().items()}


def train_hf(engine, rank: int, steps: int, fixed: bool = False) -> list[float]:
    """Summed over the ranks; ``fixed``: the same batch every step (so the loss must fall)."""
    losses = []
    for step in range(steps):
        x, y = hf_batch(0 if fixed else step, 8)
        loss = hf_loss(engine, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item())
    return losses


def train_hand(engine, rank: int, steps: int = 3) -> list[float]:
    losses = []
    for step in range(steps):
        loss = engine(hand_batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def bare() -> None:
    """What a bare training process has loaded before the measured stretch: torch's optimizers import Dynamo
    (about 140 MB of RSS) at their first use."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    gc.collect()


# ---- scenarios --------------------------------------------------------------------------------------------------
def init_memory(rank: int) -> dict:
    """zero.Init of 8 equal blocks: peak over the RSS before construction."""
    bare()
    reset = reset_peak_rss()
    before = current_rss()
    with zeropp.zero.Init():
        model = EqualBlocks()
    peak = peak_rss(reset) - before
    from zeropp.zero.construction import PARAMS
    held = sum(PARAMS.get(p).shard.numel() * 4 for p in model.parameters())
    out = {"peak": peak, "held": held, "block": model.block_bytes(), "shape": tuple(model.blocks[0][0].weight.shape)}
    del model
    gc.collect()
    return out


def broadcast_memory(rank: int) -> dict:
    """Rank 0 holds real weights, the others built on the meta device: initialize scatters rank 0's."""
    torch.manual_seed(7)
    if rank == 0:
        model = EqualBlocks()
        expected = {k: float(v.double().sum()) for k, v in model.state_dict().items()}
    else:
        with torch.device("meta"):
            model = EqualBlocks()
        expected = None
    bare()
    reset = reset_peak_rss()
    before = current_rss()
    engine, *_ = zeropp.initialize(model=model, config=config())
    peak = peak_rss(reset) - before
    got = {k: float(v.double().sum()) for k, v in engine.consolidated_state_dict().items()}
    out = {"peak": peak, "held": engine.model_state_bytes()["total"], "block": EqualBlocks().block_bytes(),
           "got": got, "expected": expected}
    engine.close()
    return out


def meta_families(rank: int) -> dict:
    """transformers families built on meta with the README's recipe, on 2x2 with ZeRO++ in bf16."""
    out = {}
    for name, family in FAMILIES.items():
        torch.manual_seed(0)
        normal, *_ = zeropp.initialize(model=family(), config=config(bf16=True, **ZEROPP))
        want = {k: b.clone() for k, b in normal.module.named_buffers()}
        normal.close()
        with torch.device("meta"):
            model = family()
        engine, *_ = zeropp.initialize(model=model, config=config(bf16=True, **ZEROPP), param_init_fn=readme_init)
        buffers = {k: (torch.equal(b, want[k]), b.dtype) for k, b in engine.module.named_buffers()}
        out[name] = {"buffers": buffers, "want": sorted(want), "state": state_of(engine),
                     "losses": train_hf(engine, rank, 5, fixed=True)}
        engine.close()
    return out


def refusals(rank: int) -> dict:
    """A buffer nothing can recompute and a parameter the recipe skips: refused at initialize, by name."""
    out = {}
    for key, make in (("lost_buffer", lambda: WithRotary(kept=False)), ("skipped_param", WithSkippedParam)):
        with torch.device("meta"):
            model = make()
        try:
            zeropp.initialize(model=model, config=config(), param_init_fn=readme_init)
            out[key] = None
        except zeropp.zero.UninitializedError as err:
            out[key] = str(err)
    with torch.device("meta"):
        model = WithRotary(kept=True)
    engine, *_ = zeropp.initialize(model=model, config=config(), param_init_fn=readme_init)
    out["kept_buffer"] = torch.equal(engine.module.rot.inv_freq, WithRotary(kept=True).rot.inv_freq)
    engine.close()
    # what a Trainer does with the model it is given (.to(args.device)): partitioned parameters stay where they
    # were built; to another device they are refused by name
    from zeropp.zero.construction import move_model
    with zeropp.zero.Init():
        model = HandNet()
    out["moved_here"] = move_model(model, "cpu") is model and model.blocks[0].mask.device.type == "cpu"
    try:
        move_model(model, "meta")
        out["moved_away"] = None
    except ValueError as err:
        out["moved_away"] = str(err)
    return out


def rank0_loading(rank: int) -> dict:
    """Pretrained weights on rank 0 only (other ranks random, or zero) against every rank loaded."""
    torch.manual_seed(123)
    pretrained = llama().state_dict()
    out = {}
    for case in ("all", "rank0"):
        torch.manual_seed(1000 + rank)  # every rank its own random init
        model = llama()
        if case == "all" or rank == 0:
            model.load_state_dict(pretrained)
        elif rank == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
        engine, *_ = zeropp.initialize(model=model, config=config(**ZEROPP))
        out[case] = train_hf(engine, rank, 3)
        engine.close()
    return out


def disagreement(rank: int) -> dict:
    """Ranks seeded differently: the opt-out warns, naming a unit; the default takes rank 0's weights."""
    out = {}
    for broadcast in (False, True):
        torch.manual_seed(rank)
        cfg = {**config(), "broadcast_rank0_weights": broadcast}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, *_ = zeropp.initialize(model=HandNet(), config=cfg)
        out[broadcast] = [str(w.message) for w in caught if w.category.__name__ == "RankDisagreementWarning"]
        if broadcast:
            torch.manual_seed(0)
            want = HandNet().state_dict()
            got = engine.consolidated_state_dict()
            out["equal_rank0"] = all(torch.equal(got[k], want[k]) for k in want)
        engine.close()
    return out


def init_parity(rank: int) -> dict:
    """HandNet under zero.Init (ranks seeded differently) against HandNet built normally (same seed)."""
    torch.manual_seed(0)
    engine, *_ = zeropp.initialize(model=HandNet(), config=config())
    normal = {"state": state_of(engine), "losses": train_hand(engine, rank)}
    engine.close()
    torch.manual_seed(0 if rank == 0 else 50 + rank)
    with zeropp.zero.Init():
        model = HandNet()
    shape = tuple(model.blocks[0].a.weight.shape)
    try:
        model.blocks[0].a.weight.sum()
        refused = None
    except zeropp.zero.ParameterAccessError as err:
        refused = str(err)
    # an alias reads nothing (transformers' ZeRO-3 loading takes state_dict() for its keys); reading it is refused
    keys = list(model.state_dict())
    alias = model.blocks[0].a.weight.detach()
    try:
        alias.sum()
        alias_refused = None
    except zeropp.zero.ParameterAccessError as err:
        alias_refused = str(err)
    del alias
    engine, *_ = zeropp.initialize(model=model, config=config())
    built = {"state": state_of(engine), "losses": train_hand(engine, rank), "shape": shape, "refused": refused,
             "keys": keys, "alias_refused": alias_refused}
    engine.close()
    return {"normal": normal, "init": built}


def init_context_rules(rank: int) -> dict:
    """Nested contexts, a class declared inside, initialize inside, an exception in __init__."""
    out = {}
    with zeropp.zero.Init():
        class Declared(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc(x).pow(2).sum()

        with zeropp.zero.Init():
            model = Declared()
        engine, *_ = zeropp.initialize(model=model, config=config())
        loss = engine(torch.ones(2, 4))
        engine.backward(loss)
        engine.step()
        out["inside"] = bool(torch.isfinite(loss))
        engine.close()
    from zeropp.zero.construction import PARAMS
    try:
        with zeropp.zero.Init():
            Broken()
        out["raised"] = False
    except RuntimeError as err:
        out["raised"] = "broken on purpose" in str(err)
    gc.collect()
    out["unwrapped"] = not getattr(nn.Linear.__init__, "__zeropp_wrapped__", False)
    out["no_subclass_hook"] = "__init_subclass__" not in vars(nn.Module)
    from zeropp.zero.init_context import _Access
    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    out["modes"] = sum(isinstance(m, _Access) for m in stack)
    out["left"] = len(PARAMS)
    with zeropp.zero.Init():
        again = nn.Linear(4, 4)
    out["again"] = PARAMS.get(again.weight) is not None
    plain = nn.Linear(4, 4)
    out["outside"] = PARAMS.get(plain.weight) is None and bool(torch.isfinite(plain.weight.sum()))
    del again
    return out


def gathered_loading(rank: int) -> dict:
    """transformers' loading under DeepSpeed: each module's parameters written on rank 0 inside
    GatheredParameters(modifier_rank=0), after zero.Init and before initialize."""
    torch.manual_seed(321)
    pretrained = llama().state_dict()
    torch.manual_seed(rank)
    with zeropp.zero.Init():
        model = llama()

    def load(module: nn.Module, prefix: str = "") -> None:
        params = [p for n, p in module.named_parameters(recurse=False) if prefix + n in pretrained]
        with zeropp.zero.GatheredParameters(params, modifier_rank=0):
            if dist.get_rank() == 0:
                module._load_from_state_dict(pretrained, prefix, {}, True, [], [], [])
        for name, child in module._modules.items():
            load(child, prefix + name + ".")
    load(model)
    with zeropp.zero.GatheredParameters(list(model.parameters())):
        seen = all(torch.equal(p, pretrained[n]) for n, p in model.named_parameters())
    engine, *_ = zeropp.initialize(model=model, config=config())
    got = engine.consolidated_state_dict()
    engine.close()
    return {"seen": seen, "after": all(torch.equal(got[k], pretrained[k]) for k in got)}


def pretrained(rank: int, paths: dict) -> dict:
    out = {}
    from zeropp.hf import from_pretrained
    for name, path in paths.items():
        model = from_pretrained(path)
        engine, *_ = zeropp.initialize(model=model, config=config())
        x, _ = hf_batch(0, 2)
        with torch.no_grad():
            out[name] = engine(input_ids=x).logits
        engine.close()
    return out


def scenarios4(rank: int, world: int, paths: dict) -> dict:
    return {"init_memory": init_memory(rank), "broadcast_memory": broadcast_memory(rank),
            "meta": meta_families(rank), "refusals": refusals(rank), "rank0": rank0_loading(rank),
            "disagreement": disagreement(rank), "init": init_parity(rank), "rules": init_context_rules(rank),
            "gathered": gathered_loading(rank), "pretrained": pretrained(rank, paths)}


def scenarios2(rank: int, world: int) -> dict:
    return {"init": init_parity(rank)}


@functools.lru_cache(maxsize=None)
def checkpoints() -> tuple[dict, dict]:
    """Tiny Llama and GPT-2 checkpoints saved with save_pretrained (one sharded), and the logits that
    transformers' own from_pretrained gives in one process."""
    import transformers
    root = tempfile.mkdtemp(prefix="zeropp-pretrained-")
    paths, logits = {}, {}
    for name, family, shard in (("llama", llama, None), ("gpt2_sharded", gpt2, "20KB")):
        torch.manual_seed(5)
        path = f"{root}/{name}"
        family().save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
        reference = transformers.AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            logits[name] = reference(input_ids=hf_batch(0, 2)[0]).logits
        paths[name] = path
    return paths, logits


@functools.lru_cache(maxsize=None)
def results4() -> list:
    return run_world(scenarios4, 4, checkpoints()[0], ranks_per_node=2, env=MALLOC_ENV)


@functools.lru_cache(maxsize=None)
def results2() -> list:
    return run_world(scenarios2, 2, env=MALLOC_ENV)


def _rank(key: str) -> list:
    return [res[key] for res in results4()]


# ---- zero.Init --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_init_runs_init_code_as_written_and_trains_as_built_without_it(world):
    torch.manual_seed(0)
    reference = HandNet().state_dict()
    for res in (results2() if world == 2 else results4()):
        normal, built = res["init"]["normal"], res["init"]["init"]
        assert built["shape"] == (16, 16)  # the full shape stays readable
        assert set(built["state"]) == set(reference)
        for key, value in reference.items():  # ranks seeded differently end with rank 0's model, exactly
            assert torch.equal(built["state"][key], value), key
            assert torch.equal(normal["state"][key], value), key
        assert built["losses"] == normal["losses"]
        assert "GatheredParameters" in built["refused"] and "Linear.weight" in built["refused"]
        assert built["keys"] == list(reference)
        assert "a view of it" in built["alias_refused"] and "Linear.weight" in built["alias_refused"]


def test_init_peak_memory_stays_under_two_blocks_plus_shards():
    for rank, res in enumerate(_rank("init_memory")):
        assert res["shape"] == (1536, 1536)
        bound = 2 * res["block"] + res["held"]
        assert res["peak"] < bound, f"rank {rank}: peak {res['peak'] / MiB:.1f} MiB >= {bound / MiB:.1f} MiB"
        assert res["peak"] > 0.5 * res["held"]  # the shards themselves: the measurement sees memory
        assert res["held"] < 8 * res["block"] / 3  # each rank holds its quarter of the 8 blocks


def test_init_context_nests_declares_initializes_inside_and_cleans_up():
    for res in _rank("rules"):
        assert res["inside"] and res["raised"]
        assert res["unwrapped"] and res["no_subclass_hook"] and res["modes"] == 0
        assert res["left"] == 0  # the broken module's partitioned parameters went with it
        assert res["again"] and res["outside"]


def test_gathered_parameters_on_rank_0_loads_every_rank_before_initialize():
    for res in _rank("gathered"):
        assert res["seen"] and res["after"]


# ---- meta construction ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_meta_built_transformers_match_buffers_init_every_parameter_and_train(family):
    states = []
    for res in _rank("meta"):
        got = res[family]
        assert sorted(got["buffers"]) == got["want"]
        for name, (equal, _) in got["buffers"].items():
            assert equal, f"{family}: buffer {name} differs from a normally built model's"
        state = got["state"]
        for name, value in state.items():
            assert torch.isfinite(value).all(), f"{family}: {name} holds non-finite values"
            norm = "norm" in name.lower() or "ln_" in name
            if norm:  # the recipe's (or reset_parameters') constants, exactly
                assert torch.all(value == (1 if name.endswith("weight") else 0)), f"{family}: {name}"
            elif value.numel() > 1 and not name.endswith("bias"):
                assert float(value.float().std()) > 0, f"{family}: {name} looks unwritten"
        losses = got["losses"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
        states.append(state)
    for other in states[1:]:
        assert all(torch.equal(states[0][k], other[k]) for k in states[0])


def test_meta_construction_refuses_what_no_init_wrote_by_name():
    for res in _rank("refusals"):
        assert "rot.inv_freq" in res["lost_buffer"] and "'dim'" in res["lost_buffer"]
        assert "'scale'" in res["skipped_param"] and "param_init_fn" in res["skipped_param"]
        assert res["kept_buffer"]
        assert res["moved_here"] and "'Embedding.weight'" in res["moved_away"] and "meta" in res["moved_away"]


# ---- one model at initialize ------------------------------------------------------------------------------------
def test_weights_loaded_on_rank_0_only_train_as_if_every_rank_loaded():
    for res in _rank("rank0"):
        assert res["rank0"] == res["all"]  # bit for bit, fp32 with ZeRO++


def test_broadcast_holds_at_most_one_unit_beyond_the_shards():
    results = _rank("broadcast_memory")
    expected = results[0]["expected"]
    for rank, res in enumerate(results):
        assert res["got"] == expected
        bound = res["held"] + res["block"] + 8 * MiB
        assert res["peak"] < bound, f"rank {rank}: peak {res['peak'] / MiB:.1f} MiB >= {bound / MiB:.1f} MiB"


def test_ranks_that_disagree_are_warned_about_when_not_broadcast():
    for res in _rank("disagreement"):
        assert res[True] == [] and res["equal_rank0"]
        # every rank compares every rank's digests with rank 0's, and names the first that differs
        assert len(res[False]) == 1 and "rank 1 holds other values than rank 0 in unit '" in res[False][0]


# ---- pretrained -------------------------------------------------------------------------------------------------
def test_from_pretrained_reads_chunks_to_the_same_logits():
    _, logits = checkpoints()
    for res in _rank("pretrained"):
        for name, want in logits.items():
            assert torch.equal(res[name], want), name


def gathered_by_broadcasts(rank: int, world: int) -> dict:
    """Note [large host gathers], forced on small parameters: GatheredParameters gives the values built."""
    from zeropp.zero import construction
    construction.HOST_BROADCAST_FROM = 0  # every host parameter by broadcasts (odd sizes too: 7 x 9 over 2 ranks)
    torch.manual_seed(0)
    with zeropp.zero.Init():
        model = nn.Sequential(nn.Linear(64, 48), nn.Linear(9, 7))
    with zeropp.zero.GatheredParameters(list(model.parameters())):
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"got": got}


def test_large_host_parameters_gather_by_broadcasts_to_the_same_values():
    torch.manual_seed(0)
    want = nn.Sequential(nn.Linear(64, 48), nn.Linear(9, 7)).state_dict()
    for res in run_world(gathered_by_broadcasts, 2):
        assert set(res["got"]) == set(want)
        for key, value in want.items():
            assert torch.equal(res["got"][key], value), key
