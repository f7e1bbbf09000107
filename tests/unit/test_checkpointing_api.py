"""zeropp.checkpointing: DeepSpeed's activation-checkpointing names (the math is tested on 2x2 ranks in
tests/dist/test_activation_checkpointing.py)."""
from __future__ import annotations

import pytest
import torch

import zeropp
from zeropp.zero.deepspeed_surface import DeepSpeedAPIError


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


def test_configure_reads_the_config_section_and_names_what_is_not_built() -> None:
    zeropp.checkpointing.reset()
    assert not zeropp.checkpointing.is_configured()
    cfg = {"train_batch_size": 4, "activation_checkpointing": {"number_checkpoints": 4, "profile": True}}
    zeropp.checkpointing.configure(None, deepspeed_config=cfg)
    assert zeropp.checkpointing.is_configured()
    for section, named in (({"partition_activations": True}, "partition_activations=True"),
                           ({"cpu_checkpointing": True}, "checkpoint_in_cpu=True"),
                           ({"contiguous_memory_optimization": True}, "contiguous_checkpointing=True")):
        with pytest.raises(DeepSpeedAPIError, match=named):
            zeropp.checkpointing.configure(None, deepspeed_config={"train_batch_size": 4,
                                                                   "activation_checkpointing": section})
    with pytest.raises(DeepSpeedAPIError, match="model parallelism"):
        zeropp.checkpointing.configure(mpu_=object())
    with pytest.raises(DeepSpeedAPIError, match="get_cuda_rng_tracker"):
        zeropp.checkpointing.get_cuda_rng_tracker  # noqa: B018
    zeropp.checkpointing.reset()
