"""``ZeroppTrainer`` on one CUDA device, where transformers' Trainer places the model on ``args.device`` itself:
a model built plainly on the host, and one built under ``zero.Init`` (already partitioned on the device), each
train as the plain Trainer does on the device (fp32, the same batches)."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import zeropp
from support.hf_trainer_case import GAS, MICRO, corpus_windows, tiny_gpt2, training_args

DEVICE = torch.device("cuda", 0)
USE_CPU = False  # the dry run on a machine without CUDA sets this
STEPS = 4


def _history(trainer: Any) -> list[tuple[float, float, float]]:
    return [(h["loss"], float(h["grad_norm"]), h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def _trainer(out: str, model: torch.nn.Module, engine: bool) -> Any:
    import transformers
    from zeropp.hf import ZeroppTrainer
    args = training_args(out, use_cpu=USE_CPU, bf16=False, save_strategy="no", max_steps=STEPS, warmup_steps=1,
                         lr_scheduler_type="linear", train_sampling_strategy="sequential",
                         per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS)
    if engine:
        trainer = ZeroppTrainer(model=model, args=args, train_dataset=corpus_windows(),
                                zeropp_config={"zero_optimization": {"stage": 3}})
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=corpus_windows())
    trainer.model_accepts_loss_kwargs = True
    trainer.train()
    return trainer


@pytest.mark.parametrize("built", ["host", "zero_init"])
def test_zeropp_trainer_on_the_device_trains_as_the_plain_trainer(tmp_path, built):
    # zero.Init builds on the device, so its reference is built there too (the device's generator draws)
    with torch.device(DEVICE if built == "zero_init" else "cpu"):
        reference = tiny_gpt2(seed=2)
    want = _history(_trainer(os.path.join(tmp_path, "plain"), reference, engine=False))
    if built == "host":
        model = tiny_gpt2(seed=2)
    else:
        with zeropp.zero.Init():
            model = tiny_gpt2(seed=2)
        assert {p.device for p in model.parameters()} == {DEVICE}
    trainer = _trainer(os.path.join(tmp_path, "engine"), model, engine=True)
    assert all(u.device == DEVICE for u in trainer.engine.units)
    got = _history(trainer)
    assert len(got) == len(want) == STEPS
    assert got[-1][0] < got[0][0]
    flat = [v for row in got for v in row]
    assert flat == pytest.approx([v for row in want for v in row], rel=1e-4)
    trainer.engine.close()
