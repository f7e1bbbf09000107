"""DeepSpeed's engine accessors, in one place: what training scripts call on the object ``initialize``
returns (``engine.train_batch_size()``, ``engine.local_rank``, ``engine.get_lr()``, ...).

They read the engine's own state and config; nothing here changes what the engine does. A DeepSpeed engine
method that zeropp lacks raises :class:`DeepSpeedAPIError` naming it, instead of a bare AttributeError.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Optional

import torch
from torch import nn

from zeropp.zero import compiled as compiled_regions
from zeropp.zero.timing import WARM_UP_STEPS

# DeepSpeedEngine methods and attributes that training code calls and zeropp does not provide (yet)
MISSING_ENGINE_API = frozenset({
    "set_train_batch_size", "set_train_micro_batch_size",
    "get_mom", "get_pld_theta", "monitor", "flops_profiler", "curriculum_learning_enabled",
    "random_ltd_enabled", "compression_scheduler", "pipeline_parallelism", "eigenvalue_enabled",
    "sparse_gradients_enabled", "data_efficiency_enabled", "offload_states", "reload_states",
    "no_sync", "set_data_post_process_func",
    "set_custom_curriculum_learning_schedule", "get_sequence_parallel_group", "module_state_dict",
    "load_module_state_dict", "get_data_types", "optimizer_name", "timers",
    "training_dataloader", "dataloader_drop_last", "checkpoint_tag_validation_enabled", "client_optimizer",
    "basic_optimizer", "autotuning_enabled", "progressive_layer_drop", "data_parallel_group", "seq_parallel_group",
    "client_lr_scheduler", "quantize_training", "zero_quantized_nontrainable_weights",
})


class DeepSpeedAPIError(NotImplementedError):
    """A DeepSpeed API that zeropp does not implement yet (the message names it)."""


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``. Read without calling it, it is a view of the engine's own step timing
    (``zero/timing.py``): samples per second over the steps after the first two (``start_step``), as DeepSpeed
    counts them. A script that calls ``start()``/``stop()`` itself drives it as DeepSpeed's stopwatch: from the
    first ``start()`` its counts and times are those of the script's calls (starting from the engine's counts
    then), with DeepSpeed's rules (times from the ``start_step``-th global step on, ``step_elapsed_time`` summed
    over a step's micro-steps). It logs nothing: the engine's time report does (``wall_clock_breakdown``)."""

    start_step = WARM_UP_STEPS

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._driven = False  # the script called start(): the counters below are the truth
        self.initialized = self.started = False
        self.start_time = self.end_time = 0.0
        self.epoch_count = 0
        self._micro = self._global = 0
        self._total = self._step = 0.0

    @property
    def batch_size(self) -> int:
        return self._engine.train_batch_size()

    @property
    def micro_step_count(self) -> int:
        return self._micro if self._driven else self._engine.micro_steps

    @property
    def global_step_count(self) -> int:
        return self._global if self._driven else self._engine.global_steps

    @property
    def total_elapsed_time(self) -> float:
        """Seconds of the steps counted (after the first ``start_step``)."""
        return self._total if self._driven else self._engine.timer.warm_seconds

    @property
    def step_elapsed_time(self) -> float:
        """Seconds of the last step (driven: of the global step under way)."""
        return self._step if self._driven else float(self._engine.timer.report().get("step_s", 0.0))

    def avg_samples_per_sec(self) -> float:
        """Global samples per second over the counted steps; ``-inf`` before any, as in DeepSpeed."""
        if self._driven:
            counted = self._global - self.start_step
            if self._global <= 0 or counted <= 0 or self._total <= 0:
                return float("-inf")
            return self.batch_size * counted / self._total
        timer = self._engine.timer
        if timer.warm_steps == 0 or timer.warm_seconds <= 0:
            return float("-inf")
        return self.batch_size * timer.warm_steps / timer.warm_seconds

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self._micro = 0

    def start(self) -> None:
        if not self._driven:  # from here on the script's calls count, from where the engine's counts are
            self._micro, self._global = self.micro_step_count, self.global_step_count
            self._total, self._driven = self.total_elapsed_time, True
        self.initialized = self.started = True
        if self._global >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self._micro += 1
        if global_step:
            self._global += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self._total += duration
            self._step += duration
            if global_step:
                self._step = 0.0


class DeepSpeedSurface:
    """Mixed into :class:`~zeropp.zero.engine.ZeroEngine`: DeepSpeed's accessor names over its state."""

    # provided by the engine
    topo: Any
    config: Any
    policy: Any
    master_optimizer: torch.optim.Optimizer
    module: torch.nn.Module
    global_steps: int
    loss_scaler: Any
    reduce_bucket_size: int
    _step_applied: bool

    @property
    def tput_timer(self) -> ThroughputTimer:
        """DeepSpeed's throughput timer, over this engine's step times (one per engine: a script may drive it)."""
        timer = self.__dict__.get("_tput_timer")
        if timer is None:
            timer = self.__dict__["_tput_timer"] = ThroughputTimer(self)
        return timer

    @property
    def local_rank(self) -> int:
        """This process's index on its node (torchrun's ``LOCAL_RANK``)."""
        return int(os.environ.get("LOCAL_RANK", self.topo.local_rank))

    @property
    def global_rank(self) -> int:
        return self.topo.rank

    @property
    def world_size(self) -> int:
        return self.topo.world_size

    @property
    def device(self) -> torch.device:
        """Where the model computes (its first parameter's device; the host for a model without any)."""
        units = getattr(self, "units", [])
        return units[0].device if units else torch.device("cpu")

    def _batch(self) -> Any:
        return self.config.resolve_batch(self.topo.world_size)

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks and accumulation steps."""
        return self._batch().train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch().micro_batch_per_rank

    def gradient_accumulation_steps(self) -> int:
        return self.policy.gradient_accumulation_steps

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer parameter group."""
        return [group["lr"] for group in self.master_optimizer.param_groups]

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train batch size, micro-batch per rank, gradient accumulation steps)."""
        b = self._batch()
        return b.train_batch_size, b.micro_batch_per_rank, self.policy.gradient_accumulation_steps

    @property
    def global_samples(self) -> int:
        """Samples trained on over all ranks: optimizer steps times the train batch size."""
        return self.global_steps * self.train_batch_size()

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights: False off an accumulation boundary and when the step
        was skipped (a non-finite gradient, fp16's overflow)."""
        return self._step_applied

    @property
    def dp_world_size(self) -> int:
        """Ranks in data parallel: the world (zeropp has no model or pipeline parallel dimension)."""
        return self.topo.world_size

    @property
    def mp_world_size(self) -> int:
        return 1  # no model parallelism

    mpu = None  # DeepSpeed's model-parallel unit: none

    def gradient_clipping(self) -> float:
        return self.policy.gradient_clipping

    def gradient_predivide_factor(self) -> float:
        return self.policy.grad_predivide

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def dynamic_loss_scale(self) -> bool:
        """fp16 with a dynamic loss scale (``fp16.loss_scale`` 0)."""
        return self.loss_scaler is not None and self.config.fp16.loss_scale == 0

    def amp_enabled(self) -> bool:
        return False  # Apex AMP: the config refuses it

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the compute dtype (qgZ puts int4 on the wire within it)."""
        return self.policy.compute_dtype

    def zero_optimization_partition_gradients(self) -> bool:
        return self.policy.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.policy.stage >= 3

    def zero_offload_optimizer(self) -> bool:
        return bool(self.policy.offload_optimizer)

    def zero_offload_param(self) -> bool:
        return bool(self.policy.offload_param)

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer runs on the host (``offload_optimizer.device`` "cpu")."""
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device == "cpu"

    def zero_reduce_bucket_size(self) -> int:
        """The reduce bucket size in use (sized from the model when the config leaves it out: Note [bucket size])."""
        return self.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero_optimization.allgather_bucket_size

    def zero_overlap_comm(self) -> bool:
        return True  # zeropp always overlaps communication with compute

    def zero_optimization_stage(self) -> int:
        return self.policy.stage

    def zero_optimization(self) -> bool:
        return self.policy.stage > 0

    def bfloat16_enabled(self) -> bool:
        return self.policy.compute_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.policy.compute_dtype == torch.float16

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: ``save_16bit_model`` (``checkpoint.CheckpointingEngine``) always gathers the full 16-bit weights."""
        return True

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """DeepSpeed's: make the next ``step()`` calls step the optimizer (True) or only accumulate (False)
        whatever the micro-step count says, until called with None. An epoch's last, shorter window is the use
        (transformers' Trainer, accelerate); the engine then counts that window as a whole one."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary: True, False or None, got {is_boundary!r}")
        self._boundary_override = is_boundary  # type: ignore[attr-defined]

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: free the weights still gathered between steps (persistent units); they are gathered again
        at their next use."""
        self.free_gathered()  # type: ignore[attr-defined]

    def allreduce_gradients(self, bucket_size: Any = None) -> None:
        """DeepSpeed's: finish reducing the last backward's gradients. zeropp reduces them inside ``backward`` at
        stages 2-3 and at the accumulation boundary's ``step()`` at stages 0-1 (where DeepSpeed's engine reduces
        them too), so this only closes a backward still open; ``bucket_size`` is DeepSpeed's and unused."""
        if self._backward_open:  # type: ignore[attr-defined]
            self._finish_backward()  # type: ignore[attr-defined]

    def save_fp16_model(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's older name of ``save_16bit_model``."""
        return self.save_16bit_model(*args, **kwargs)  # type: ignore[attr-defined]

    def destroy(self) -> None:
        """DeepSpeed's name for releasing the engine and its hold on the model (``unpartition``: the model is
        left whole, ready for another ``initialize``)."""
        self.unpartition()  # type: ignore[attr-defined]

    def compile(self, backend: Any = "inductor", compile_kwargs: Optional[dict[str, Any]] = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` of the model in place, one region per block (else the
        whole model), with ``backend`` and the other ``compile_kwargs``; a second call does nothing. The first
        optimizer step runs eagerly, then compiled (Note [compiled regions] in ``zero/compiled.py``)."""
        if schedule is not None:
            raise DeepSpeedAPIError("engine.compile(schedule=...): a DeepCompile pass schedule; zeropp has no "
                                    "DeepCompile yet: leave schedule out")
        if compiled_autograd_enabled:
            raise DeepSpeedAPIError("engine.compile(compiled_autograd_enabled=True): compiled autograd is not "
                                    "supported yet: leave it False (backward runs the compiled regions' graphs)")
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:  # DeepSpeed warns and uses the argument too
            warnings.warn("engine.compile: the backend in compile_kwargs is overridden by the backend argument",
                          stacklevel=2)
            del kwargs["backend"]
        compiled_regions.compile_model(self.module, backend, kwargs)  # type: ignore[attr-defined]

    @property
    def is_compiled(self) -> bool:
        """Whether the model, or parts of it, run compiled (``engine.compile``, ``module.compile()``, or a
        model compiled whole before ``initialize``)."""
        return (self.__dict__.get("_compiled_call") is not None
                or compiled_regions.compiled_parts(self.module))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        """An ``nn.Module``'s parameters, buffers and children first, then, as DeepSpeed's engine does, the
        model's attributes (a method the user defined on the model); a DeepSpeed name zeropp lacks is an error
        that names it."""
        try:
            return nn.Module.__getattr__(self, name)  # type: ignore[arg-type]
        except AttributeError:
            pass
        if name in MISSING_ENGINE_API:
            raise DeepSpeedAPIError(f"DeepSpeed's engine.{name} is not implemented by zeropp yet")
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and not (name.startswith("__") and name.endswith("__")):
            return getattr(module, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
