"""DeepSpeed's deprecated spellings and the keys DeepSpeed does not read (zeropp.config.legacy)."""
from __future__ import annotations

import warnings

import pytest

from zeropp.config import ConfigError, ConfigWarning, NotSupportedError, load_config


def load_warned(raw: dict) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"train_micro_batch_size_per_gpu": 1, **raw})
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_boolean_zero_optimization_reads_as_stage_one_with_allgather_size() -> None:
    cfg, notes = load_warned({"zero_optimization": True, "allgather_size": 1000})
    assert cfg.zero_optimization.stage == 1 and cfg.zero_optimization.allgather_bucket_size == 1000
    assert any("zero_optimization: true is DeepSpeed's deprecated form" in n for n in notes)
    cfg, _ = load_warned({"zero_optimization": False})
    assert cfg.zero_optimization.stage == 0


def test_cpu_offload_flags_read_as_offload_sections() -> None:
    cfg, notes = load_warned({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                    "cpu_offload_use_pin_memory": True}})
    zero = cfg.zero_optimization
    assert zero.offload_optimizer.device == "cpu" and zero.offload_param.device == "cpu"
    assert zero.offload_optimizer.pin_memory and zero.offload_param.pin_memory
    assert len(notes) == 3
    cfg, _ = load_warned({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert cfg.zero_optimization.offload_optimizer is None


def test_a_deprecated_flag_beside_its_section_is_an_error() -> None:
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload: given beside zero_optimization"
                                          ".offload_optimizer"):
        load_config({"zero_optimization": {"stage": 2, "cpu_offload": True,
                                           "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload: expected true or false"):
        load_config({"zero_optimization": {"stage": 2, "cpu_offload": "yes"}})
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload_use_pin_memory: expected true or false"):
        load_config({"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": "yes"}})


def test_deepspeeds_field_names_of_stage3_keys_are_read_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"zero_optimization": {"stage": 3, "param_persistence_threshold": 1e4,
                                                 "model_persistence_threshold": 5e5, "prefetch_bucket_size": 7,
                                                 "max_live_parameters": 8, "module_granularity_threshold": 9}})
    zero = cfg.zero_optimization
    assert (zero.stage3_param_persistence_threshold, zero.stage3_model_persistence_threshold) == (10_000, 500_000)
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters) == (7, 8)
    assert zero.stage3_module_granularity_threshold == 9
    with pytest.raises(ConfigError, match="zero_optimization.max_reuse_distance: given beside "
                                          "zero_optimization.stage3_max_reuse_distance"):
        load_config({"zero_optimization": {"stage": 3, "max_reuse_distance": 1, "stage3_max_reuse_distance": 2}})


def test_keys_deepspeed_does_not_read_are_dropped_with_a_warning() -> None:
    cfg, notes = load_warned({"monitor_config": {"enabled": True}, "comms_config": {"verbose": False},
                              "cuda_visible_devices": 0, "_comment": "a note"})
    assert {n.split(":")[1].strip() for n in notes} == {"monitor_config", "comms_config", "cuda_visible_devices"}
    assert all("DeepSpeed does not read this key either" in n for n in notes)


def test_misplaced_aio_and_old_bf16_name_are_moved() -> None:
    cfg, notes = load_warned({"bfloat16": {"enabled": True},
                              "zero_optimization": {"stage": 3, "aio": {"thread_count": 2}}})
    assert cfg.bf16.enabled and cfg.aio.thread_count == 2
    assert len(notes) == 2
    with pytest.raises(ConfigError, match="bfloat16: given beside bf16"):
        load_config({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})


def test_deepspeed_features_load_when_off_and_are_refused_when_on() -> None:
    load_config({"train_batch_size": 4, "flops_profiler": {"enabled": False}, "tensorboard": {"enabled": False},
                 "sparse_gradients": False, "communication_data_type": None})
    with pytest.raises(NotSupportedError) as err:
        load_config({"train_batch_size": 4, "flops_profiler": {"enabled": True}, "wandb": {"enabled": True},
                     "aio": {"use_gds": True}})
    lines = err.value.problems
    assert len(lines) == 3
    assert lines[0].startswith("flops_profiler: not supported yet") and lines[1].startswith("wandb: not supported")


def test_a_typo_is_still_an_unknown_key() -> None:
    with pytest.raises(ConfigError, match="zero_optimisation: unknown key; did you mean 'zero_optimization'"):
        load_config({"zero_optimisation": {"stage": 1}})


def test_bf16_loss_scaling_keys_load_and_change_nothing() -> None:
    cfg = load_config({"train_batch_size": 4, "bf16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                                                      "loss_scale_window": 1000, "hysteresis": 2,
                                                      "min_loss_scale": 1, "immediate_grad_update": True}})
    assert cfg.bf16.enabled and not cfg.fp16.enabled
