"""``zero_quantized_nontrainable_weights`` on a LoRA-style fine-tune of a real ``transformers`` Llama, 2 nodes x 2
ranks, bf16 (Note [quantized frozen weights] in ``plus/frozen.py``): the frozen base is kept, gathered and
checkpointed as int8 + scales, the adapters train as before.

"Within bf16 noise" is taken as bf16's unit roundoff, 2**-8 relative: the loss of the quantized run stays
within one bf16 rounding of the unquantized run's at every step (measured: about 2e-4 relative).
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

import zeropp
from support.lora import lora_llama, train_lora
from support.world import run_world
from zeropp import accounting
from zeropp.partition.spec import ShardSpec, take_chunk
from zeropp.plus.frozen import QuantizedFrozenUnit
from zeropp.quant import BlockLayout, dequantize, quantize
from zeropp.topology import Layout

WORLD, PER_NODE, MICRO, STEPS, BLOCK = 4, 2, 2, 20, 2048
QFROZEN = {"zero_quantized_nontrainable_weights": True}


def _engine(zero: dict, seed: int = 0, world: int = WORLD):
    cfg = {"train_batch_size": WORLD * MICRO, "train_micro_batch_size_per_gpu": WORLD * MICRO // world,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, **zero}, "topology": {"ranks_per_node": PER_NODE}}
    engine, *_ = zeropp.initialize(model=lora_llama(seed), config=cfg)
    return engine


def _train(engine, rank: int, steps: int, first: int = 0, world: int = WORLD) -> list[float]:
    return train_lora(engine, rank, steps, first, world, WORLD * MICRO)


def _expected_frozen(world: int, values: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each frozen parameter as the engine must hold it: every rank's chunk of ``values`` (default: the
    model's initial weights) through the int8 spec."""
    out = {}
    model = dict(lora_llama(0).named_parameters())
    for name, p in model.items():
        if p.requires_grad:
            continue
        p = values[name] if values is not None else p
        spec = ShardSpec(p.numel(), p.shape, world)
        layout = BlockLayout((spec.chunk,), BLOCK)
        chunks = [dequantize(quantize(take_chunk(p.detach().float(), spec, r, world).view(1, -1), layout, 8), layout,
                             8, torch.float32)[0] for r in range(world)]
        out[name] = torch.cat(chunks)[: p.numel()].view(p.shape)
    return out


def _units(engine) -> dict:
    frozen = [u for u in engine.units if isinstance(u, QuantizedFrozenUnit)]
    return {
        "mixed": [u.module_name for u in engine.units if 0 < u.needs_grad() < len(u.slots)],
        "frozen_trainable": [s.name for u in frozen for s in u.slots if s.param.requires_grad],
        "plain_frozen": [s.name for u in engine.units if not isinstance(u, QuantizedFrozenUnit)
                         for s in u.slots if not s.param.requires_grad],
        "row_dtypes": sorted({str(u.qrow.dtype) for u in frozen}),
        "formula": sum(c + 4 * -(-c // BLOCK) for u in frozen for c in u.row.chunks),
        "frozen_16bit": 2 * sum(u.row.numel for u in frozen),
        "secondary": sum(t.numel() for t in engine.strategies.forward_gather.frozen.held_tensors()),
    }


def measure(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    ref = _engine({})
    out["ref"] = {"losses": _train(ref, rank, STEPS), "memory": ref.model_state_bytes()}
    q = _engine(QFROZEN)
    out["q"] = {"losses": _train(q, rank, STEPS), "memory": q.model_state_bytes(), "comm": q.comm_report(),
                "units": _units(q)}
    state = q.consolidated_state_dict()
    out["q"]["frozen_state"] = {n: state[n] for n in _expected_frozen(world)}
    out["numels"] = {n: (p.numel(), p.requires_grad) for n, p in q.module.named_parameters()}
    hpz = _engine({**QFROZEN, "zero_hpz_partition_size": PER_NODE})
    out["hpz"] = {"losses": _train(hpz, rank, STEPS), "comm": hpz.comm_report(), "units": _units(hpz),
                  "memory": hpz.model_state_bytes()}
    # resume: saved after 3 steps; the resuming engine starts from another (random) frozen base
    a = _engine({**QFROZEN, "zero_hpz_partition_size": PER_NODE})
    _train(a, rank, 3)
    a.save_checkpoint(os.path.join(root, "ckpt"), tag="t")
    frozen_names = _expected_frozen(world).keys()
    saved_state = {n: t for n, t in a.consolidated_state_dict().items() if n in frozen_names}
    saved_rows = [u.qrow.clone() for u in a.units if isinstance(u, QuantizedFrozenUnit)]
    after_a = _train(a, rank, 3, first=3)
    b = _engine({**QFROZEN, "zero_hpz_partition_size": PER_NODE}, seed=1)
    before_load = [u.qrow.clone() for u in b.units if isinstance(u, QuantizedFrozenUnit)]
    b.load_checkpoint(os.path.join(root, "ckpt"), tag="t")
    loaded_rows = [u.qrow.clone() for u in b.units if isinstance(u, QuantizedFrozenUnit)]
    out["resume"] = {"after_a": after_a, "after_b": _train(b, rank, 3, first=3),
                     "rows_restored": all(torch.equal(x, y) for x, y in zip(saved_rows, loaded_rows)),
                     "rows_differed": any(not torch.equal(x, y) for x, y in zip(saved_rows, before_load)),
                     "saved_state": saved_state}
    return out


def two_ranks(rank: int, world: int, root: str) -> dict:
    """The 4-rank checkpoint on 2 ranks: the frozen values are re-quantized in the new chunks."""
    b = _engine({**QFROZEN, "zero_hpz_partition_size": PER_NODE}, seed=1, world=world)
    b.load_checkpoint(os.path.join(root, "ckpt"), tag="t")
    state = b.consolidated_state_dict()
    return {"frozen_state": {n: state[n] for n in _expected_frozen(world)},
            "losses": _train(b, rank, 3, first=3, world=world)}


@functools.lru_cache(maxsize=1)
def results(root: str) -> tuple[list[dict], list[dict]]:
    return (run_world(measure, WORLD, root, ranks_per_node=PER_NODE),
            run_world(two_ranks, 2, root, ranks_per_node=PER_NODE))


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    return results(str(tmp_path_factory.mktemp("frozen")))


@pytest.fixture(scope="module")
def runs(both: tuple[list[dict], list[dict]]) -> list[dict]:
    return both[0]


def test_lora_trains_within_bf16_noise_of_the_unquantized_run(runs: list[dict]) -> None:
    ref, q = runs[0]["ref"]["losses"], runs[0]["q"]["losses"]
    assert len(q) == STEPS and all(map(torch.isfinite, torch.tensor(q)))
    rel = max(abs(a - b) / b for a, b in zip(q, ref))
    assert rel <= 2.0**-8, rel
    assert q != ref  # the frozen weights really are the quantized ones
    assert sum(q[-5:]) < sum(q[:5])  # the adapters learn


def test_frozen_shards_are_int8_and_half_of_16_bit(runs: list[dict]) -> None:
    for r in runs:
        u, mem, ref = r["q"]["units"], r["q"]["memory"], r["ref"]["memory"]
        assert u["row_dtypes"] == ["torch.uint8"]  # int8 codes (and fp32 scale bytes) in one byte row
        assert not u["mixed"] and not u["frozen_trainable"] and not u["plain_frozen"]
        assert mem["frozen_quantized"] == u["formula"] > 0
        # no fp32 master and no 16-bit shard for them: what the unquantized run holds beyond the adapters
        assert ref["shard_16bit"] - mem["shard_16bit"] == u["frozen_16bit"]
        assert ref["master_fp32"] - mem["master_fp32"] == 2 * u["frozen_16bit"]
        assert 0.5 <= mem["frozen_quantized"] / u["frozen_16bit"] <= 0.52


def test_frozen_weights_are_the_int8_spec_of_the_originals(runs: list[dict]) -> None:
    expected = _expected_frozen(WORLD)
    for r in runs:
        got = r["q"]["frozen_state"]
        assert got.keys() == expected.keys()
        for name, t in expected.items():
            assert torch.equal(got[name], t), name


def test_frozen_gather_sends_int8_bytes(runs: list[dict]) -> None:
    layout = Layout(WORLD, PER_NODE)
    numels = runs[0]["numels"]
    trainable = [n for n, t in numels.values() if t]
    frozen = [n for n, t in numels.values() if not t]
    for rank, r in enumerate(runs):
        want = (accounting.gather_volume(trainable, layout, rank, 2)
                + accounting.quantized_gather_volume(frozen, layout, rank, 8, BLOCK))
        assert r["q"]["comm"]["forward_gather"] == want.as_dict()


def test_hpz_keeps_int8_slices_and_frozen_gathers_stay_in_the_node(runs: list[dict]) -> None:
    trainable = [n for n, t in runs[0]["numels"].values() if t]
    layout = Layout(WORLD, PER_NODE)
    for rank, r in enumerate(runs):
        h = r["hpz"]
        assert h["losses"] == r["q"]["losses"]  # the same bytes from the int8 slices: bit-identical
        assert h["units"]["secondary"] == WORLD // PER_NODE * h["memory"]["frozen_quantized"]
        assert h["comm"]["backward_gather"]["inter_node_bytes"] == 0
        # after the first step only the trainable units' forward gather crosses nodes
        want = accounting.gather_volume(trainable, layout, rank, 2)
        assert h["comm"]["forward_gather"]["inter_node_bytes"] == want.inter_node_bytes


def test_resume_is_bit_identical_and_restores_the_int8_rows(runs: list[dict]) -> None:
    for r in runs:
        res = r["resume"]
        assert res["rows_differed"] and res["rows_restored"]
        assert res["after_a"] == res["after_b"]


def test_resume_on_two_ranks_requantizes_the_saved_values(both: tuple[list[dict], list[dict]]) -> None:
    saved = both[0][0]["resume"]["saved_state"]
    expected = _expected_frozen(2, saved)  # the 4-rank values, quantized again in 2-rank chunks
    after_a = both[0][0]["resume"]["after_a"]
    for r in both[1]:
        for name, t in expected.items():
            assert torch.equal(r["frozen_state"][name], t), name
        assert max(abs(x - y) / y for x, y in zip(r["losses"], after_a)) <= 2.0**-8


def test_frozen_quantized_needs_stage_3() -> None:
    from support.hf_models import llama
    from zeropp.config import ConfigError
    with pytest.raises(ConfigError, match="zero_quantized_nontrainable_weights: needs zero_optimization.stage 3"):
        zeropp.initialize(model=llama(), config={"train_batch_size": 1, "zero_optimization": {
            "stage": 2, "zero_quantized_nontrainable_weights": True}})


def offload_or_not(rank: int, world: int) -> dict:
    out = {}
    for name, extra in (("device", {}), ("offload", {"offload_optimizer": {"device": "cpu"}})):
        out[name] = _train(_engine({**QFROZEN, **extra}, world=world), rank, 4, world=world)
    return out


def test_optimizer_offload_with_frozen_int8_weights_is_bit_identical() -> None:
    for r in run_world(offload_or_not, 2, ranks_per_node=2):
        assert r["offload"] == r["device"]
