"""The ZeRO engine, stages 0-3: which model states are partitioned is set by a :class:`StagePlan`.

One step under stage 3, as the engine sees it (see docs/architecture.md for the whole picture):
1. forward: a unit's pre-forward hook gathers its weights (``strategies.forward_gather``) and prefetches
   the unit that ran next last time; its post-forward hook hooks the outputs for backward and reports the
   forward's end to the releases (``zero/release.py``), which release it.
2. backward: the first gradient reaching a unit's outputs gathers it again (``strategies.backward_gather``);
   each parameter's post-accumulate-grad hook hands the full gradient to the buckets, and the unit is
   released once all its gradients are in. Full buckets are reduced (``strategies.reduce``) into shards.
3. step (at an accumulation boundary): fp32 gradients, global-norm clipping, optimizer step on the fp32
   master shards, recast to the 16-bit shards, version bump (which makes any hpZ copy stale).

Stages 0-2 keep the full 16-bit weights resident (no hooks, no per-module gathers) and gather them once
after each optimizer step; stages 0-1 keep full gradients until the boundary and reduce them once there.
Stage 0 "shards" over a group of one: every rank holds the whole master and optimizer state.

The engine holds no ZeRO++ flag: which gather and reduce run is decided by the strategies it is handed. Its
parts share one :class:`~zeropp.zero.state.EngineState` (Note [engine state]); this class builds them, drives a
step through them and is the public API.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zeropp.comm.ledger import CommLedger, Phase
from zeropp.comm.ops import Comm
from zeropp.config.loader import ConfigWarning
from zeropp.config.policy import TrainPolicy
from zeropp.offload.link import HostLink
from zeropp.offload.residency import Resident
from zeropp.topology import Topology
from zeropp.zero import compiled as compiled_regions
from zeropp.zero import gathered, idle_watch, reports, teardown
from zeropp.zero.budget import PrefetchBudget, unit_elements
from zeropp.zero.consolidated import consolidated_state_dict, load_consolidated_state_dict
from zeropp.zero.gathers import Gathers, Pass, coalesces
from zeropp.zero.grad_intake import GradIntake
from zeropp.zero.hooks import ModuleHooks
from zeropp.zero.memory import ActivationMeter
from zeropp.zero.optimizer_step import OptimizerStep
from zeropp.zero.param_use import ParamUse
from zeropp.zero.persistence import KeptUnits, persistent_units
from zeropp.zero.release import Releases
from zeropp.zero.spans import Spans
from zeropp.zero.stepping import Stepping
from zeropp.zero.state import EnginePhase, EngineState
from zeropp.zero.strategies import Strategies
from zeropp.zero.timing import StepTimer
from zeropp.zero.unit_build import build_units, cast_buffers, cut_copies


class _Delegated:
    """An engine attribute that is one of its parts' (``part.name``), read-only unless ``writable``."""

    def __init__(self, part: str, name: str, doc: str, writable: bool = False) -> None:
        self.part, self.name, self.writable, self.__doc__ = part, name, writable, doc

    def __get__(self, engine: Any, owner: Any = None) -> Any:
        return self if engine is None else getattr(getattr(engine, self.part), self.name)

    def __set__(self, engine: Any, value: Any) -> None:
        if not self.writable:
            raise AttributeError(f"engine.{self.name} is read-only (it is engine.{self.part}.{self.name})")
        setattr(getattr(engine, self.part), self.name, value)


class _Over:
    """An engine method that is a function over its state and the named parts (``fn(state, *parts)``)."""

    def __init__(self, fn: Callable[..., Any], *parts: str) -> None:
        self.fn, self.parts, self.__doc__ = fn, parts, fn.__doc__

    def __get__(self, engine: Any, owner: Any = None) -> Any:
        if engine is None:
            return self
        return lambda: self.fn(engine.state, *(getattr(engine, p) for p in self.parts))


def _state_views(*names: str, writable: tuple[str, ...] = ()) -> Callable[[type], type]:
    """The engine shows these fields of its state as its own attributes (``engine.units`` is
    ``engine.state.units``; Note [engine state]), read-only but for ``writable``."""
    def add(cls: type) -> type:
        for name in names + writable:
            setattr(cls, name, _Delegated("state", name, f"``state.{name}`` (zero/state.py)", name in writable))
        return cls
    return add


@_state_views("units", "topo", "ledger", "comm", "timer", "policy", "plan", "shard_world", "residency", "link",
              "config", writable=("strategies", "micro_steps", "global_steps"))
class ZeroEngine(nn.Module):
    """Wraps a model for ZeRO training (stage 0-3); build it with :func:`zeropp.api.build` (or
    :func:`zeropp.initialize`, which returns it with DeepSpeed's accessors: ``zeropp/deepspeed/runtime/engine.py``).

    ``loss = engine(batch)``, ``engine.backward(loss)``, ``engine.step()``. It is an ``nn.Module`` whose one child
    is the model (``engine.module``: its parameters are ``engine.named_parameters()`` under ``module.``), and an
    attribute it lacks is the model's. Checkpoints are not here: the functions of ``zeropp.checkpoint`` read and
    write the state this class exposes (this module must never import ``zeropp.checkpoint``:
    tests/unit/test_layers.py).
    """

    #: ``forward`` casts floating-point inputs to the compute dtype (a subclass may leave them as given)
    casts_inputs = True

    def __init__(
        self,
        module: nn.Module,
        topo: Topology,
        ledger: CommLedger,
        strategies: Strategies,
        policy: TrainPolicy,
        make_optimizer: Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer],
        make_scheduler: Callable[[torch.optim.Optimizer], Any] = lambda opt: None,
        trainable: Optional[set[int]] = None,
        config: Any = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        residency: Optional[Resident] = None,
        link: Optional[HostLink] = None,
        compiled_call: Optional[Callable[..., Any]] = None,
    ) -> None:
        nn.Module.__init__(self)
        self.module = module
        # a model compiled whole: its wrapper runs the forward, held outside the module tree so that names stay
        # the model's (Note [compiled regions] in zero/compiled.py)
        self.__dict__["_compiled_call"] = compiled_call
        budget = PrefetchBudget(policy.max_live_parameters, policy.prefetch_bucket_size,
                                torch.empty((), dtype=policy.compute_dtype).element_size())
        state = self.__dict__["state"] = EngineState(
            topo, ledger, Comm(topo, ledger), StepTimer(ledger), policy, strategies, residency or Resident(),
            link or HostLink(), budget, config)
        cast_buffers(module, policy.compute_dtype)
        if strategies.frozen_units is not None and (not state.plan.shards_weights or policy.offload_param
                                                     or state.residency.swaps_states):
            raise ValueError("zero_quantized_nontrainable_weights: frozen weights are kept quantized in stage 3's "
                             "shards on the compute device; it needs stage 3 without offload_param or NVMe")
        built = build_units(state, module, param_init_fn, trainable)
        state.set_units(built.units)
        state.kept = KeptUnits(persistent_units(state.units, policy.persistence_threshold,
                                                policy.model_persistence_threshold)
                               if state.plan.shards_weights else frozenset())  # Note [persistent units]
        self.gathers = Gathers(state)
        self.spans = Spans()
        self.releases = Releases(state, self.gathers, self.spans)
        # stage 3: reads of a parameter outside its unit's forward (Note [external reads])
        self.use = ParamUse(state, module, self.gathers, self.releases, self.spans) \
            if state.plan.shards_weights else None
        self.grads = GradIntake(state)
        self.hooks = ModuleHooks(state, self.gathers, self.releases, self.spans, self.use, self.grads)
        for unit, owner, whole in built.modules:
            self.hooks.attach(unit, owner, whole)
        if policy.coalesced_prefetch_asked and state.plan.shards_weights and not any(
                coalesces(state, s) for s in (strategies.forward_gather, strategies.backward_gather)):
            warnings.warn("zero_optimization.zeropp_coalesced_prefetch: no effect with this setup; it groups "
                          "plain one-hop gathers only (not two-hop gathers across nodes, qwZ, hpZ, quantized "
                          "frozen weights or NVMe shards)", ConfigWarning, stacklevel=3)
        if not state.plan.shards_weights:
            self.gathers.gather_resident(Phase.OTHER)
        self.stepper = OptimizerStep.build(state, make_optimizer, make_scheduler, built.trainable, self.gathers)
        # ZeRO-R's residual memory (zero/reports.py): saved activations, the weights' storages read once (a weight
        # keeps its storage object while it is resized; storages_moved() looks again)
        self.activations = ActivationMeter(self.module)
        self.stepping = Stepping(state, self.stepper, self.grads, self.gathers, self.releases, self.activations)
        if state.plan.shards_weights and strategies.forward_gather.keeps_copies:
            cut_copies(state, self.gathers)
        ledger.reset()  # set-up traffic is not a training step
        state.timer.reset()
        gathered.track(self)  # so zeropp.zero.GatheredParameters finds the engine of a parameter

    # ---- public training API -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward, gathering each unit's weights just in time."""
        state = self.state
        cast = lambda t: (  # noqa: E731 - floating inputs follow the compute dtype, as the weights do
            t.to(state.policy.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        )
        with state.timer.span("forward"):  # the engine's own work is in a span: untracked is the caller's
            if self.casts_inputs:
                args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
            self.gathers.begin(Pass.FORWARD)
            run = self.module if self._compiled_call is None else self._compiled_call
            learning = self.is_compiled and state.global_steps == 0  # Note [compiled regions]: step 1 runs eagerly
            with self.stepping.running(EnginePhase.FORWARD, quiet=self._runs_quiet()), \
                    compiled_regions.force_eager() if learning else contextlib.nullcontext():
                if self.use is None:
                    with contextlib.nullcontext() if state.quiet else self.activations.watching():
                        return run(*args, **kwargs)  # Note [activation meter]
                try:
                    with self._watch():
                        out = run(*args, **kwargs)
                finally:
                    self.gathers.drain(Pass.FORWARD)
                    self.releases.sweep(Pass.FORWARD)  # a unit whose forward raised is still gathered
            state.strategies.forward_gather.check_deferred()  # Note [deferred weight checks] in plus/qwz.py
            return out

    def _runs_quiet(self) -> bool:
        """Whether this pass runs compiled code without the watches (Note [compiled regions]): compiled, past
        the first optimizer step."""
        return self.is_compiled and self.state.global_steps > 0

    @contextlib.contextmanager
    def _watch(self) -> Iterator[None]:
        """Stage 3's watches over a pass: all of them (the meter chains to the weights' saved-tensor hooks), or,
        for compiled code, none that Dynamo would trace (Note [compiled regions])."""
        assert self.use is not None
        if not self.state.quiet:
            with self.use.watching(), self.activations.watching():
                yield
            return
        with torch._C.DisableTorchFunction(), self.use.quiet():
            yield

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale); ``scale_wrt_gas=False``
        (DeepSpeed's keyword): of ``loss`` as given, already scaled for the accumulation by the caller.

        Stages 2-3 reduce gradients into the owning shards as they appear; stages 0-1 accumulate them whole.
        """
        state = self.state
        with state.timer.span("backward"):
            # the fp16 loss scale, the accumulation's mean and the reduction's pre-division, in one product
            gas = state.policy.gradient_accumulation_steps if scale_wrt_gas else 1
            factor = self.loss_scale / (gas * state.policy.grad_predivide)
            self.stepping.begin_backward(quiet=self._runs_quiet())
            self.grads.begin_backward()
            self.gathers.begin(Pass.BACKWARD)
            watch = self._watch() if self.use is not None else contextlib.nullcontext()
            if self.use is not None and state.quiet:  # a compiled graph reads the weights it saved hook-free
                for unit in self.spans.with_spans():
                    self.gathers.gather(unit, Pass.BACKWARD)
            try:
                with watch:
                    (loss * factor if factor != 1.0 else loss).backward()
            finally:
                self.stepping.finish_backward()

    # ---- the accumulation window and the optimizer step (zero/stepping.py) ---------------------------------
    step = _Delegated("stepping", "step", "Count a micro-step; at an accumulation boundary, step the optimizer")
    is_gradient_accumulation_boundary = _Delegated("stepping", "is_boundary",
                                                   "Whether the next step() steps the optimizer")
    force_boundary = _Delegated("stepping", "force_boundary", "Make the next step() calls step the optimizer or not")
    step_applied = _Delegated("stepping", "step_applied", "Whether the last step() updated the weights")
    finish_backward = _Delegated("stepping", "finish_open_backward", "Close a backward still open, if any")
    step_optimizer_now = _Delegated("stepping", "step_now", "Step the optimizer now, counters and schedule unmoved")
    restart_accumulation = _Delegated("stepping", "restart_accumulation",
                                      "Make the next backward drop the gradients accumulated so far")
    restart_counts = _Delegated("stepping", "restart_counts", "Count micro-steps and optimizer steps from 0 again")

    # ---- reports (zero/reports.py: functions over the engine's state) -------------------------------------
    comm_report = _Over(reports.comm_report)
    time_report = _Over(reports.time_report)
    memory_report = _Over(reports.memory_report, "grads", "activations", "master_optimizer")
    model_state_bytes = _Over(reports.model_state_bytes, "grads", "master_optimizer")
    offload_report = _Over(reports.offload_report)

    # ---- the parts' state (zero/optimizer_step.py, config/policy.py) ----------------------------------------
    # what the parts hold, read (and the schedule replaced) through the engine
    reduce_bucket_size = _Delegated("policy", "reduce_bucket_size", "16-bit gradient elements the reduce buckets "
                                    "hold (Note [bucket size] in config/policy.py)")
    master_optimizer = _Delegated("stepper", "optimizer", "The torch optimizer over this rank's fp32 master chunks")
    optimizer = master_optimizer
    lr_scheduler = _Delegated("stepper", "scheduler", "The learning-rate schedule (a Trainer may replace it)",
                              writable=True)
    loss_scaler = _Delegated("stepper", "loss_scaler", "fp16's loss scaler (None otherwise)")
    loss_scale = _Delegated("stepper", "loss_scale", "The current fp16 loss scale (1.0 when not training in fp16)")
    grad_unscale = _Delegated("stepper", "grad_unscale", "From a reduced gradient row to the step's gradient")
    skipped_steps = _Delegated("stepper", "skipped_steps", "Optimizer steps skipped for a non-finite gradient")
    buckets = _Delegated("grads", "buckets", "The reduce buckets gradients go through (zero/buckets.py)")
    join_update = _Delegated("stepper", "join_update", "Wait for a delayed update still running and publish it "
                             "(collective; a no-op when none is pending)")
    free_gathered = _Delegated("releases", "free_everything", "Free every gathered unit now, persistent ones "
                               "included; between passes only (DeepSpeed's empty_partition_cache)")

    def was_step_skipped(self) -> bool:
        return self.stepper.skipped

    def get_global_grad_norm(self) -> Optional[float]:
        """The global gradient norm before clipping, as computed at the last optimizer step."""
        return self.stepper.global_grad_norm

    # ---- weights in and out ------------------------------------------------------------------------------
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 state dict (``model.state_dict()``'s keys) on every rank, gathered from the masters."""
        return consolidated_state_dict(self)

    def load_consolidated_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Overwrite the master weights (and 16-bit shards) from a full state dict; stale copies are dropped.

        Every entry is checked before anything is written, so a bad state dict leaves the engine unchanged.
        """
        load_consolidated_state_dict(self, state)

    @contextlib.contextmanager
    def held_whole(self) -> Iterator[None]:
        """Stage 3: gather every unit once and keep them all gathered for the block (generation: many forwards
        of one token each would otherwise gather every unit per token); collective on entry. Note [generation
        gathers]. The weights are read-only inside: train outside the block."""
        state = self.state
        if not state.plan.shards_weights or not self.releases.releasing:
            yield
            return
        whole = sum(unit_elements(u) for u in state.units)
        if whole > state.budget.max_live:
            warnings.warn(f"held_whole: the whole model's {whole * state.budget.itemsize:,} bytes of "
                          f"{state.policy.compute_dtype} weights exceed stage3_max_live_parameters "
                          f"({state.budget.max_live:,} elements); each forward gathers the units it runs "
                          "instead (slower generation)", stacklevel=3)
            yield
            return
        self.join_update()
        with self.releases.holding_whole():
            yield

    def unit_of(self, t: torch.Tensor) -> Optional[Any]:
        """Stage 3: the unit whose weights ``t`` shares storage with (a parameter, or what autograd saved of one and
        handed back as a plain tensor), else None."""
        return self.use.unit_of(t) if self.use is not None else None

    def storages_moved(self) -> None:
        """A unit's full buffers moved to new storages (``GatheredParameters`` left the old ones to aliases)."""
        self.activations.weights_moved()
        if self.use is not None:
            self.use.storages_moved()

    def masters_changed(self) -> None:
        """After the fp32 masters were overwritten outside a step (a state-dict or checkpoint load)."""
        self.stepper.publish_masters(Phase.OTHER, self.state.units)

    def unpartition(self) -> None:
        """Give the model back whole, hooks removed, and close (Note [leaving the model whole] in ``teardown.py``).
        Collective. ``initialize`` may then be called on the model again."""
        teardown.leave_whole(self)
        self.hooks.remove()
        if self.use is not None:
            self.use.remove_hooks()
        self.close()
        gathered.untrack(self)
        self.state.set_units([])  # no longer the model's: it holds its own weights

    def close(self) -> None:
        """Wait for a delayed update, delete the NVMe offload files (also done at interpreter exit) and stop
        watching reads of the partitioned weights between passes (Note [reads between passes])."""
        self.join_update()
        self.state.residency.close()
        if self.use is not None:
            idle_watch.unwatch(self.use)

    # ---- compilation and the model's attributes ------------------------------------------------------------
    def compile(self, backend: Any = "inductor", compile_kwargs: Optional[dict[str, Any]] = None) -> None:
        """``torch.compile`` of the model in place, one region per block (else the whole model), with ``backend``
        and the other ``compile_kwargs``; a second call does nothing. The first optimizer step runs eagerly,
        then compiled (Note [compiled regions] in ``zero/compiled.py``)."""
        if not self.is_compiled:
            compiled_regions.compile_model(self.module, backend, compiled_regions.without_backend(compile_kwargs))

    @property
    def is_compiled(self) -> bool:
        """Whether the model, or parts of it, run compiled (``engine.compile``, ``module.compile()``, or a
        model compiled whole before it was wrapped)."""
        return self.__dict__.get("_compiled_call") is not None or compiled_regions.compiled_parts(self.module)

    def __getattr__(self, name: str) -> Any:
        """An ``nn.Module``'s parameters, buffers and children first, then the model's attributes (a method the
        user defined on the model)."""
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and not (name.startswith("__") and name.endswith("__")):
            return getattr(module, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
