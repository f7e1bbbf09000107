"""``deepspeed.runtime.engine``: zeropp's engine under DeepSpeed's names.

:class:`ZeroppEngine` is what ``zeropp.initialize`` returns: the core engine (``zeropp.zero.engine.ZeroEngine``,
which keeps its own vocabulary) with DeepSpeed's accessors (``train_batch_size()``, ``local_rank``, ``get_lr()``,
...) and checkpoint methods (``save_checkpoint``, ``load_checkpoint``, which also imports a DeepSpeed ZeRO
checkpoint, ``save_16bit_model``). They read the engine's state and config, or call the functions of
``zeropp.checkpoint``; nothing here changes what the engine does. Its training calls take DeepSpeed's arguments and
make DeepSpeed's checks: ``backward`` returns the loss it scaled, ``_backward_epilogue`` finishes a direct
``loss.backward()``, ``step`` is refused inside ``no_sync()`` (which does not nest), ``save_checkpoint`` refuses an
empty directory and compares the ranks' tags (``checkpoint.tag_validation``).

:class:`DeepSpeedEngine` (also ``deepspeed.DeepSpeedEngine``) is what the alias's ``deepspeed.initialize``
returns, for the ``isinstance`` checks integrations make. It differs from :class:`ZeroppEngine` in three ways, all
DeepSpeed's behaviour:

* ``engine.optimizer`` is what DeepSpeed's engine holds: its ZeRO optimizer (the view in
  ``runtime/zero/zero_optimizer.py``) at stages 1-3, the torch optimizer itself at stage 0 in fp32 (in 16 bits
  DeepSpeed's unfused wrapper), where zeropp's own engine answers with the torch optimizer over the fp32 masters
  (which both keep as ``master_optimizer``);
* at stage 0 in fp32 or fp16, an engine given no optimizer (none passed, no config section) has none and refuses
  ``backward`` and ``step`` (Note [no optimizer]), where zeropp's own engine steps the config's default AdamW;
* ``forward`` passes floating-point inputs as they are, casting them to fp16 only with ``fp16.auto_cast``, where
  zeropp's own engine casts them to the compute dtype (a bf16 model given fp32 inputs computes in fp32 where the
  weights meet them, as under DeepSpeed);

and raises DeepSpeed's exception type where a script may catch it: a parameter without a gradient under
``ignore_unused_parameters: false`` is an ``AssertionError`` (zeropp's :class:`UnusedParametersError`, a
RuntimeError, is its cause).

A DeepSpeed engine name zeropp lacks raises :class:`DeepSpeedAPIError` naming it (``missing.py``).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from typing import Any, Iterator, Optional

import torch

from zeropp import checkpoint
from zeropp.comm.ledger import Phase
from zeropp.deepspeed.checkpoint_format import deepspeed_tag_dir
from zeropp.deepspeed.checkpoint_io import load_deepspeed
from zeropp.deepspeed.checkpoint.universal_io import load_universal_checkpoint, loads_universal
from zeropp.deepspeed.missing import DeepSpeedAPIError, is_missing, missing
from zeropp.deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from zeropp.deepspeed.runtime.zero.zero_optimizer import (DeepSpeedZeroOptimizer,
                                                          DeepSpeedZeroOptimizer_Stage3)
from zeropp.deepspeed.utils.timer import ThroughputTimer
from zeropp.zero.engine import ZeroEngine
from zeropp.zero.grad_intake import UnusedParametersError


class EngineGivenBackError(RuntimeError):
    """The engine gave its model back (a later ``initialize`` on the same model: Note [a second initialize] in
    ``deepspeed/module_api.py``) and refuses to train, save or load."""


def agreed_tag(engine: ZeroEngine, tag: str) -> str:
    """The checkpoint tag every rank writes under, by the config's ``checkpoint.tag_validation``: ranks compare
    their tags (one all-gather of SHA-1 digests); where they differ "Fail" raises DeepSpeed's AssertionError, and
    "Warn" and "Ignore" write one checkpoint under rank 0's tag with a warning naming both (DeepSpeed's "Warn" would
    write each rank's files under its own tag, a checkpoint no load reads whole; its "Ignore" does not compare)."""
    topo = engine.topo
    if topo.world_size == 1:
        return tag
    digest = torch.tensor(list(hashlib.sha1(tag.encode()).digest()), dtype=torch.float64)
    every = torch.empty(topo.world_size * digest.numel(), dtype=torch.float64)
    engine.comm.all_gather(every, digest, topo.world, Phase.OTHER)
    differ = [r for r, d in enumerate(every.view(topo.world_size, -1)) if not torch.equal(d, digest)]
    if not differ:
        return tag
    msg = (f"[rank={topo.rank}] The checkpoint tag name '{tag}' is not consistent across all ranks (ranks {differ} "
           "passed another). Including rank unique information in checkpoint tag could cause issues when restoring "
           "with different world sizes.")
    if engine.config.checkpoint.tag_validation == "Fail":
        raise AssertionError(msg)
    first = _rank0_text(engine, tag)
    warnings.warn(f"{msg} zeropp writes one checkpoint for all ranks, under rank 0's tag {first!r}", stacklevel=3)
    return first


def _rank0_text(engine: ZeroEngine, text: str) -> str:
    """Rank 0's ``text`` on every rank (two broadcasts: its length, then its bytes)."""
    data = torch.tensor(list(text.encode()), dtype=torch.int64)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    engine.comm.broadcast(size, 0, engine.topo.world, Phase.OTHER)
    buf = data if engine.topo.rank == 0 else torch.zeros(int(size.item()), dtype=torch.int64)
    engine.comm.broadcast(buf, 0, engine.topo.world, Phase.OTHER)
    return bytes(buf.tolist()).decode()


def zero_optimizer_view(engine: Any) -> Any:
    """The optimizer DeepSpeed's engine holds for ``engine``'s stage and precision: stage 3's and stages 1-2's ZeRO
    optimizer views; at stage 0 the torch optimizer itself in fp32 (the client's object, or the config's), and in
    16 bits DeepSpeed's unfused fp16 wrapper (``runtime/fp16/unfused_optimizer.py``, also for bf16)."""
    if engine.plan.shards_weights:
        return DeepSpeedZeroOptimizer_Stage3(engine)
    if engine.policy.stage > 0:
        return DeepSpeedZeroOptimizer(engine)
    if engine.policy.compute_dtype == torch.float32:
        return engine.master_optimizer
    return FP16_UnfusedOptimizer(engine)


def _policy(field: str, doc: str) -> Any:
    """A DeepSpeed accessor method that answers one field of the engine's policy."""
    def read(self: ZeroEngine) -> Any:
        return getattr(self.policy, field)
    read.__doc__ = doc
    return read


class ZeroppEngine(ZeroEngine):
    """zeropp's engine with DeepSpeed's accessors and checkpoint methods (see the module docstring)."""

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
        return self.units[0].device if self.units else torch.device("cpu")

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer parameter group."""
        return [group["lr"] for group in self.master_optimizer.param_groups]

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train batch size, micro-batch per rank, gradient accumulation steps)."""
        p = self.policy
        return p.train_batch_size, p.micro_batch_per_rank, p.gradient_accumulation_steps

    # settings as the engine's policy settled them (config/policy.py)
    train_batch_size = _policy("train_batch_size", "Samples per optimizer step over all ranks and accumulation steps.")
    train_micro_batch_size_per_gpu = _policy("micro_batch_per_rank", "Samples per micro-step on this rank.")
    gradient_accumulation_steps = _policy("gradient_accumulation_steps", "Micro-steps per optimizer step.")
    gradient_clipping = _policy("gradient_clipping", "The global norm gradients are clipped to (0: none).")
    gradient_predivide_factor = _policy("grad_predivide", "What gradients are divided by before the reduction.")
    zero_offload_optimizer = _policy("offload_optimizer", "Whether the optimizer's state waits on the host.")
    zero_offload_param = _policy("offload_param", "Whether stage 3's 16-bit shards wait on the host.")
    zero_reduce_bucket_size = _policy("reduce_bucket_size", "The reduce bucket size in use (sized from the model "
                                      "when the config leaves it out: Note [bucket size]).")
    zero_optimization_stage = _policy("stage", "The ZeRO stage.")

    @property
    def global_samples(self) -> int:
        """Samples trained on over all ranks: optimizer steps times the train batch size."""
        return self.global_steps * self.train_batch_size()

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights: False off an accumulation boundary and when the step
        was skipped (a non-finite gradient, fp16's overflow)."""
        return self.step_applied

    @property
    def dp_world_size(self) -> int:
        """Ranks in data parallel: the world (zeropp has no model or pipeline parallel dimension)."""
        return self.topo.world_size

    @property
    def mp_world_size(self) -> int:
        return 1  # no model parallelism

    mpu = None  # DeepSpeed's model-parallel unit: none

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def dynamic_loss_scale(self) -> bool:
        """fp16 with a dynamic loss scale (``fp16.loss_scale`` 0)."""
        s = self.policy.loss_scaling
        return s is not None and s.loss_scale == 0

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

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer runs on the host (``offload_optimizer.device`` "cpu")."""
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device == "cpu"

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero_optimization.allgather_bucket_size

    def zero_overlap_comm(self) -> bool:
        return True  # zeropp always overlaps communication with compute

    def zero_optimization(self) -> bool:
        return self.policy.stage > 0

    def bfloat16_enabled(self) -> bool:
        return self.policy.compute_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.policy.compute_dtype == torch.float16

    def checkpoint_tag_validation_enabled(self) -> bool:
        """Whether save_checkpoint compares the ranks' tags (``checkpoint.tag_validation`` not "Ignore")."""
        return self.config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        """Whether ranks whose tags differ fail the save (``checkpoint.tag_validation`` "Fail")."""
        return self.config.checkpoint.tag_validation == "Fail"

    def load_universal_checkpoint(self) -> bool:
        """``checkpoint.load_universal``: load_checkpoint reads a universal checkpoint."""
        return self.config.checkpoint.load_universal

    def use_node_local_storage(self) -> bool:
        return self.config.checkpoint.use_node_local_storage  # always False: True is refused at initialize

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: ``save_16bit_model`` always gathers the full 16-bit weights."""
        return True

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Make the next ``step()`` calls step the optimizer (True) or only accumulate (False) whatever the
        micro-step count says, until called with None. An epoch's last, shorter window is the use
        (transformers' Trainer, accelerate); the engine then counts that window as a whole one."""
        self.force_boundary(is_boundary)

    def empty_partition_cache(self) -> None:
        """Free the weights still gathered between steps (persistent units); they are gathered again at their
        next use."""
        self.free_gathered()

    def allreduce_gradients(self, bucket_size: Any = None) -> None:
        """Finish reducing the last backward's gradients. zeropp reduces them inside ``backward`` at stages 2-3
        and at the accumulation boundary's ``step()`` at stages 0-1 (where DeepSpeed's engine reduces them too),
        so this only closes a backward still open; ``bucket_size`` is DeepSpeed's and unused."""
        self.finish_backward()

    def destroy(self) -> None:
        """Release the engine and its hold on the model (``unpartition``: the model is left whole, ready for
        another ``initialize``)."""
        self.unpartition()

    def compile(self, backend: Any = "inductor", compile_kwargs: Optional[dict[str, Any]] = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """``torch.compile`` of the model in place (``ZeroEngine.compile``); DeepCompile's ``schedule`` and
        compiled autograd are not built."""
        if schedule is not None:
            raise DeepSpeedAPIError("engine.compile(schedule=...): a DeepCompile pass schedule; zeropp has no "
                                    "DeepCompile yet: leave schedule out")
        if compiled_autograd_enabled:
            raise DeepSpeedAPIError("engine.compile(compiled_autograd_enabled=True): compiled autograd is not "
                                    "supported yet: leave it False (backward runs the compiled regions' graphs)")
        super().compile(backend, compile_kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps inside accumulate their gradients without reducing them. zeropp's stages 0-1 reduce only at
        the accumulation boundary anyway, so nothing changes there; stages 2-3 reduce into shards as gradients
        are produced and refuse it, as DeepSpeed does. As in DeepSpeed, ``step()`` inside is refused and the
        context does not nest (both ``AssertionError``)."""
        if self.policy.stage >= 2:
            raise AssertionError(f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
                                 f"stage {self.policy.stage}")
        if self.inside_no_sync_ctxt:
            raise AssertionError("no_sync context manager reentry is unsupported")
        self.__dict__["_no_sync"] = True
        try:
            yield
        finally:
            self.__dict__["_no_sync"] = False

    @property
    def inside_no_sync_ctxt(self) -> bool:
        """Whether a ``no_sync()`` block is open (DeepSpeed's flag)."""
        return self.__dict__.get("_no_sync", False)

    # ---- DeepSpeed's training calls over the core's: its arguments, return values and checks ---------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_live("forward")
        return super().forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,  # type: ignore[override]
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` (see ``ZeroEngine.backward``), with DeepSpeed's arguments and return value: the loss
        divided by ``gradient_accumulation_steps`` (``loss`` itself with ``scale_wrt_gas=False``), which multi-output
        scripts log. ``retain_graph=True`` is not supported yet (the engine releases what each backward used)."""
        self._check_live("backward")
        if retain_graph:
            raise DeepSpeedAPIError("engine.backward(retain_graph=True): keeping the graph for a second backward is "
                                    "not supported yet; run forward again for each backward")
        super().backward(loss, scale_wrt_gas=scale_wrt_gas)
        return loss / self.policy.gradient_accumulation_steps if scale_wrt_gas else loss

    def _backward_epilogue(self) -> None:
        """DeepSpeed's end of a backward, which its scripts call after a direct ``loss.backward()`` (several engines
        under one loss): that backward's gradients are reduced now, as ``engine.backward`` does at its end, and the
        next direct backward starts afresh. After ``engine.backward`` it does nothing. A direct backward is neither
        divided by ``gradient_accumulation_steps`` nor scaled by fp16's loss scale: under fp16 with a loss scale
        other than 1 it is refused (DeepSpeed's error), as the step would divide its gradients by the scale."""
        self._check_live("_backward_epilogue")
        if self.state.backward_open:
            self.finish_backward()
            return
        if self.loss_scale != 1.0:
            raise RuntimeError("Loss scaling is required for this configuration, but backward() was called directly "
                               "without scaling the loss. Please use engine.backward(loss)")
        self.stepping.finish_backward()  # the buckets it filled reduced, its gathers drained, every unit released
        self.grads.begin_backward()  # the next direct backward's bookkeeping starts empty

    def step(self, lr_kwargs: Optional[dict] = None) -> None:  # type: ignore[override]
        """Count a micro-step; at an accumulation boundary, step the optimizer (``ZeroEngine.step``). Refused inside
        ``no_sync()``, as DeepSpeed refuses it; ``lr_kwargs`` (arguments for the schedule's step) is not supported
        yet."""
        self._check_live("step")
        if self.inside_no_sync_ctxt:
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context manager")
        if lr_kwargs is not None:
            raise DeepSpeedAPIError("engine.step(lr_kwargs=...): arguments for the schedule's step are not supported "
                                    "yet; the engine steps its schedule once per optimizer step")
        super().step()

    def _check_live(self, what: str) -> None:
        """Refuse ``what`` on an engine whose model a later ``initialize`` took (Note [a second initialize])."""
        why = self.__dict__.get("_given_back")
        if why is not None:
            raise EngineGivenBackError(f"engine.{what}: this engine gave its model back ({why}); use the engine "
                                       "that initialize returned last")

    #: DeepSpeed's names of modules with sparse gradients: none (zeropp reduces dense gradients)
    sparse_tensor_module_names: frozenset[str] = frozenset()

    # ---- checkpoints (every rank calls them) -------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Write a sharded checkpoint to ``save_dir/tag`` (default tag ``global_step{N}``); every rank calls.

        Returns the tag directory; ``save_dir/latest`` names it once every rank's shard is on disk.
        ``exclude_frozen_parameters`` leaves out the parameters that do not require grad (the Trainer asks for
        it on a PEFT model); such a checkpoint loads with ``load_module_strict=False``.
        """
        self._check_live("save_checkpoint")
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")  # DeepSpeed's check
        if tag is not None:
            tag = agreed_tag(self, str(tag))
        return checkpoint.save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Optional[str], Any]:
        """Restore weights, optimizer, scheduler, counters and RNG from ``load_dir`` (tag default: ``latest``).

        Works on a different world size too (re-sharding). Returns ``(path, client_state)``, or
        ``(None, None)`` with a warning when ``tag`` is None and ``load_dir`` is missing or holds no complete
        tag, so a restarted job can always call it; ``latest`` falls back past a damaged tag. A DeepSpeed ZeRO
        checkpoint (``latest`` and ``global_stepN/*_optim_states.pt``) is imported (``checkpoint_io.py``).
        With ``"checkpoint": {"load_universal": true}`` it reads a universal checkpoint (``latest_universal`` names
        its folder; DeepSpeed's layout or zeropp's), on any world size and stage (``checkpoint/universal_io.py``).
        ``load_module_strict=False`` also loads a checkpoint saved with ``exclude_frozen_parameters`` (the model
        keeps its own frozen values); it relaxes nothing else: every other parameter must be there and fit.
        ``custom_load_fn`` is not supported yet.
        """
        if custom_load_fn is not None:
            raise DeepSpeedAPIError("load_checkpoint: custom_load_fn is not implemented by zeropp yet (a checkpoint "
                                    "restores every parameter it holds)")
        self._check_live("load_checkpoint")
        if self.config.zero_optimization.pipeline_loading_checkpoint and self.policy.stage != 3:
            raise AssertionError("Only stage3 support for pipeline checkpoint loading")  # DeepSpeed's check
        if loads_universal(self.config):  # checkpoint.load_universal: latest_universal, any world size and stage
            return load_universal_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                             load_module_only, strict=load_module_strict)
        ds_tag = deepspeed_tag_dir(load_dir, tag)
        if ds_tag is not None:
            return load_deepspeed(self, ds_tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)
        return checkpoint.load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                          load_module_only, strict=load_module_strict)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> str:
        """Write the full weights in the compute dtype from rank 0 (every rank calls); returns the file path."""
        return checkpoint.save_16bit_model(self, save_dir, save_filename)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> Optional[dict[str, torch.Tensor]]:
        """The full state dict in the compute dtype on rank 0, None on the other ranks (collective: every rank
        calls it); ``exclude_frozen_parameters`` leaves out parameters that do not require grad (a PEFT
        model's base weights)."""
        state = self.consolidated_state_dict()
        if self.topo.rank != 0:
            return None
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters(remove_duplicate=False)
                      if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return checkpoint.in_compute_dtype(state, self.policy.compute_dtype)

    def save_fp16_model(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's older name of ``save_16bit_model``."""
        return self.save_16bit_model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """The core engine's lookup (the model's attributes last), after DeepSpeed's names zeropp lacks, which
        are an error that names them."""
        if is_missing("engine", name) and name not in self.__dict__.get("_modules", {}):
            raise missing("engine", name)
        return super().__getattr__(name)


class DeepSpeedEngine(ZeroppEngine):
    """zeropp's engine as DeepSpeed's scripts see it (see the module docstring). Made by ``deepspeed.initialize``."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._optimizer_none:  # Note [no optimizer]
            raise AssertionError("must provide optimizer during init in order to use backward")
        try:
            return super().backward(loss, *args, **kwargs)
        except UnusedParametersError as e:
            raise AssertionError(str(e)) from e

    def step(self, lr_kwargs: Optional[dict] = None) -> None:  # type: ignore[override]
        if self._optimizer_none:  # Note [no optimizer]
            raise AssertionError("must provide optimizer during init in order to use step")
        super().step(lr_kwargs)

    @property
    def has_optimizer(self) -> bool:
        """Whether DeepSpeed's engine would have an optimizer: one was passed to ``initialize`` or the config has an
        ``optimizer`` section (Note [no optimizer])."""
        return self.__dict__.get("_has_optimizer", True)

    @property
    def _optimizer_none(self) -> bool:
        """Whether DeepSpeed's engine would hold no optimizer at all: none given, at stage 0, not in bf16."""
        return not self.has_optimizer and self.policy.stage == 0 and self.policy.compute_dtype != torch.bfloat16

    @property
    def casts_inputs(self) -> bool:  # type: ignore[override]
        fp16 = self.config.fp16
        return bool(fp16.enabled and fp16.auto_cast)

    @property
    def optimizer(self) -> Any:  # type: ignore[override]
        """What DeepSpeed's engine holds: the ZeRO optimizer (view) at stages 1-3; at stage 0 the torch optimizer in
        fp32 (the client's own object) and DeepSpeed's unfused wrapper in 16 bits; None at stage 0 in fp32 or fp16
        when no optimizer was given (Note [no optimizer])."""
        if self._optimizer_none:
            return None
        if "_deepspeed_optimizer" not in self.__dict__:  # one per engine, made at first use
            self.__dict__["_deepspeed_optimizer"] = zero_optimizer_view(self)
        return self.__dict__["_deepspeed_optimizer"]


# Note [no optimizer]: DeepSpeed's engine has an optimizer only when initialize is given one or its config has an
# optimizer section. Without one, at stage 0 in fp32 or fp16 it holds none: engine.optimizer is None and backward()
# and step() raise AssertionError ("must provide optimizer during init"); DeepSpeedEngine does the same. Elsewhere
# DeepSpeed builds a stand-in (stage 3: its parameter offload, whose backward runs; stage 0 in bf16: its bf16
# wrapper over a dummy optimizer) or refuses at initialize (stages 1-2: "zero stage N requires an optimizer"); there
# zeropp's engine steps the config's default AdamW, as zeropp's own engine always does (zeropp.initialize).
