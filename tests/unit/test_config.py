"""Unit tests for zeropp.config: schema, error messages, not-supported table, file loading, batch sizes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from zeropp.config.loader import (
    NOT_SUPPORTED,
    BatchPlan,
    ConfigError,
    NotSupportedError,
    ZeroppConfig,
    check_supported,
    load_config,
    parse_config,
)
from zeropp.config.schema import ZeroConfig
from zeropp.config.schema import UNION_TAGS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"

# The ZeRO++ tutorial's zero_optimization block (deepspeed.ai/tutorials/zeropp), with typical extras.
TUTORIAL_ZERO = {
    "stage": 3,
    "reduce_bucket_size": 10000000,
    "reduce_scatter": True,
    "zero_quantized_weights": True,
    "zero_hpz_partition_size": 16,
    "zero_quantized_gradients": True,
    "contiguous_gradients": True,
    "overlap_comm": True,
}
TUTORIAL = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                             "weight_decay": 0.1}},
    "zero_optimization": TUTORIAL_ZERO,
}


def stage3(**zero: object) -> dict:
    """A minimal supported config with extra zero_optimization keys."""
    return {"zero_optimization": {"stage": 3, **zero}}


def error_of(raw: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    return info.value


# ------------------------------------------------------------------------------------------- happy path
def test_tutorial_config_loads() -> None:
    cfg = load_config(TUTORIAL)
    zero = cfg.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.zero_hpz_partition_size) == (3, 10_000_000, 16)
    assert zero.zero_quantized_weights and zero.zero_quantized_gradients and zero.reduce_scatter
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.params.betas == (0.9, 0.95)


def test_tutorial_zero_block_alone_loads_from_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_zeropp_config.json"
    path.write_text(json.dumps({"zero_optimization": TUTORIAL_ZERO}, indent=4))
    cfg = load_config(path)
    assert cfg.zero_optimization.zero_hpz_partition_size == 16
    assert load_config(str(path)) == cfg


def test_typical_user_zero3_file_with_tuning_keys_loads() -> None:
    raw = {
        "steps_per_print": 2000, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True,
        "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
            "offload_param": {"device": "none", "pin_memory": True}, "overlap_comm": True,
            "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 4.5e7, "stage3_param_persistence_threshold": 1e5,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": False, "round_robin_gradients": True,
            "allgather_partitions": True, "allgather_bucket_size": 2e8,
        },
    }
    cfg = load_config(raw)
    assert cfg.zero_optimization.sub_group_size == 1_000_000_000
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 45_000_000
    assert cfg.zero_optimization.offload_param.pin_memory is True


def test_defaults_follow_deepspeed() -> None:
    cfg = ZeroppConfig()
    zero = cfg.zero_optimization
    assert zero.stage == 0  # DeepSpeed's default; load_config then reports it as not supported yet
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.reduce_bucket_size is None  # a deliberate difference: sized from the model (Note [bucket size])
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 0  # a deliberate difference (docs/config.md, "Persistence")
    assert zero.stage3_module_granularity_threshold == 0
    assert zero.zero_hpz_partition_size == 1 and zero.quantization_block_size == 2048
    assert (zero.zero_quantized_weights_bits, zero.zero_quantized_gradients_bits) == (8, 4)
    assert (cfg.gradient_clipping, cfg.steps_per_print, cfg.fp16.initial_scale_power) == (0.0, 10, 16)
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.topology.ranks_per_node is None


@pytest.mark.parametrize("written", [5e8, 5.0e8, 500000000, 500000000.0])
def test_integer_fields_accept_integral_floats(written: float) -> None:
    cfg = load_config(stage3(reduce_bucket_size=written))
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(cfg.zero_optimization.reduce_bucket_size) is int


def test_models_are_frozen() -> None:
    cfg = load_config(stage3())
    with pytest.raises(Exception):
        cfg.zero_optimization.stage = 1  # type: ignore[misc]


def test_optimizer_type_is_case_insensitive() -> None:
    assert load_config({**stage3(), "optimizer": {"type": "adamw"}}).optimizer.type == "AdamW"
    sgd = load_config({**stage3(), "optimizer": {"type": "sgd", "params": {"momentum": 0.9}}}).optimizer
    assert sgd.type == "SGD" and sgd.params.momentum == 0.9


def test_topology_extension() -> None:
    assert load_config({**stage3(), "topology": {"ranks_per_node": 2}}).topology.ranks_per_node == 2
    assert "topology.ranks_per_node" in str(error_of({**stage3(), "topology": {"ranks_per_node": 0}}))


# ---------------------------------------------------------------------------------------- schema errors
def test_fractional_bucket_size_is_rejected_naming_the_path() -> None:
    msg = str(error_of(stage3(reduce_bucket_size=1.5)))
    assert msg.startswith("zero_optimization.reduce_bucket_size: expected an integer, got 1.5")
    assert "accepted: an integer" in msg


def test_wrong_type_names_path_and_expected_type() -> None:
    msg = str(error_of({"zero_optimization": {"stage": "three"}}))
    assert "zero_optimization.stage: expected an integer, got 'three'" in msg


@pytest.mark.parametrize("value", ["yes", 2, 1.0, "true"])
def test_bools_must_be_json_booleans(value: object) -> None:
    msg = str(error_of(stage3(overlap_comm=value)))
    assert "zero_optimization.overlap_comm: expected true or false" in msg


def test_one_and_zero_are_read_as_bools_as_deepspeed_reads_them() -> None:
    cfg = load_config({"zero_allow_untested_optimizer": 1, "bf16": {"enabled": 1},
                       "zero_optimization": {"stage": 2, "overlap_comm": 0, "cpu_offload": 1}})
    assert cfg.zero_allow_untested_optimizer is True and cfg.bf16.enabled is True
    assert cfg.zero_optimization.overlap_comm is False
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_bool_is_not_an_integer() -> None:
    assert "zero_optimization.reduce_bucket_size: expected an integer, got true" in str(
        error_of(stage3(reduce_bucket_size=True)))


def test_stage_out_of_range() -> None:
    msg = str(error_of({"zero_optimization": {"stage": 7}}))
    assert "zero_optimization.stage: must be 0, 1, 2 or 3, got 7" in msg
    assert not isinstance(error_of({"zero_optimization": {"stage": 7}}), NotSupportedError)


def test_unknown_nested_key_names_path_suggests_and_lists_keys() -> None:
    msg = str(error_of({"zero_optimization": {"stag": 3}}))
    assert msg.startswith("zero_optimization.stag: unknown key")
    assert "did you mean 'stage'?" in msg
    assert re.search(r"accepted keys: stage, reduce_bucket_size, .*zero_hpz_partition_size", msg)


def test_unknown_key_without_close_match_has_no_suggestion() -> None:
    msg = str(error_of(stage3(completely_different=1)))
    assert "zero_optimization.completely_different: unknown key; accepted keys:" in msg
    assert "did you mean" not in msg


def test_unknown_key_inside_offload_section() -> None:
    msg = str(error_of(stage3(offload_param={"device": "none", "pin_memroy": True})))
    assert "zero_optimization.offload_param.pin_memroy: unknown key; did you mean 'pin_memory'?" in msg


def test_unknown_key_in_optimizer_params_is_checked_per_type() -> None:
    msg = str(error_of({**stage3(), "optimizer": {"type": "Adam", "params": {"weight_decai": 0.1}}}))
    assert "optimizer.params.weight_decai: unknown key; did you mean 'weight_decay'?" in msg
    assert "momentum" not in msg  # Adam's accepted keys, not SGD's
    sgd = str(error_of({**stage3(), "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}))
    assert "optimizer.params.betas: unknown key" in sgd and "momentum" in sgd


def test_max_grad_norm_points_to_gradient_clipping() -> None:
    msg = str(error_of({**stage3(), "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}))
    assert "optimizer.params.max_grad_norm: unknown key" in msg and "gradient_clipping" in msg


def test_unknown_top_level_key_suggests_case_fix() -> None:
    assert "Bf16: unknown key; did you mean 'bf16'?" in str(error_of({**stage3(), "Bf16": {}}))


def test_all_problems_are_reported_in_one_error() -> None:
    err = error_of({"zero_optimization": {"stage": 7, "stag": 3, "overlap_comm": "yes"},
                    "gradient_clipping": -1})
    assert len(err.problems) == 4
    paths = sorted(p.split(":")[0] for p in err.problems)
    assert paths == ["gradient_clipping", "zero_optimization.overlap_comm", "zero_optimization.stag",
                     "zero_optimization.stage"]
    assert all("; accepted" in p for p in err.problems)


def test_unknown_optimizer_type() -> None:
    msg = str(error_of({**stage3(), "optimizer": {"type": "Adamm"}}))
    assert "optimizer.type: unknown optimizer type 'Adamm'; accepted: Adam, AdamW, SGD" in msg


def test_optimizer_betas_must_be_a_pair() -> None:
    msg = str(error_of({**stage3(), "optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}))
    assert "optimizer.params.betas: expected a list of 2 numbers" in msg


def test_sgd_nesterov_needs_momentum() -> None:
    msg = str(error_of({**stage3(), "optimizer": {"type": "SGD", "params": {"nesterov": True}}}))
    assert "optimizer.params.nesterov: nesterov needs momentum > 0" in msg


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("params", [{"warmup_num_steps": 10}, None])
def test_scheduler_missing_required_param(kind: str, params: dict | None) -> None:
    section = {"type": kind} if params is None else {"type": kind, "params": params}
    msg = str(error_of({**stage3(), "scheduler": section}))
    assert msg.startswith("scheduler.params.total_num_steps: required key is missing")


def test_scheduler_bad_warmup_type_and_unknown_type() -> None:
    msg = str(error_of({**stage3(), "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}}))
    assert "scheduler.params.warmup_type: got \"cos\"; accepted: 'log' or 'linear'" in msg
    msg = str(error_of({**stage3(), "scheduler": {"type": "Cosine"}}))
    assert "scheduler.type: unknown scheduler type 'Cosine'; accepted: WarmupLR" in msg


@pytest.mark.parametrize("zero, path", [
    ({"zero_hpz_partition_size": 0}, "zero_optimization.zero_hpz_partition_size: got 0"),
    ({"quantization_block_size": 7}, "zero_optimization.quantization_block_size: got 7"),
    ({"quantization_block_size": 0}, "zero_optimization.quantization_block_size: got 0"),
    ({"zero_quantized_weights_bits": 6}, "zero_optimization.zero_quantized_weights_bits: got 6"),
    ({"zero_quantized_gradients_bits": 3}, "zero_optimization.zero_quantized_gradients_bits: got 3"),
    ({"zero_quantized_gradients_bits": 1}, "zero_optimization.zero_quantized_gradients_bits: got 1 bit: "
     "symmetric block quantization has no 1-bit code"),
    ({"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 1.0}},
     "zero_optimization.zeropp_loco_param.err_beta: got 1.0"),
    ({"zero_quantized_gradients": True, "zeropp_loco_param": {"reset_T": 0}},
     "zero_optimization.zeropp_loco_param.reset_T: got 0"),
    ({"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "beta": 1}},
     "zero_optimization.zeropp_loco_param.beta"),
    ({"zeropp_loco_param": {"err_beta": 0.8}}, "zero_optimization.zeropp_loco_param: error feedback corrects "
     "qgZ's quantization, and zero_quantized_gradients is false"),
    ({"offload_optimizer": {"device": "gpu"}}, "zero_optimization.offload_optimizer.device: got \"gpu\""),
    ({"reduce_bucket_size": -5}, "zero_optimization.reduce_bucket_size: got -5; accepted: an integer >= 0"),
])
def test_out_of_range_values(zero: dict, path: str) -> None:
    assert path in str(error_of(stage3(**zero)))


def test_loco_takes_deepspeeds_keys_and_defaults() -> None:
    zero = load_config(stage3(zero_quantized_gradients=True, zero_quantized_gradients_bits=2,
                              zeropp_loco_param={"err_beta": 0.5, "reset_T": 10})).zero_optimization
    assert (zero.zero_quantized_gradients_bits, zero.zeropp_loco_param.err_beta, zero.zeropp_loco_param.reset_T) == (
        2, 0.5, 10)
    defaults = load_config(stage3(zero_quantized_gradients=True, zeropp_loco_param={})).zero_optimization
    assert (defaults.zeropp_loco_param.err_beta, defaults.zeropp_loco_param.reset_T) == (0.8, 1024)


def test_section_of_wrong_kind() -> None:
    assert "zero_optimization: expected an object, got 5" in str(error_of({"zero_optimization": 5}))


def test_bf16_and_fp16_together_is_a_plain_config_error() -> None:
    err = error_of({**stage3(), "bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert not isinstance(err, NotSupportedError)
    assert "fp16.enabled: bf16.enabled and fp16.enabled are both true" in str(err)


# ------------------------------------------------------------------------------------ not supported yet
@pytest.mark.parametrize("raw, path", [
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, **stage3()},
     "fp16.fp16_master_weights_and_grads"),
    ({"optimizer": {"type": "lamb", "params": {"lr": 1}}, **stage3()}, "optimizer.type"),
    ({"tensor_parallel": {"autotp_size": 2}, **stage3()}, "tensor_parallel.autotp_size"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False, "amsgrad": True}}, **stage3()},
     "optimizer.params.amsgrad"),
    ({"optimizer": {"type": "AdamW", "params": {"maximize": True}},
      **stage3(offload_optimizer={"device": "cpu"})}, "optimizer.params.maximize"),
    ({"aio": {"use_gds": True}, **stage3()}, "aio.use_gds"),
])
def test_not_supported_yet(raw: dict, path: str) -> None:
    err = error_of(raw)
    assert isinstance(err, NotSupportedError)
    assert str(err).startswith(f"{path}: not supported yet")
    parse_config(raw)  # the schema itself accepts it: only check_supported objects


def test_not_supported_lists_every_hit() -> None:
    err = error_of({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, "aio": {"use_gds": True},
                    "zero_optimization": {"stage": 2, "zero_quantized_weights": True}})
    assert isinstance(err, NotSupportedError) and len(err.problems) == 3
    assert "zero_optimization.zero_quantized_weights: needs zero_optimization.stage 3 (got stage 2)" in str(err)


def test_reduction_settings_deepspeed_has_load_and_qgz_without_reduce_scatter_is_refused() -> None:
    cfg = load_config({"gradient_allreduce_op": "sum", "gradient_predivide_factor": 2.0, "prescale_gradients": True,
                       **stage3(reduce_scatter=False)})
    assert cfg.gradient_allreduce_op == "sum" and not cfg.zero_optimization.reduce_scatter
    err = error_of(stage3(reduce_scatter=False, zero_quantized_gradients=True))
    assert isinstance(err, NotSupportedError) and "reduce_scatter: false cannot go with zero_quantized_gradients" \
        in str(err)
    assert "accepted: 'mean' or 'sum'" in str(error_of({"gradient_allreduce_op": "max"}))


def test_an_odd_allgather_bucket_size_is_refused_as_deepspeed_refuses_it() -> None:
    assert "allgather_bucket_size: must be a multiple of 2" in str(error_of(stage3(allgather_bucket_size=5e8 + 1)))
    assert load_config(stage3(allgather_bucket_size=2e8)).zero_optimization.allgather_bucket_size == 200_000_000


def test_nvme_offload_loads_with_its_settings() -> None:
    cfg = load_config(stage3(offload_optimizer={"device": "nvme", "nvme_path": "/x", "buffer_count": 2},
                             offload_param={"device": "nvme", "nvme_path": "/y", "buffer_size": 1000}))
    assert cfg.zero_optimization.offload_optimizer.buffer_count == 2
    assert cfg.zero_optimization.offload_param.buffer_size == 1000
    load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})


@pytest.mark.parametrize("raw, line", [
    (stage3(offload_optimizer={"device": "nvme"}),
     "zero_optimization.offload_optimizer.nvme_path: required when device is \"nvme\""),
    (stage3(offload_param={"device": "nvme"}),
     "zero_optimization.offload_param.nvme_path: required when device is \"nvme\""),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device: needs zero_optimization.stage 3 (got stage 2)"),
    (stage3(zero_hpz_partition_size=2, offload_param={"device": "nvme", "nvme_path": "/x"}),
     "zero_optimization.zero_hpz_partition_size: not supported with offload_param"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
     "zero_optimization.offload_optimizer.device: \"nvme\" needs zero_optimization.stage 1, 2 or 3"),
    (stage3(offload_optimizer={"device": "nvme", "nvme_path": "/x", "delayed_update": True}),
     "zero_optimization.offload_optimizer.delayed_update: not supported with device \"nvme\""),
    (stage3(offload_optimizer={"device": "cpu", "delayed_update": True},
            offload_param={"device": "nvme", "nvme_path": "/x"}),
     "zero_optimization.offload_optimizer.delayed_update: not supported with offload_param device \"nvme\""),
    (stage3(offload_param={"device": "nvme", "nvme_path": "/x", "buffer_count": 1}),
     "zero_optimization.offload_param.buffer_count: at least 2 with device \"nvme\""),
    (stage3(zero_quantized_nontrainable_weights=True, offload_param={"device": "cpu"}),
     "zero_optimization.zero_quantized_nontrainable_weights: not supported with offload_param"),
    (stage3(zero_quantized_nontrainable_weights=True, offload_optimizer={"device": "nvme", "nvme_path": "/x"}),
     "zero_optimization.zero_quantized_nontrainable_weights: not supported with offload_optimizer device"),
])
def test_offload_settings_that_cannot_work_together_name_the_key(raw: dict, line: str) -> None:
    err = error_of(raw)
    assert isinstance(err, NotSupportedError)
    assert line in str(err)


def test_offload_buffer_count_must_be_positive() -> None:
    msg = str(error_of(stage3(offload_param={"device": "nvme", "nvme_path": "/x", "buffer_count": 0})))
    assert "zero_optimization.offload_param.buffer_count" in msg


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_and_fp16_load(stage: int) -> None:
    cfg = load_config({"zero_optimization": {"stage": stage}, "fp16": {"enabled": True}})
    assert cfg.zero_optimization.stage == stage and cfg.fp16.enabled
    assert load_config({}).zero_optimization.stage == 0  # DeepSpeed's default


@pytest.mark.parametrize("key, value", [("zero_quantized_weights", True), ("zero_hpz_partition_size", 2),
                                        ("zero_quantized_gradients", True),
                                        ("zero_quantized_nontrainable_weights", True)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zeropp_switches_need_stage_3(stage: int, key: str, value: object) -> None:
    err = error_of({"zero_optimization": {"stage": stage, key: value}})
    assert isinstance(err, NotSupportedError)
    assert f"zero_optimization.{key}: needs zero_optimization.stage 3 (got stage {stage})" in str(err)


def test_check_supported_is_separate_from_the_schema() -> None:
    cfg = ZeroppConfig(zero_optimization=ZeroConfig(stage=2, zero_quantized_gradients=True))
    with pytest.raises(NotSupportedError, match="zero_optimization.zero_quantized_gradients"):
        check_supported(cfg)
    with pytest.raises(NotSupportedError):
        load_config(cfg)
    ok = ZeroppConfig(zero_optimization=ZeroConfig(stage=3))
    check_supported(ok)
    assert load_config(ok) is ok


def _schema_has(path: str) -> bool:
    """Whether dotted `path` names a field of ZeroppConfig (through any optimizer/scheduler variant)."""
    models: list[type[BaseModel]] = [ZeroppConfig]
    for part in path.split("."):
        nxt: list[type[BaseModel]] = []
        found = False
        for model in models:
            field = model.model_fields.get(part)
            if field is None:
                continue
            found = True
            nxt += _models_in(field.annotation)
        if not found:
            return False
        models = nxt
    return True


def _models_in(annotation: object) -> list[type[BaseModel]]:
    import typing
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def test_not_supported_table_paths_exist_in_the_schema() -> None:
    assert len(NOT_SUPPORTED) >= 4
    for row in NOT_SUPPORTED:
        assert _schema_has(row.path), row.path


# ----------------------------------------------------------------------------------------------- files
def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*file not found"):
        load_config(path)


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "zero_optimization": {\n    "stage": [3,\n  }\n}\n')  # a list closed by "}"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "invalid JSON at line 4" in str(info.value)


def test_duplicate_json_key_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"zero_optimization": {"stage": 3, "stage": 2}}')
    with pytest.raises(ConfigError, match="duplicate key 'stage'"):
        load_config(path)


def test_schema_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stag": 1}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert str(info.value).startswith(f"config file {str(path)!r}: zero_optimization.stag: unknown key")


def test_top_level_must_be_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level is a list"):
        load_config(path)
    with pytest.raises(ConfigError, match="accepted: a JSON file path, a dict or a ZeroppConfig"):
        load_config(42)  # type: ignore[arg-type]


def test_error_types() -> None:
    assert issubclass(ConfigError, ValueError) and issubclass(NotSupportedError, ConfigError)


# ------------------------------------------------------------------------------------------ batch sizes
def batch_cfg(**keys: int) -> ZeroppConfig:
    return load_config({**stage3(), **keys})


@pytest.mark.parametrize("keys, world, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4,
     (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 4, (16, 4, 1)),
    ({"train_batch_size": 5e1, "train_micro_batch_size_per_gpu": 5}, 1, (50, 5, 10)),
])
def test_resolve_batch_derives_missing_values(keys: dict, world: int, expected: tuple) -> None:
    plan = batch_cfg(**keys).resolve_batch(world)
    assert plan == BatchPlan(*expected)
    assert plan.train_batch_size == plan.micro_batch_per_rank * plan.gradient_accumulation_steps * world


@pytest.mark.parametrize("keys, world", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 4),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 4),
    ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 4),
    ({"train_batch_size": 2}, 4),
])
def test_resolve_batch_inconsistent(keys: dict, world: int) -> None:
    with pytest.raises(ConfigError) as info:
        batch_cfg(**keys).resolve_batch(world)
    msg = str(info.value)
    assert "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps" in msg
    assert f"world size {world}" in msg and f"train_batch_size={keys['train_batch_size']}" in msg


@pytest.mark.parametrize("keys", [{}, {"gradient_accumulation_steps": 2}])
def test_resolve_batch_needs_a_batch_size(keys: dict) -> None:
    with pytest.raises(ConfigError, match="train_batch_size"):
        batch_cfg(**keys).resolve_batch(2)


def test_resolve_batch_rejects_bad_world_size() -> None:
    with pytest.raises(ValueError):
        batch_cfg(train_batch_size=8).resolve_batch(0)


def test_batch_keys_must_be_positive() -> None:
    msg = str(error_of({**stage3(), "train_batch_size": 0}))
    assert "train_batch_size: got 0; accepted: an integer >= 1" in msg


# ---------------------------------------------------------------------------------------------- docs
def _all_sections() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    todo: list[type[BaseModel]] = [ZeroppConfig, *UNION_TAGS.values()]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            todo += _models_in(field.annotation)
    return seen


def test_every_accepted_key_is_documented_with_description_and_status() -> None:
    docs = DOCS.read_text()
    for model in _all_sections():
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            assert (field.json_schema_extra or {}).get("status"), f"{model.__name__}.{name} has no status"
            assert f"`{name}`" in docs, f"{model.__name__}.{name} is not in docs/config.md"


def test_json_dump_round_trips() -> None:
    cfg = load_config({**TUTORIAL, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5}}})
    assert load_config(json.loads(json.dumps(cfg.model_dump(mode="json")))) == cfg


def test_grad_accum_dtype_loads_when_it_names_the_training_dtype_and_is_refused_otherwise() -> None:
    assert load_config({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}) \
        .data_types.grad_accum_dtype == "bf16"
    assert load_config({"data_types": {"grad_accum_dtype": "fp32"}}).data_types.grad_accum_dtype == "fp32"
    msg = str(error_of({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}))
    assert "data_types.grad_accum_dtype: not supported yet: 'fp32'" in msg and "accepted: null or 'bf16'" in msg
