"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` (a config read as DeepSpeed's engine keeps it), its error type
``DeepSpeedConfigError`` and DeepSpeed's optimizer-name constants.

The config is validated by zeropp's own reader (``zeropp.config``: DeepSpeed's key names, deprecated spellings,
Hjson files), so a config zeropp refuses is refused here too. Its errors are :class:`DeepSpeedConfigError`, which is
also zeropp's :class:`~zeropp.config.ConfigError` (a ``ValueError``): a script catching either catches them. The
attributes carry DeepSpeed's names (``train_micro_batch_size_per_gpu``, ``zero_optimization_stage``,
``checkpoint_tag_validation_fail``, ...); the batch sizes are completed and checked by DeepSpeed's own rules
(``_configure_train_batch_size``: any two give the third, an inconsistent triple is an ``AssertionError``).
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Optional, Union

import torch.distributed as dist
from pydantic import BaseModel

from zeropp.config.loader import ZeroppConfig, load_config, read_json
from zeropp.deepspeed.missing import DeepSpeedAPIError
from zeropp.deepspeed.runtime.config_utils import DeepSpeedConfigError, decoded_config, deepspeed_config_errors
from zeropp.deepspeed.runtime.zero.config import DeepSpeedZeroConfig

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "deepspeed_config_errors", "DEEPSPEED_OPTIMIZERS",
           "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAGRAD_OPTIMIZER", "LAMB_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER",
           "ZERO_ONE_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER", "MUADAM_OPTIMIZER", "MUADAMW_OPTIMIZER",
           "MUSGD_OPTIMIZER", "LION_OPTIMIZER", "MUON_OPTIMIZER", "TORCH_ADAM_PARAM", "ADAM_W_MODE",
           "ADAM_W_MODE_DEFAULT"]

# DeepSpeed's optimizer names (deepspeed/runtime/config.py), which scripts and its tests put in configs
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
                        ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER,
                        MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True


def _params(section: Any) -> Optional[dict]:
    """The ``params`` of an optimizer or scheduler section as a dict (defaults filled in), None without a section."""
    if section is None:
        return None
    params = section.params
    return params.model_dump() if isinstance(params, BaseModel) else dict(params)


def _world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one, as DeepSpeed's config falls back."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DeepSpeedConfig:
    """A config (a dict, a JSON or Hjson file path, or a base64-encoded JSON string) as DeepSpeed's engine reads it.

    ``mpu`` and ``mesh_device`` (model and sequence parallelism) are refused by name. Raises
    :class:`DeepSpeedConfigError` for an invalid config and ``AssertionError`` for batch sizes that do not fit the
    world (DeepSpeed's types).
    """

    def __init__(self, config: Union[str, os.PathLike, dict], mpu: Any = None, mesh_device: Any = None) -> None:
        if mpu is not None or mesh_device is not None:
            raise DeepSpeedAPIError("DeepSpeedConfig(mpu=..., mesh_device=...): model and sequence parallelism are "
                                    "not implemented by zeropp; zeropp partitions over data-parallel ranks only")
        config = decoded_config(os.fspath(config) if isinstance(config, os.PathLike) else config)
        with deepspeed_config_errors():
            self.zeropp_config: ZeroppConfig = load_config(config)
        self._param_dict: dict = config if isinstance(config, dict) else read_json(config)
        self.global_rank, self.world_size = _world()
        self._initialize_params(self.zeropp_config)
        self._configure_train_batch_size()
        self._do_error_check()

    def _initialize_params(self, cfg: ZeroppConfig) -> None:
        """DeepSpeed's attributes, read from the validated config."""
        self.train_batch_size: Optional[int] = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu: Optional[int] = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps: Optional[int] = cfg.gradient_accumulation_steps
        self.steps_per_print = cfg.steps_per_print
        self.wall_clock_breakdown = cfg.wall_clock_breakdown
        self.prescale_gradients = cfg.prescale_gradients
        self.gradient_predivide_factor = cfg.gradient_predivide_factor
        self.gradient_allreduce_op = cfg.gradient_allreduce_op
        self.gradient_clipping = cfg.gradient_clipping
        self.zero_config = DeepSpeedZeroConfig.of(cfg.zero_optimization)
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.float16_config = cfg.fp16
        self.bfloat16_config = cfg.bf16
        self.fp16_enabled = cfg.fp16.enabled
        self.bfloat16_enabled = cfg.bf16.enabled
        self.activation_checkpointing_config = cfg.activation_checkpointing
        opt, sched = cfg.optimizer, cfg.scheduler
        name = opt.type if opt is not None else None
        self.optimizer_name = name.lower() if name is not None and name.lower() in DEEPSPEED_OPTIMIZERS else name
        self.optimizer_params = _params(opt)
        self.scheduler_name = sched.type if sched is not None else None
        self.scheduler_params = _params(sched)
        self.zero_allow_untested_optimizer = cfg.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = cfg.zero_force_ds_cpu_optimizer
        self.grad_accum_dtype = cfg.data_types.grad_accum_dtype
        ckpt = cfg.checkpoint
        self.checkpoint_tag_validation_enabled = ckpt.tag_validation != "Ignore"
        self.checkpoint_tag_validation_fail = ckpt.tag_validation == "Fail"
        self.load_universal_checkpoint = ckpt.load_universal
        self.use_node_local_storage = ckpt.use_node_local_storage
        self.checkpoint_parallel_write_pipeline = ckpt.parallel_write.pipeline_stage
        # DeepSpeed features zeropp refuses when switched on: here always off
        self.elasticity_enabled = self.amp_enabled = self.pld_enabled = self.eigenvalue_enabled = False
        self.sparse_gradients_enabled = self.curriculum_enabled_legacy = self.data_efficiency_enabled = False

    def _set_batch_related_parameters(self) -> None:
        """DeepSpeed's completion of the batch sizes: two of them give the third, one alone takes an accumulation
        of 1; none of train and micro is an AssertionError."""
        train, micro, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        world = self.world_size
        if train is not None and micro is not None and gas is not None:
            return
        if train is not None and micro is not None:
            self.gradient_accumulation_steps = train // micro // world
        elif train is not None and gas is not None:
            self.train_micro_batch_size_per_gpu = train // world // gas
        elif micro is not None and gas is not None:
            self.train_batch_size = micro * gas * world
        elif train is not None:
            self.gradient_accumulation_steps = 1
            self.train_micro_batch_size_per_gpu = train // world
        elif micro is not None:
            self.train_batch_size = micro * world
            self.gradient_accumulation_steps = 1
        else:
            raise AssertionError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")

    def _batch_assertion(self) -> None:
        train, micro, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        assert train > 0, f"Train batch size: {train} has to be greater than 0"
        assert micro > 0, f"Micro batch size per gpu: {micro} has to be greater than 0"
        assert gas > 0, f"Gradient accumulation steps: {gas} has to be greater than 0"
        assert train == micro * gas * self.world_size, (
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {train} != {micro} * {gas} * {self.world_size}")

    def _configure_train_batch_size(self) -> None:
        """Complete the batch sizes and check them (DeepSpeed's method; scripts set the three and call it)."""
        self._set_batch_related_parameters()
        self._batch_assertion()

    def _do_error_check(self) -> None:
        assert self.train_micro_batch_size_per_gpu, "DeepSpeedConfig: train_micro_batch_size_per_gpu is not defined"
        assert self.gradient_accumulation_steps, "DeepSpeedConfig: gradient_accumulation_steps is not defined"

    def print_user_config(self) -> None:
        """Log the config as given (DeepSpeed's), on the ``deepspeed`` logger."""
        from zeropp.deepspeed.utils import logger
        logger.info("  json = %s", json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def print(self, name: str) -> None:
        """Log every attribute and the config as given (DeepSpeed's)."""
        from zeropp.deepspeed.utils import logger
        logger.info("%s:", name)
        for arg in sorted(vars(self)):
            if arg not in ("_param_dict", "zeropp_config"):
                logger.info("  %s %s %s", arg, "." * (29 - len(arg)), getattr(self, arg))
        self.print_user_config()

    def __deepcopy__(self, memo: dict) -> "DeepSpeedConfig":
        new = object.__new__(DeepSpeedConfig)
        memo[id(self)] = new
        for key, value in vars(self).items():
            setattr(new, key, value if key == "zeropp_config" else copy.deepcopy(value, memo))
        return new
