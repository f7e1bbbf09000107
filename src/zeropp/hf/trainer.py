"""``ZeroppTrainer``: a ``transformers.Trainer`` whose model is trained by a zeropp engine (ZeRO stages 0-3
and ZeRO++), configured by a DeepSpeed-style JSON whose ``"auto"`` values come from the ``TrainingArguments``.

The seam, in the order the Trainer's loop meets it (transformers 5.x, ``Trainer._inner_training_loop``):

* ``_prepare_for_training`` — where the Trainer creates the optimizer and scheduler and lets accelerate wrap
  the model — builds the engine instead (``zeropp.initialize``), once the run's number of steps is known,
  and restores an engine checkpoint when resuming. accelerate never sees the model: no DDP, no autocast.
* ``training_step`` runs the forward through the engine (gathers), ``engine.backward`` (reductions) and
  ``engine.step()``: at the accumulation boundary that is the whole optimizer step — global-norm clipping,
  optimizer and scheduler, exactly once — as DeepSpeed's engine does inside accelerate's backward.
* The loop's own ``optimizer.step()``, ``lr_scheduler.step()`` and ``model.zero_grad()`` then reach no-op
  stand-ins (:mod:`zeropp.hf.adapters`); ``_clip_grad_norm``/``_get_grad_norm`` report the engine's norm, so
  the Trainer's logs (loss, learning rate, grad_norm) stay as they are.
* Saving: ``save_model`` gathers the fp32 masters on every rank and writes a normal Hugging Face directory
  from rank 0; a Trainer checkpoint adds ``engine.save_checkpoint`` (sharded optimizer state, scheduler,
  counters) where the Trainer would save ``optimizer.pt``/``scheduler.pt``; ``resume_from_checkpoint`` loads it.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Mapping, Optional, TypeVar, Union

import torch
import transformers
from torch import nn

from zeropp import initialize  # the public entry point: the engine with its accessors
from zeropp.checkpoint import load_checkpoint, save_checkpoint
from zeropp.checkpoint.format import LATEST
from zeropp.config.loader import ConfigError, load_config, read_json
from zeropp.config.auto import AutoValues
from zeropp.deepspeed.alias import alias_installed
from zeropp.hf.adapters import EngineModule, EngineOptimizer, EngineScheduler, PlainModule
from zeropp.hf.export import save_companions, save_fp32_pretrained
from zeropp.hf.values import auto_values, check_trainer_owned, trainer_config
from zeropp.zero.construction import move_model
from zeropp.zero.engine import ZeroEngine

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any]]

# Trainer methods overridden here that are not public API: they exist since transformers split
# _inner_training_loop into smaller methods (5.x); an older Trainer is refused with a clear error.
_TRAINER_METHODS = ("_prepare_for_training", "_clip_grad_norm", "_get_grad_norm", "_wrap_model",
                    "_save_optimizer_and_scheduler", "_load_from_checkpoint", "set_initial_training_values")

# Optimizers that are correct on flat 1-D shards: every element's update reads only that element's state.
# A factored or matrix-shaped one (Adafactor, GaLore, Muon, LOMO...) would silently run another algorithm.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop)
_METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")  # stepped by the Trainer with eval metrics
_METRIC_SCHEDULER_KEY = "trainer_metric_scheduler"  # its state, in the engine checkpoint's client state


class ZeroppTrainerError(ValueError):
    """A Trainer setting that cannot work with zeropp (the message names the argument)."""


# TrainingArguments settings ZeroppTrainer cannot honour when they are set, and why
_UNSUPPORTED_ARGUMENTS = (
    ("fsdp", "FSDP and zeropp both shard the model; use one (zeropp's ZeRO-3 is the same partitioning)"),
    ("parallelism_config", "zeropp partitions over data-parallel ranks only (no tensor, context or sequence "
                           "parallelism)"),
    ("auto_find_batch_size", "a rank that runs out of memory in a step leaves the others inside its collectives, "
                             "with no common point to retry from; choose the batch with `zeropp plan`"),
    ("save_on_each_node", "not supported yet (zeropp checkpoints assume storage every rank can read)"),
)


def unsupported_arguments(args: transformers.TrainingArguments) -> list[str]:
    """One line per ``TrainingArguments`` setting that ZeroppTrainer cannot honour (empty: all fine)."""
    return [f"{name}: {why}" for name, why in _UNSUPPORTED_ARGUMENTS if getattr(args, name, None)]


F = TypeVar("F", bound=Callable[..., Any])


# Note [one engine, two roads]: ZeroppTrainer given ``TrainingArguments.deepspeed`` (and no ``zeropp_config``)
# takes its config from there. transformers and accelerate then build the engine through ``deepspeed.initialize``,
# which zeropp's DeepSpeed API answers with zeropp's engine (a ``DeepSpeedEngine``), exactly as for the plain
# Trainer: so the seam below steps aside (each method marked ``_own_engine`` runs the Trainer's own) and
# ``trainer.engine`` is that engine. Both roads train on the same engine; the DeepSpeed road needs the alias
# installed before transformers is imported (otherwise an installed DeepSpeed would train): refused by name.
def _own_engine(method: F) -> F:
    """A step of ZeroppTrainer's own seam; on the DeepSpeed road the Trainer's method runs instead."""
    @functools.wraps(method)
    def run(self: "ZeroppTrainer", *args: Any, **kwargs: Any) -> Any:
        if self._deepspeed_road:
            return getattr(super(ZeroppTrainer, self), method.__name__)(*args, **kwargs)
        return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


def _read_config(source: ConfigSource) -> tuple[dict, Optional[str]]:
    """The raw config dict and, for a file, its path (for error messages)."""
    if isinstance(source, Mapping):
        return dict(source), None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        raw = read_json(path)
        if not isinstance(raw, Mapping):
            raise ConfigError("<config>: the file does not hold a JSON object", path)
        return dict(raw), path
    raise TypeError(f"ZeroppTrainer(zeropp_config=...): a JSON file path or a dict, got {type(source).__name__}")


class ZeroppTrainer(transformers.Trainer):
    """``transformers.Trainer`` training through zeropp: ZeRO stages 0-3 and ZeRO++ (qwZ, hpZ, qgZ).

    Takes the Trainer's arguments plus ``zeropp_config`` (a JSON path or a dict in DeepSpeed's format, with
    zeropp's ``topology`` extension). ``"auto"`` values are filled from the ``TrainingArguments`` as Hugging
    Face's DeepSpeed integration fills them (:func:`zeropp.hf.auto_values`); batch sizes, accumulation,
    clipping and precision always follow the arguments, and a config value contradicting them is an error.

    Without an ``optimizer`` section the Trainer's optimizer (``args.optim``, ``learning_rate``,
    ``weight_decay``...) is rebuilt over the fp32 master shards; without a ``scheduler`` section the
    Trainer's ``lr_scheduler_type`` schedule drives it. Launch with ``torchrun``; ``save_model`` must be
    called on every rank (the weights are gathered from all of them). ``trainer.engine`` is the
    engine (what ``zeropp.initialize`` returns) once ``train()`` has started.
    """

    def __init__(self, model: Optional[nn.Module] = None, args: Optional[transformers.TrainingArguments] = None,
                 *trainer_args: Any, zeropp_config: Optional[ConfigSource] = None, **trainer_kwargs: Any) -> None:
        missing = [name for name in _TRAINER_METHODS if not hasattr(transformers.Trainer, name)]
        if missing:
            raise ImportError(f"ZeroppTrainer needs transformers >= 5 (the Trainer's loop split into "
                              f"{', '.join(missing)}); found {transformers.__version__}: "
                              "pip install -U 'zeropp[hf]'")
        road = args is not None and bool(getattr(args, "deepspeed", None))
        if road and zeropp_config is not None:
            raise ZeroppTrainerError("ZeroppTrainer: the config is given twice, as TrainingArguments.deepspeed and "
                                     "as zeropp_config=; give one of them")
        if zeropp_config is None and not road:
            raise TypeError("ZeroppTrainer: zeropp_config= (a DeepSpeed-style JSON path or dict) or "
                            "TrainingArguments.deepspeed is required")
        if road and not alias_installed():
            raise ZeroppTrainerError("ZeroppTrainer: TrainingArguments.deepspeed trains through zeropp's DeepSpeed "
                                     "API, which is not installed as `deepspeed` in this process: call "
                                     "zeropp.install_deepspeed_alias() before transformers is imported, or launch "
                                     "with `zeropp run` / `torchrun -m zeropp.tools.run`; or pass the config as "
                                     "zeropp_config=")
        self._deepspeed_road = road  # Note [one engine, two roads]
        if args is not None:
            self._refuse(unsupported_arguments(args))
        self.zeropp_config = zeropp_config
        self._engine: Optional[ZeroEngine] = None
        self._engine_module: Optional[EngineModule] = None
        self._engine_model: Optional[nn.Module] = None  # the model the engine partitions
        self._schedule_built_here = False  # from lr_scheduler_type (built again for a later train())
        self._metric_schedule = False  # stepped by the Trainer with evaluation metrics, not by the engine
        if trainer_args:  # the Trainer's positional order
            super().__init__(model, args, *trainer_args, **trainer_kwargs)
        else:  # by name: a subclass mixed in after this one may order its arguments otherwise (DPO's ref_model)
            super().__init__(model=model, args=args, **trainer_kwargs)
        problems = unsupported_arguments(self.args) if args is None else []
        if self.args.n_gpu > 1:
            problems.append("n_gpu: several GPUs in one process (DataParallel); launch one process per device "
                            "with torchrun")
        if (self.is_deepspeed_enabled and not self._deepspeed_road) or self.is_fsdp_enabled:
            problems.append("accelerate's DeepSpeed/FSDP plugin (accelerate launch --use_deepspeed/--use_fsdp): "
                            "zeropp takes their place; launch with torchrun")
        self._refuse(problems)

    @property
    def engine(self) -> Optional[ZeroEngine]:
        """The engine training the model once ``train()`` has started (on the DeepSpeed road, the one
        accelerate built through ``deepspeed.initialize``), else None."""
        if self._deepspeed_road:
            wrapped = getattr(self, "model_wrapped", None)
            return wrapped if isinstance(wrapped, ZeroEngine) else None
        return self._engine

    @engine.setter
    def engine(self, value: Optional[ZeroEngine]) -> None:
        self._engine = value

    @_own_engine
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The Trainer puts the model on ``args.device`` before training; a model partitioned at construction
        (``zero.Init``, ``from_pretrained``) is already there and has nothing whole to move, so only what is not
        partitioned moves (``partition.construction.move_model``)."""
        move_model(model, device)

    @staticmethod
    def _refuse(problems: list[str]) -> None:
        if problems:
            raise ZeroppTrainerError("ZeroppTrainer: TrainingArguments settings that cannot work with zeropp:\n  - "
                                     + "\n  - ".join(problems))

    # ---- building the engine -----------------------------------------------------------------------------
    def _start_engine(self, max_steps: int) -> None:
        """Resolve the config against the arguments, then ``zeropp.initialize`` (collective)."""
        raw, origin = _read_config(self.zeropp_config)
        values = auto_values(self.args, self.model, max_steps)
        try:
            raw = trainer_config(raw, values)
            optimizer = self._client_optimizer(raw.get("optimizer") is not None)
            scheduler = self._client_scheduler(raw.get("scheduler") is not None, max_steps)
            known = AutoValues(given=values.given, hidden_size=values.hidden_size,
                               client_optimizer=optimizer is not None, client_scheduler=scheduler is not None)
            cfg = load_config(raw, known)
            check_trainer_owned(cfg, values, self.args.world_size)
        except ConfigError as err:
            raise type(err)(err.problems, origin) from None  # name the file
        engine, *_ = initialize(model=self.model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
        self._partition_reference(cfg)
        if self.args.torch_compile:  # the engine compiles per block (Note [compiled regions]), not accelerate
            mode = self.args.torch_compile_mode
            engine.compile(self.args.torch_compile_backend or "inductor", {"mode": mode} if mode else {})
        self.engine, self._engine_model = engine, self.model
        # TRL's switch for stage 3 (its GRPO and online trainers read it), honoured here as under DeepSpeed
        self._engine_module = EngineModule(engine, getattr(self.args, "ds3_gather_for_generation", True))
        self.model_wrapped = self._engine_module
        self.optimizer = EngineOptimizer(engine)
        self._schedule(engine, max_steps)

    def _schedule(self, engine: ZeroEngine, max_steps: int) -> None:
        """``Trainer.lr_scheduler``: the engine's (stepped with each optimizer step) behind a no-op stand-in, or a
        metric-driven one (ReduceLROnPlateau, GreedyLR) over the engine's optimizer, which the Trainer steps
        itself with each evaluation's metric and the engine never steps. Evaluation gives every rank the same
        metric, so every rank changes its shards' learning rate alike."""
        if self._metric_schedule:
            self.lr_scheduler = self._trainers_schedule(max_steps, engine.master_optimizer)
        else:
            self.lr_scheduler = EngineScheduler(engine)

    def _client_optimizer(self, config_has_one: bool) -> Optional[torch.optim.Optimizer]:
        """The Trainer's optimizer, for ``initialize`` to rebuild over the masters; None: the config's."""
        if config_has_one:
            if self.optimizer is not None:
                raise ZeroppTrainerError("ZeroppTrainer: an optimizer was given both as optimizers=(optimizer, ...) "
                                         "and as the zeropp config's optimizer section; give one")
            return None
        optimizer = self.create_optimizer()  # args.optim, learning_rate, no decay on biases and norms
        if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
            raise ZeroppTrainerError(
                f"ZeroppTrainer: TrainingArguments.optim={self.args.optim!r} builds {type(optimizer).__name__}, "
                "which zeropp cannot step on flat parameter shards; accepted: an element-wise torch optimizer "
                f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}: e.g. optim='adamw_torch'), or an "
                "optimizer section in the zeropp config")
        return optimizer

    def _client_scheduler(self, config_has_one: bool, max_steps: int) -> Union[Callable, Any, None]:
        """The Trainer's scheduler (an object given in ``optimizers=``, or a builder over the rebuilt optimizer
        from ``lr_scheduler_type``); None: the config's."""
        if config_has_one:
            if self.lr_scheduler is not None:
                raise ZeroppTrainerError("ZeroppTrainer: a scheduler was given both as optimizers=(..., scheduler) "
                                         "and as the zeropp config's scheduler section; give one")
            return None
        if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ZeroppTrainerError("ZeroppTrainer: a ReduceLROnPlateau given in optimizers=(..., scheduler) is built "
                                     "over the model's parameters, not the engine's fp32 masters; set "
                                     "TrainingArguments(lr_scheduler_type='reduce_lr_on_plateau') instead")
        if self.lr_scheduler is not None:
            return self.lr_scheduler  # initialize moves it onto the rebuilt optimizer
        kind = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
        self._metric_schedule = kind in _METRIC_SCHEDULERS
        if self._metric_schedule:
            self._schedule_built_here = True
            return None  # built over the engine's optimizer once it exists (_schedule)

        def build(optimizer: torch.optim.Optimizer) -> Any:
            self._schedule_built_here = True
            return self._trainers_schedule(max_steps, optimizer)

        return build

    def _trainers_schedule(self, max_steps: int, optimizer: torch.optim.Optimizer) -> Any:
        """A new schedule of ``lr_scheduler_type`` over ``optimizer`` for a run of ``max_steps``."""
        self.lr_scheduler = None  # create_scheduler builds only when none is set
        return self.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)

    # ---- the training loop's seam --------------------------------------------------------------------------
    def _partition_reference(self, cfg: Any) -> None:
        """Stage 3: a frozen reference model the trainer holds (TRL's DPO ``ref_model``) becomes an engine of its
        own with nothing to train, so its weights are partitioned like the policy's (int8 with
        ``zero_quantized_nontrainable_weights``) and gathered unit by unit for its forwards, never whole."""
        ref = getattr(self, "ref_model", None)
        if not isinstance(ref, nn.Module) or isinstance(ref, ZeroEngine) or cfg.zero_optimization.stage != 3:
            return
        for p in ref.parameters():
            p.requires_grad_(False)
        self.ref_model, *_ = initialize(model=ref, config=cfg)

    @_own_engine
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Optional[str]
                              ) -> tuple[nn.Module, Any]:
        """Build the engine (first ``train()``, or start a new run on it at a later one) and restore its
        checkpoint when resuming; the model the loop calls is the engine's
        (:class:`~zeropp.hf.adapters.EngineModule`)."""
        if self.engine is not None and self.model is not self._engine_model:
            self._drop_engine()  # model_init built a new model for this train() (hyperparameter search)
        if self.engine is None:
            self._start_engine(max_steps)
        else:
            self._restart_engine(max_steps)
        if resume_from_checkpoint is not None:
            self._resume_engine(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self._engine_module, train_dataloader

    def _restart_engine(self, max_steps: int) -> None:
        """A later ``train()``, as the Trainer runs one: the weights and the optimizer's state carry on, a
        schedule the Trainer built from ``lr_scheduler_type`` is built again for the new length (one given in
        ``optimizers=`` or in the config carries on), and the steps count from 0 again."""
        engine = self._require_engine("train")
        if self._schedule_built_here:
            if not self._metric_schedule:  # the engine steps this one
                engine.lr_scheduler = self._trainers_schedule(max_steps, engine.master_optimizer)
            self._schedule(engine, max_steps)
        engine.restart_counts()

    def _drop_engine(self) -> None:
        """Release the engine of the previous model (``model_init`` gives each ``train()`` a new one): the next
        engine partitions the new model and rebuilds the optimizer and schedule, as the Trainer does."""
        self._require_engine("train").close()
        self.engine = self._engine_module = self._engine_model = None
        self._schedule_built_here = self._metric_schedule = False

    @_own_engine
    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights from its engine checkpoint (collective); the
        optimizer, schedule and counters stay those of the run's end, as when DeepSpeed loads it."""
        engine = self._require_engine("_load_best_model")
        path, _ = load_checkpoint(engine, self.state.best_model_checkpoint, load_module_only=True)
        if path is None:
            raise ZeroppTrainerError(f"ZeroppTrainer: the best checkpoint {self.state.best_model_checkpoint} holds no "
                                     "zeropp engine checkpoint (saved with save_only_model?)")

    def _resume_engine(self, checkpoint: str) -> None:
        """Weights, optimizer state, scheduler and counters from the checkpoint's engine tag; the Trainer
        restored its own state (step, RNG, callbacks) from the same directory."""
        path, client_state = load_checkpoint(self._require_engine("_resume_engine"), checkpoint)
        if path is None:
            raise ZeroppTrainerError(f"ZeroppTrainer: {checkpoint} holds no complete zeropp engine checkpoint")
        if self._metric_schedule:
            saved = client_state.get(_METRIC_SCHEDULER_KEY) if isinstance(client_state, dict) else None
            if saved is None:
                raise ZeroppTrainerError(f"ZeroppTrainer: the engine checkpoint {path} holds no state of the "
                                         f"lr_scheduler_type={self.args.lr_scheduler_type!r} schedule (saved with "
                                         "another lr_scheduler_type?)")
            self.lr_scheduler.load_state_dict(saved)
        if self.engine.global_steps != self.state.global_step:
            raise ZeroppTrainerError(f"ZeroppTrainer: the engine checkpoint {path} is at optimizer step "
                                     f"{self.engine.global_steps} but the Trainer's state in {checkpoint} at "
                                     f"step {self.state.global_step}")

    @_own_engine
    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> torch.Tensor:
        """Forward through the engine, ``engine.backward``, ``engine.step()``; returns the loss as the Trainer
        reports it (this micro-batch's share of the accumulated loss)."""
        engine = self._require_engine("training_step")
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if not self._loss_is_scaled_for_ga(num_items_in_batch):
            # the Trainer's rule: divide by the micro-batches of this window (fewer in an epoch's last window)
            loss = loss / self.current_gradient_accumulation_steps
        engine.backward(loss, scale_wrt_gas=False)  # scaled for the accumulation already, as with DeepSpeed
        self._engine_step(engine)
        return loss.detach()

    def _loss_is_scaled_for_ga(self, num_items_in_batch: Any) -> bool:
        """The Trainer's rule: a loss normalised by the window's token count is already scaled."""
        flag = getattr(self, "loss_is_scaled_for_ga", None)
        if flag is not None:
            return bool(flag)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                    or self.compute_loss_func is not None)

    def _engine_step(self, engine: ZeroEngine) -> None:
        """Step where the Trainer syncs: at the end of each window, an epoch's last and shorter one included."""
        boundary = self.accelerator.sync_gradients
        engine.force_boundary(bool(boundary))
        if boundary and isinstance(self.lr_scheduler, EngineScheduler):
            self.lr_scheduler.record_step_lr()  # what the Trainer logs as this step's learning rate
        engine.step()

    @_own_engine
    def _clip_grad_norm(self, model: nn.Module) -> Optional[float]:
        """The engine clipped at its step (``gradient_clipping`` = ``max_grad_norm``): report its norm."""
        return self._require_engine("_clip_grad_norm").get_global_grad_norm()

    @_own_engine
    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Optional[float]:
        """The global gradient norm before clipping, from the engine's last optimizer step."""
        return self._require_engine("_get_grad_norm").get_global_grad_norm()

    @_own_engine
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """The engine's model once it exists; before that (``evaluate()`` first) the plain model, kept away
        from accelerate's wrapping."""
        return self._engine_module if self._engine_module is not None else PlainModule(model)

    def _require_engine(self, what: str) -> ZeroEngine:
        if self.engine is None:
            raise RuntimeError(f"ZeroppTrainer.{what}: the engine is built by train()")
        return self.engine

    # ---- saving and resuming -------------------------------------------------------------------------------
    @_own_engine
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write ``config.json`` + ``model.safetensors`` (the fp32 master weights, tied weights once) that
        ``from_pretrained`` loads in a plain process, plus the tokenizer and the arguments.

        Collective once training started: call it on every rank (each contributes its shards); rank 0 writes.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.engine is None:  # nothing partitioned yet: the Trainer's own save of the whole model
            super().save_model(output_dir, _internal_call)
            return
        state = self.engine.consolidated_state_dict()
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            save_fp32_pretrained(self.model, state, output_dir)
            save_companions(output_dir, self.args, self.processing_class)

    @_own_engine
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """A Trainer checkpoint's optimizer part: the engine's sharded checkpoint (every rank writes its
        shard: masters, optimizer state, scheduler, counters) under ``output_dir/global_step{N}``."""
        client_state = {_METRIC_SCHEDULER_KEY: self.lr_scheduler.state_dict()} if self._metric_schedule else None
        save_checkpoint(self._require_engine("_save_optimizer_and_scheduler"), output_dir, client_state=client_state)

    @_own_engine
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """Check that the checkpoint holds an engine checkpoint; ``_prepare_for_training`` loads it once the
        engine exists (the weights come from it, not from ``model.safetensors``)."""
        if not os.path.isfile(os.path.join(resume_from_checkpoint, LATEST)):
            raise ZeroppTrainerError(
                f"ZeroppTrainer: {resume_from_checkpoint} holds no zeropp engine checkpoint ('{LATEST}' is "
                "missing): resume_from_checkpoint needs a checkpoint saved by ZeroppTrainer without "
                "save_only_model")
