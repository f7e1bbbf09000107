"""The road into zeropp on one CUDA device (a world of one over NCCL): a transformers model built under
``zero.Init`` (created on the device, as DeepSpeed does), one read from its safetensors checkpoint by
``zeropp.hf.from_pretrained``, a checkpoint saved and resumed, ``engine.compile`` with inductor, and
``deepspeed.utils``' full-value reads and writes with the optimizer on the host. Each is compared with the
same run built the plain way on the device."""
from __future__ import annotations

import pytest
import torch

import zeropp
from support.hf_models import hf_batch, hf_loss, llama
from support.models import TiedNet, tied_batch
from support.train import config
from zeropp.deepspeed import utils as ds_utils

GB = 8
DEVICE = torch.device("cuda", 0)
ZEROPP = {"zero_quantized_weights": True, "zero_quantized_gradients": True}


def _cfg(bf16: bool = True, **zero: object) -> dict:
    cfg = config(GB, **zero)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train_hf(engine, steps: range) -> list[float]:  # noqa: ANN001
    losses = []
    for step in steps:
        x, y = hf_batch(step, 4)
        loss = hf_loss(engine, x.to(DEVICE), y.to(DEVICE))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def _train_tied(engine, steps: range) -> list[float]:  # noqa: ANN001
    losses = []
    for step in steps:
        idx, tgt = tied_batch(step, GB)
        loss = engine(idx.to(DEVICE), tgt.to(DEVICE))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def _on_device(engine) -> bool:  # noqa: ANN001
    return all(u.device == DEVICE and u.master.device == DEVICE for u in engine.units)


def test_zero_init_builds_on_the_device_and_trains_as_built_without_it():
    torch.manual_seed(0)
    with torch.device(DEVICE):
        plain_model = llama()
    plain, *_ = zeropp.initialize(model=plain_model, config=_cfg(**ZEROPP))
    want_state, want = plain.consolidated_state_dict(), _train_hf(plain, range(4))
    plain.close()

    torch.manual_seed(0)  # the same CUDA generator draws, in the same order, as the plain build
    with zeropp.zero.Init():
        model = llama()
    assert {p.device for p in model.parameters()} == {DEVICE}
    assert {b.device for b in model.buffers()} == {DEVICE}
    engine, *_ = zeropp.initialize(model=model, config=_cfg(**ZEROPP))
    assert _on_device(engine)
    state = engine.consolidated_state_dict()
    assert state.keys() == want_state.keys()
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key
    assert _train_hf(engine, range(4)) == want
    assert want[-1] < want[0]
    engine.close()


def test_from_pretrained_reads_onto_the_device_and_gives_transformers_logits(tmp_path):
    import transformers
    from zeropp.hf import from_pretrained
    torch.manual_seed(5)
    llama().save_pretrained(tmp_path)
    x = hf_batch(0, 2)[0].to(DEVICE)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).to(DEVICE)
    with torch.no_grad():
        want = reference(input_ids=x).logits
    model = from_pretrained(tmp_path)
    assert {b.device for b in model.buffers()} == {DEVICE}  # rotary frequencies recomputed on the device
    engine, *_ = zeropp.initialize(model=model, config=_cfg(bf16=False))
    assert _on_device(engine)
    with torch.no_grad():
        got = engine(input_ids=x).logits
    assert got.device == DEVICE
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    engine.close()


def test_a_checkpoint_saved_on_the_device_resumes_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    first, *_ = zeropp.initialize(model=TiedNet().to(DEVICE), config=_cfg(**ZEROPP))
    _train_tied(first, range(2))
    first.save_checkpoint(str(tmp_path), tag="two")
    want = _train_tied(first, range(2, 5))
    first.close()
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them all
    second, *_ = zeropp.initialize(model=TiedNet().to(DEVICE), config=_cfg(**ZEROPP))
    path, _ = second.load_checkpoint(str(tmp_path), tag="two")
    assert path is not None and _on_device(second)
    assert _train_tied(second, range(2, 5)) == want
    second.close()


def test_compile_with_inductor_trains_like_eager_on_the_device():
    torch.manual_seed(0)
    eager, *_ = zeropp.initialize(model=TiedNet().to(DEVICE), config=_cfg(**ZEROPP))
    want = _train_tied(eager, range(5))
    eager.close()
    torch.manual_seed(0)
    engine, *_ = zeropp.initialize(model=TiedNet().to(DEVICE), config=_cfg(**ZEROPP))
    engine.compile(backend="inductor")
    assert engine.is_compiled
    got = _train_tied(engine, range(5))
    assert got == pytest.approx(want, rel=2e-2)  # inductor fuses bf16 arithmetic differently
    engine.close()


def test_deepspeed_utils_full_values_with_the_optimizer_on_the_host():
    torch.manual_seed(0)
    engine, *_ = zeropp.initialize(model=TiedNet().to(DEVICE),
                                   config=_cfg(offload_optimizer={"device": "cpu", "pin_memory": True}))
    _train_tied(engine, range(2))
    named = dict(engine.module.named_parameters())
    state = engine.consolidated_state_dict()
    name, param = next(iter(named.items()))
    full = ds_utils.safe_get_full_fp32_param(param)
    assert torch.equal(full.cpu(), state[name].cpu())
    assert ds_utils.safe_get_full_optimizer_state(param, "exp_avg") is not None
    value = torch.full(param.shape, 0.25, device=DEVICE)  # a value on the device into a master on the host
    ds_utils.safe_set_full_fp32_param(param, value)
    assert torch.equal(ds_utils.safe_get_full_fp32_param(param).cpu(), value.cpu())
    assert torch.equal(engine.consolidated_state_dict()[name].cpu(), value.cpu())
    moment = torch.full(param.shape, 1e-3, device=DEVICE)
    ds_utils.safe_set_full_optimizer_state(param, moment, "exp_avg")
    assert torch.equal(ds_utils.safe_get_full_optimizer_state(param, "exp_avg").cpu(), moment.cpu())
    losses = _train_tied(engine, range(2, 4))
    assert all(v == v for v in losses)  # finite after the writes
    engine.close()
