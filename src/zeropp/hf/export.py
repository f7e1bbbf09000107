"""Write a Hugging Face model directory (``config.json`` + ``model.safetensors``) from the engine's fp32 masters.

The weights saved are ``engine.consolidated_state_dict()``: the fp32 master weights gathered from every rank's
shard, the values the optimizer steps (the 16-bit weights the forward uses are these, rounded). That is lossless
and what a later fine-tune or a resume-from-weights wants; load it in 16 bits with
``from_pretrained(dir, dtype=torch.bfloat16)``.

``save_pretrained`` does the format's work — tied weights written once (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``), Hugging Face's weight-name conversions reverted, sharding of large files — but it
records the live parameters' dtype in ``config.json``; under bf16 or fp16 training that is the compute dtype,
and ``from_pretrained`` (whose default is ``dtype="auto"``) would then load the fp32 file into a 16-bit model.
:func:`save_fp32_pretrained` records float32, the dtype of the file.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Optional

import torch

TRAINING_ARGS_NAME = "training_args.bin"  # the Trainer's name for the saved TrainingArguments


def save_fp32_pretrained(model: Any, state: dict[str, torch.Tensor], output_dir: str) -> None:
    """``model.save_pretrained(output_dir, state_dict=state)`` with ``config.json`` saying float32; for a PEFT
    model, PEFT's own ``save_pretrained``, which keeps the adapter's weights from ``state``.

    Call on the writing rank only (global rank 0: ``save_pretrained`` writes nowhere else); ``state`` holds full
    fp32 tensors (tied names may share one tensor). ``model.config`` is left as it was.
    """
    if hasattr(model, "peft_config"):  # a PEFT model writes its adapter (adapter_model + adapter_config) only
        model.save_pretrained(output_dir, state_dict=state)
        return
    before = model.config.dtype
    try:
        model.save_pretrained(output_dir, state_dict=state)
        config = copy.deepcopy(model.config)  # save_pretrained recorded the architecture; keep that
    finally:
        model.config.dtype = before  # save_pretrained set the live (compute) dtype on the model's own config
    config.dtype = torch.float32
    config.save_pretrained(output_dir)


def save_companions(output_dir: str, args: Any, processing_class: Optional[Any]) -> None:
    """What the Trainer saves beside the weights: the tokenizer or processor, and the TrainingArguments."""
    if processing_class is not None:
        processing_class.save_pretrained(output_dir)
    torch.save(args, os.path.join(output_dir, TRAINING_ARGS_NAME))
