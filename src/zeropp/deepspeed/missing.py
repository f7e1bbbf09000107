"""The one table of DeepSpeed names zeropp does not provide (yet), and the error that names them.

A script that reaches one gets :class:`DeepSpeedAPIError` saying which name it was, instead of a bare
``AttributeError`` deep inside it. Adding a DeepSpeed name means building it at its DeepSpeed path in this
package and taking it out of this table.
"""
from __future__ import annotations

from typing import Any, Callable

from zeropp.errors import NotBuiltError


class DeepSpeedAPIError(NotBuiltError):
    """A DeepSpeed API that zeropp does not implement yet (the message names it). A kind of zeropp's own
    :class:`~zeropp.errors.NotBuiltError`, so one ``except`` catches both."""

MISSING: dict[str, frozenset[str]] = {
    # deepspeed.<name>
    "deepspeed": frozenset({
        "init_inference", "PipelineModule", "pipe", "moe", "profiling", "compression", "inference", "module_inject",
        "monitor", "elasticity", "autotuning", "sequence", "linear", "tp_model_init",
        "InferenceEngine", "is_compile_supported",
    }),
    # engine.<name> on what deepspeed.initialize returns
    "engine": frozenset({
        "set_train_batch_size", "set_train_micro_batch_size",
        "get_mom", "get_pld_theta", "monitor", "flops_profiler", "curriculum_learning_enabled",
        "random_ltd_enabled", "compression_scheduler", "pipeline_parallelism", "eigenvalue_enabled",
        "sparse_gradients_enabled", "data_efficiency_enabled", "offload_states", "reload_states",
        "set_data_post_process_func",
        "set_custom_curriculum_learning_schedule", "get_sequence_parallel_group", "module_state_dict",
        "load_module_state_dict", "get_data_types", "optimizer_name", "timers",
        "training_dataloader", "dataloader_drop_last", "client_optimizer",
        "basic_optimizer", "autotuning_enabled", "progressive_layer_drop", "data_parallel_group",
        "seq_parallel_group", "client_lr_scheduler", "quantize_training", "zero_quantized_nontrainable_weights",
    }),
    # engine.optimizer.<name>: the ZeRO optimizer's attributes (runtime/zero/zero_optimizer.py's view)
    "optimizer": frozenset({
        "load_state_dict", "backward", "loss_scaler", "dynamic_loss_scale", "clip_grad", "partition_count",
        "dp_process_group", "real_dp_process_group", "overlap_comm", "contiguous_gradients", "reduce_bucket_size",
        "allgather_bucket_size", "cpu_offload", "offload_optimizer", "offload_param", "refresh_fp32_params",
        "empty_partition_cache", "fp16_partitioned_groups_flat", "params_in_partition", "sub_group_size",
        "micro_step_id", "gradient_accumulation_steps", "get_grad_norm_direct", "has_overflow", "check_overflow",
        "scale_if_loss", "get_lr", "is_gradient_accumulation_boundary", "reduce_gradients",
        "initialize_optimizer_states", "_restore_from_bit16_weights", "get_full_hp_param",
        "save_checkpoint_prologue", "save_checkpoint_epilogue", "update_lp_params", "round_robin_bit16_groups",
        "custom_loss_scaler", "external_loss_scale",
    }),
    # deepspeed.ops.adam.<name>
    "deepspeed.ops.adam": frozenset({"FusedAdam", "ZenFlowCPUAdam"}),
    # deepspeed.checkpointing.<name>: Megatron-style model parallelism's helpers
    "deepspeed.checkpointing": frozenset({
        "model_parallel_cuda_manual_seed", "get_cuda_rng_tracker", "CheckpointFunction",
        "partition_activations_in_checkpoint", "set_num_layers",
    }),
    # deepspeed.checkpoint.<name>: DeepSpeed's checkpoint readers and reshapers (universal checkpoints are built:
    # checkpoint/ds_to_universal.py, checkpoint/universal_io.py)
    "deepspeed.checkpoint": frozenset({
        "DeepSpeedCheckpoint", "ZeROCheckpoint", "enable_universal_checkpoint", "SubparamShape",
        "reshape_meg_2d_parallel", "merge_state", "model_3d_desc", "get_model_3d_descriptor",
        "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank",
    }),
}

_WHERE = {"engine": "engine.{}", "optimizer": "ZeRO optimizer attribute {!r}"}


def is_missing(where: str, name: str) -> bool:
    """Whether ``name`` is a DeepSpeed name under ``where`` (a key of :data:`MISSING`) that zeropp lacks."""
    return name in MISSING[where]


def module_getattr(where: str, module: str = "") -> Callable[[str], Any]:
    """The module-level ``__getattr__`` of a module that serves DeepSpeed's module ``where`` (``module``: its
    own name, when not that one): a DeepSpeed name it lacks raises :class:`DeepSpeedAPIError` naming it, any
    other name an ``AttributeError``."""
    shown = f"'{module}'" if module else f"'{where}' (zeropp's DeepSpeed API)"

    def __getattr__(name: str) -> Any:
        if is_missing(where, name):
            raise missing(where, name)
        raise AttributeError(f"module {shown} has no attribute {name!r}")
    return __getattr__


def missing(where: str, name: str, more: str = "") -> DeepSpeedAPIError:
    """The error for DeepSpeed's ``name`` under ``where``, which zeropp does not provide."""
    what = _WHERE.get(where, where + ".{}").format(name)
    return DeepSpeedAPIError(f"DeepSpeed's {what} is not implemented by zeropp yet" + (f"; {more}" if more else ""))
