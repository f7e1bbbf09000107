"""zeropp.checkpointing: DeepSpeed's activation-checkpointing names and settings (the math under stage 3 and
ZeRO++ is tested on 2x2 ranks in tests/dist/test_activation_checkpointing.py).

``cpu_checkpointing`` copies nothing on a CPU-only run (the host is the compute device), so its round trip
is tested through an injected ``ThreadedLink``: a separate "device" whose copies run later on a worker
thread and whose destinations hold NaN until then, so a value read before its copy arrived would show.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

import zeropp
from zeropp import checkpointing
from zeropp.activation import checkpointing as core
from zeropp.config import ConfigWarning
from zeropp.offload.link import ThreadedLink
from zeropp.deepspeed.missing import DeepSpeedAPIError
from zeropp.zero.memory import ActivationMeter


@pytest.fixture(autouse=True)
def fresh_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts unconfigured, with no injected link and no buffers (module state is global)."""
    monkeypatch.setattr(core, "_settings", None)
    monkeypatch.setattr(core, "_warned", set())
    monkeypatch.setattr(core, "_deferred", None)
    checkpointing.set_link(None)
    checkpointing.reset()
    yield
    checkpointing.set_link(None)
    checkpointing.reset()


def _blocks(n: int = 4, dim: int = 16) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * dim, dim))
                         for _ in range(n))


def _run(blocks: nn.ModuleList, checkpointed: bool, x0: torch.Tensor) -> dict:
    """Forward and backward under a meter; gradients, and the bytes saved for backward (peak, and after)."""
    for p in blocks.parameters():
        p.grad = None
    x = x0.detach().clone().requires_grad_(True)
    meter = ActivationMeter(blocks)
    torch.manual_seed(7)  # dropout: the same masks in every run
    with meter.watching():
        h = x * 1.0
        for block in blocks:
            h = h + (checkpointing.checkpoint(block, h) if checkpointed else block(h))
        loss = h.square().mean()
    saved = meter.report()
    loss.backward()
    return {"loss": loss.detach(), "grads": [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()],
            "saved": saved, "after": dict(meter.now)}


def _equal(a: dict, b: dict) -> bool:
    return torch.equal(a["loss"], b["loss"]) and all(torch.equal(g, h) for g, h in zip(a["grads"], b["grads"]))


def test_checkpoint_reruns_the_function_in_backward_with_the_same_gradients() -> None:
    calls = []
    lin = torch.nn.Linear(4, 4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.nn.functional.dropout(lin(x).relu(), 0.5)

    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(0)
    fn(x).sum().backward()
    want = (x.grad.clone(), lin.weight.grad.clone())
    x.grad, lin.weight.grad = None, None
    torch.manual_seed(0)
    zeropp.checkpointing.checkpoint(fn, x).sum().backward()
    assert len(calls) == 3  # once plain, twice checkpointed (forward and its rerun)
    assert torch.equal(x.grad, want[0]) and torch.equal(lin.weight.grad, want[1])  # the same dropout mask


def test_configure_reads_the_section_and_the_keywords_override_it() -> None:
    assert not checkpointing.is_configured()
    cfg = {"train_batch_size": 4, "activation_checkpointing": {
        "cpu_checkpointing": True, "number_checkpoints": 4, "profile": True, "synchronize_checkpoint_boundary": True}}
    checkpointing.configure(None, deepspeed_config=cfg)
    assert checkpointing.is_configured()
    assert checkpointing.settings() == checkpointing.Settings(cpu_checkpointing=True, number_checkpoints=4,
                                                              synchronize_checkpoint_boundary=True, profile=True)
    checkpointing.configure(None, deepspeed_config=cfg, checkpoint_in_cpu=False, profile=False)
    assert not checkpointing.settings().cpu_checkpointing and not checkpointing.settings().profile
    checkpointing.configure()  # each call starts from the defaults, as DeepSpeed's does
    assert checkpointing.settings() == checkpointing.Settings()
    checkpointing.reset()  # DeepSpeed's reset() frees buffers and keeps the settings
    assert checkpointing.is_configured()


def test_configure_names_what_it_refuses() -> None:
    with pytest.raises(DeepSpeedAPIError, match="model parallelism"):
        checkpointing.configure(mpu_=object())
    with pytest.raises(AssertionError, match="Must specify the number of layers.*num_checkpoints"):
        checkpointing.configure(contiguous_checkpointing=True)  # DeepSpeed 0.19.8's check and error type
    with pytest.raises(DeepSpeedAPIError, match="contiguous_memory_optimization together with cpu_checkpointing"):
        checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=2, checkpoint_in_cpu=True)
    with pytest.raises(DeepSpeedAPIError, match="get_cuda_rng_tracker"):
        checkpointing.get_cuda_rng_tracker  # noqa: B018
    assert not checkpointing.is_configured()


def test_initialize_takes_a_megatron_section_and_leaves_contiguous_checkpointing_to_configure() -> None:
    # Megatron's config turns contiguous checkpointing on and leaves number_checkpoints to the script's own
    # configure(..., num_checkpoints=...) call: initialize must not fail on it, and checkpoints run without the
    # contiguous buffer until that call (DeepSpeed's initialize never applies the section)
    path = Path(__file__).resolve().parents[1] / "data" / "configs" / \
        "deepspeed-megatron_gpt2-ds_config_func_bs8_zero2_offload.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointing.apply_config(str(path))
        notes = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
        assert any("no number_checkpoints" in n for n in notes), notes  # why the buffer waits, said once
        assert checkpointing.is_configured() and not checkpointing.settings().contiguous_memory_optimization
        lin, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
        checkpointing.checkpoint(lin, x).sum().backward()
        assert x.grad is not None and not checkpointing.buffer_bytes()  # ran, and no contiguous buffer was made
        checkpointing.configure(None, deepspeed_config=str(path), num_checkpoints=2)  # the script's own call
        assert checkpointing.settings().contiguous_memory_optimization
        assert checkpointing.settings().number_checkpoints == 2
        checkpointing.configure(deepspeed_config=str(path), num_checkpoints=2)  # what the script then does
    checkpointing.checkpoint(lin, x).sum().backward()


def test_partition_activations_warns_once_and_changes_nothing() -> None:
    blocks, x = _blocks(), torch.randn(8, 16)
    checkpointing.configure()
    want = _run(blocks, True, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointing.configure(partition_activations=True)
        checkpointing.configure(deepspeed_config={"train_batch_size": 1,
                                                  "activation_checkpointing": {"partition_activations": True}})
    notes = [w for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(notes) == 1
    assert "model-parallel" in str(notes[0].message) and "data-parallel" in str(notes[0].message)
    got = _run(blocks, True, x)
    assert _equal(got, want) and got["saved"] == want["saved"]  # whole checkpoints, the same values


def test_cpu_checkpointing_round_trip_through_a_link_is_bit_identical() -> None:
    blocks, x = _blocks(), torch.randn(8, 16)
    plain = _run(blocks, False, x)
    checkpointing.configure()
    kept = _run(blocks, True, x)
    link = ThreadedLink(delay=0.001)
    checkpointing.set_link(link)
    checkpointing.configure(checkpoint_in_cpu=True)
    host = _run(blocks, True, x)
    assert _equal(kept, plain) and _equal(host, plain)
    assert link.copies == 2 * len(blocks)  # each block's input: down in forward, up for its rerun
    one_input = x.numel() * x.element_size()
    # the inputs left the compute device: what stays there is the loss's own input (h), as in the plain run
    assert kept["saved"]["saved_peak_device"] == (len(blocks) + 1) * one_input
    assert host["saved"]["saved_peak_device"] == one_input
    assert host["saved"]["saved_peak_host"] == len(blocks) * one_input
    assert plain["saved"]["saved_peak_device"] > 4 * kept["saved"]["saved_peak_device"]
    assert host["after"] == {"device": 0, "host": 0}  # backward dropped every saved tensor


def test_cpu_checkpointing_copies_nothing_when_the_host_is_the_device() -> None:
    blocks, x = _blocks(), torch.randn(8, 16)
    checkpointing.configure()
    kept = _run(blocks, True, x)
    checkpointing.configure(checkpoint_in_cpu=True)
    host = _run(blocks, True, x)  # no link injected: a CPU tensor is not copied to the CPU
    assert _equal(host, kept) and host["saved"] == kept["saved"]
    assert host["saved"]["saved_peak_host"] == 0


def test_restored_inputs_keep_their_strides_and_keyword_tensors_move_too() -> None:
    seen: list[tuple] = []
    lin = nn.Linear(6, 6)

    def fn(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        seen.append(x.stride())
        return lin(x) * scale

    base = torch.randn(6, 5, requires_grad=True)
    x = base.t()  # not contiguous: strides (1, 5)
    scale = torch.randn(5, 6, requires_grad=True)
    want = torch.autograd.grad(fn(x, scale=scale).sum(), (base, scale))
    link = ThreadedLink(delay=0.0)
    checkpointing.set_link(link)
    checkpointing.configure(checkpoint_in_cpu=True)
    got = torch.autograd.grad(checkpointing.checkpoint(fn, x, scale=scale).sum(), (base, scale))
    assert seen == [(1, 5)] * 3  # plain, checkpointed forward, rerun: the layout the forward saw
    assert link.copies == 4  # x and the keyword tensor, down and up
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_checkpoint_inside_another_leaves_the_inner_inputs_to_the_outer_rerun() -> None:
    blocks, x0 = _blocks(), torch.randn(8, 16)

    def pair(h: torch.Tensor) -> torch.Tensor:  # an outer checkpoint around two inner ones
        for block in blocks[:2]:
            h = h + checkpointing.checkpoint(block, h)
        return h

    def run() -> list[torch.Tensor]:
        for p in blocks.parameters():
            p.grad = None
        x = x0.clone().requires_grad_(True)
        torch.manual_seed(7)
        checkpointing.checkpoint(pair, x).square().mean().backward()
        return [p.grad.clone() for p in blocks[:2].parameters()] + [x.grad]

    checkpointing.configure()
    want = run()
    link = ThreadedLink(delay=0.0)
    checkpointing.set_link(link)
    checkpointing.configure(checkpoint_in_cpu=True)
    got = run()
    assert link.copies == 2  # the outer input only, down and back: the outer rerun rebuilds the inner ones
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_contiguous_checkpoints_live_in_one_buffer_allocated_once() -> None:
    blocks, x = _blocks(), torch.randn(8, 16)
    checkpointing.configure()
    kept = _run(blocks, True, x)
    checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=len(blocks))
    first = _run(blocks, True, x)
    buffers = checkpointing.buffer_bytes()
    assert list(buffers.values()) == [len(blocks) * x.numel() * x.element_size()]
    pointer = next(iter(core._slots.values())).data.data_ptr()
    second = _run(blocks, True, x)
    assert next(iter(core._slots.values())).data.data_ptr() == pointer  # reused, not reallocated
    assert _equal(first, kept) and _equal(second, kept)
    # the saved inputs are views of the buffer: the meter counts the buffer once, plus the loss's input
    assert first["saved"]["saved_peak_device"] == (len(blocks) + 1) * x.numel() * x.element_size()
    checkpointing.reset()
    assert checkpointing.buffer_bytes() == {}


def test_contiguous_overflow_names_number_checkpoints() -> None:
    blocks, x = _blocks(), torch.randn(8, 16, requires_grad=True)
    checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=len(blocks))
    h = x
    for block in blocks:
        h = checkpointing.checkpoint(block, h)
    with pytest.raises(DeepSpeedAPIError, match="number_checkpoints=4"):  # a second forward before backward
        checkpointing.checkpoint(blocks[0], h)
    h.sum().backward()  # the first forward's slots are released with its graph
    del h
    checkpointing.checkpoint(blocks[0], x).sum().backward()


def test_profile_times_each_forward_and_rerun_and_synchronize_is_a_no_op_on_the_cpu() -> None:
    blocks, x = _blocks(), torch.randn(8, 16)
    checkpointing.configure()
    want = _run(blocks, True, x)
    checkpointing.configure(profile=True, synchronize=True)
    got = _run(blocks, True, x)
    times = checkpointing.timings()
    assert {k: v["count"] for k, v in times.items()} == {"forward": len(blocks), "recompute": len(blocks)}
    assert all(v["total_s"] > 0 for v in times.values())
    assert _equal(got, want)


def test_a_transformers_model_checkpoints_through_zeropp() -> None:
    from support.hf_models import gpt2, hf_batch, hf_loss

    x, y = hf_batch(0, 4)

    def grads(enable: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = gpt2()
        model.train()
        if enable == "hf":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            checkpointing.gradient_checkpointing_enable(model)
        hf_loss(model, x, y).backward()
        return [p.grad for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed gradient_checkpointing_enable
        want = grads("hf")
        link = ThreadedLink(delay=0.0)
        checkpointing.set_link(link)
        checkpointing.configure(checkpoint_in_cpu=True)
        got = grads("zeropp")
    assert link.copies == 2 * 2  # two GPT-2 blocks: each one's hidden states down and back
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="does not support activation checkpointing"):
        checkpointing.gradient_checkpointing_enable(nn.Linear(2, 2))
