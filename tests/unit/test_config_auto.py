"""Hugging Face's "auto" values: resolved from what is given, derived, or named in an error."""
from __future__ import annotations

import pytest

from zeropp.config import ConfigError, load_config
from zeropp.config.auto import AutoValues, auto_paths, resolve_auto

HF_STAGE3 = {  # the shape of transformers' tests/deepspeed/ds_config_zero3.json
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
TRAINER = {"fp16.enabled": False, "bf16.enabled": True, "optimizer.params.lr": 5e-5,
           "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
           "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0.0,
           "scheduler.params.warmup_max_lr": 5e-5, "scheduler.params.warmup_num_steps": 10,
           "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}


def test_auto_paths_are_found_at_every_depth() -> None:
    paths = auto_paths(HF_STAGE3)
    assert "optimizer.params.lr" in paths and "zero_optimization.reduce_bucket_size" in paths
    assert "zero_optimization.stage" not in paths


def test_the_trainers_values_and_the_hidden_size_resolve_everything() -> None:
    cfg = load_config(HF_STAGE3, AutoValues(given=TRAINER, hidden_size=64))
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == 64 * 64
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert zero.stage3_param_persistence_threshold == 640
    assert cfg.bf16.enabled and cfg.gradient_clipping == 1.0
    assert cfg.optimizer.params.lr == 5e-5
    plan = cfg.resolve_batch(4)  # train_batch_size "auto" is derived: 4 x 2 x 4
    assert plan == (32, 4, 2)


def test_without_the_trainer_every_unresolved_auto_is_named() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(HF_STAGE3)
    msg = str(err.value)
    for path in ("optimizer.params.lr", "fp16.enabled", "bf16.enabled", "gradient_clipping",
                 "scheduler.params.warmup_num_steps"):
        assert f"{path}: \"auto\"" in msg
    assert "zero_optimization.reduce_bucket_size" in msg  # no model, no hidden size: cannot be sized
    assert "stage3_prefetch_bucket_size" not in msg  # tuning only: our default


def test_a_client_optimizer_and_scheduler_make_their_sections_unused() -> None:
    tree, problems = resolve_auto(HF_STAGE3, AutoValues(client_optimizer=True, client_scheduler=True))
    assert "optimizer" not in tree and "scheduler" not in tree
    assert not any(p.startswith(("optimizer", "scheduler")) for p in problems)


def test_resolution_does_not_change_the_callers_dict() -> None:
    resolve_auto(HF_STAGE3, AutoValues(given=TRAINER, hidden_size=8))
    assert HF_STAGE3["optimizer"]["params"]["lr"] == "auto"
