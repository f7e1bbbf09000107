"""The ZeRO engine, stages 0-3: which model states are partitioned is set by a :class:`StagePlan`.

One step under stage 3, as the engine sees it (see docs/architecture.md for the whole picture):
1. forward: a unit's pre-forward hook gathers its weights (``strategies.forward_gather``) and prefetches
   the unit that ran next last time; its post-forward hook hooks the outputs for backward and releases.
2. backward: the first gradient reaching a unit's outputs gathers it again (``strategies.backward_gather``);
   each parameter's post-accumulate-grad hook hands the full gradient to the buckets, and the unit is
   released once all its gradients are in. Full buckets are reduced (``strategies.reduce``) into shards.
3. step (at an accumulation boundary): fp32 gradients, global-norm clipping, optimizer step on the fp32
   master shards, recast to the 16-bit shards, version bump (which makes any hpZ copy stale).

Stages 0-2 keep the full 16-bit weights resident (no hooks, no per-module gathers) and gather them once
after each optimizer step; stages 0-1 keep full gradients until the boundary and reduce them once there.
Stage 0 "shards" over a group of one: every rank holds the whole master and optimizer state.

The engine holds no ZeRO++ flag: which gather and reduce run is decided by the strategies it is handed.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.hooks import RemovableHandle

from zeropp.comm.ledger import CommLedger, Phase
from zeropp.comm.ops import Comm
from zeropp.offload.link import HostLink
from zeropp.offload.residency import Resident
from zeropp.partition import listeners
from zeropp.partition.assign import is_leaf, plan_units
from zeropp.zero.construction import PARAMS
from zeropp.partition.meta import MetaMaterializer
from zeropp.zero.values import Plan, UnitValues, agreed_rng
from zeropp.zero.strategies import Strategies
from zeropp.config.loader import ConfigWarning
from zeropp.config.policy import StagePlan, TrainPolicy
from zeropp.partition.unit import FrozenUnit, Unit, UnitState, check_requires_grad
from zeropp.topology import Topology
from zeropp.zero import gathered
from zeropp.zero import compiled as compiled_regions
from zeropp.zero.consolidated import consolidated_state_dict, load_consolidated_state_dict
from zeropp.zero.memory import ActivationMeter, GatheredWeights, unit_elements, weight_storages
from zeropp.zero.grad_intake import GradIntake
from zeropp.zero.optimizer_step import OptimizerStep
from zeropp.zero.order_check import CollectiveOrder
from zeropp.zero import idle_watch
from zeropp.zero import teardown
from zeropp.zero.param_use import ParamUse, unwatched
from zeropp.zero.persistence import KeptUnits, persistent_units
from zeropp.zero.gathers import Gathers, Pass
from zeropp.zero import reports
from zeropp.zero.timing import StepTimer, format_time_report

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
        self.residency = residency or Resident()  # where model states wait between uses (NVMe or memory)
        self.link = link or HostLink()  # how offloaded rows cross between device and host
        self.config = config  # the validated config it was built from (recorded in checkpoint manifests)
        self.topo = topo
        self.ledger = ledger
        self.comm = Comm(topo, ledger)
        self.timer = StepTimer(ledger)  # Note [time report]
        self.strategies = strategies
        self.policy = policy
        self.plan = StagePlan(policy.stage)
        self._cast_buffers(policy.compute_dtype)
        self.shard_world = self.plan.shard_world(topo.world_size)
        if strategies.frozen_units is not None and (not self.plan.shards_weights or policy.offload_param
                                                     or self.residency.swaps_states):
            raise ValueError("zero_quantized_nontrainable_weights: frozen weights are kept quantized in stage 3's "
                             "shards on the compute device; it needs stage 3 without offload_param or NVMe")
        self.hooks: list[RemovableHandle] = []  # on the model and its parameters: removed by destroy()
        self.units, trainable = self._build_units(module, param_init_fn, trainable)
        self._stepped = [u for u in self.units if u.steps]  # units with gradient rows and a step (not frozen)
        # units with frozen parameters beside trainable ones (NVMe optimizer offload keeps units whole): released
        # as frozen units are, once their inputs' gradients are in (Note [frozen units in backward])
        self._mixed = frozenset(u for u in self._stepped if any(not s.trainable for s in u.slots))
        self.kept = KeptUnits(persistent_units(self.units, policy.persistence_threshold,
                                               policy.model_persistence_threshold)
                              if self.plan.shards_weights else frozenset())  # Note [persistent units]
        # stage 3: reads of a parameter outside its unit's forward (Note [external reads])
        self.use = ParamUse(module, self.units, lambda u: self.gathers.gather(u, self._pass()),
                            lambda u: self.gathers.release(u, self._pass()),
                            lambda: self._backward_open) if self.plan.shards_weights else None
        self.order = CollectiveOrder()  # Note [collective order]
        self.grads = GradIntake(strategies.reduce, self.order, stepped=self._stepped, policy=policy, plan=self.plan,
                                topo=topo, comm=self.comm, residency=self.residency,
                                link=self.link if policy.offload_optimizer else HostLink())
        self.gathered_weights = GatheredWeights(policy.max_live_parameters, policy.prefetch_bucket_size,
                                                torch.empty((), dtype=policy.compute_dtype).element_size())
        self.gathers = Gathers(self.units, lambda: self.strategies, residency=self.residency, link=self.link,
                               timer=self.timer, collectives=self.order, kept=self.kept,
                               gathered_weights=self.gathered_weights, coalesce=policy.coalesced_prefetch)
        if policy.coalesced_prefetch_asked and self.plan.shards_weights and not any(
                self.gathers.coalesces(s) for s in (strategies.forward_gather, strategies.backward_gather)):
            warnings.warn("zero_optimization.zeropp_coalesced_prefetch: no effect with this setup; it groups "
                          "plain one-hop gathers only (not two-hop gathers across nodes, qwZ, hpZ, quantized "
                          "frozen weights or NVMe shards)", ConfigWarning, stacklevel=3)
        if not self.plan.shards_weights:
            self.gathers.gather_resident(Phase.OTHER)
        self._build_optimizer(make_optimizer, make_scheduler, trainable)
        # ZeRO-R's residual memory (zero/memory.py): saved activations, gathered weights and the prefetch bound
        # once: a weight keeps its storage object while it is resized (storages_moved() looks again)
        self._weight_storages = weight_storages(self.module)
        self.activations = ActivationMeter(lambda: self._weight_storages)
        self._init_step_state()
        if self.plan.shards_weights and strategies.forward_gather.keeps_copies:
            self._cut_copies()
        self.ledger.reset()  # set-up traffic is not a training step
        self.timer.reset()
        gathered.track(self)  # so zeropp.zero.GatheredParameters finds the engine of a parameter

    # ---- construction ------------------------------------------------------------------------------------
    def _build_optimizer(self, make_optimizer: Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer],
                         make_scheduler: Callable[[torch.optim.Optimizer], Any], trainable: Optional[set[int]]) -> None:
        """The optimizer over the fp32 master views of the trainable parameters, and its schedule."""
        masters = [
            (slot.name, view)
            for u in self._stepped
            for slot, view in zip(u.slots, u.master_views())
            if slot.param.requires_grad and (trainable is None or id(slot.param) in trainable)
        ]
        optimizer = make_optimizer(masters)
        self.stepper = OptimizerStep(
            optimizer, make_scheduler(optimizer), stepped=self._stepped, policy=self.policy, plan=self.plan,
            topo=self.topo, comm=self.comm, order=self.order, residency=self.residency, link=self.link,
            timer=self.timer, copy_back=self.gathers.copy_back, gather_resident=self.gathers.gather_resident,
            step_number=lambda: self.global_steps, grads=self.grads)
        self.residency.attach(optimizer, self.stepper.optimized)

    def _init_step_state(self) -> None:
        """The bookkeeping of passes, accumulation windows and steps, as before the first forward."""
        self._boundary_override: Optional[bool] = None  # force_boundary()
        self._quiet = False  # this pass runs compiled code without watches (Note [compiled regions])
        self._backward_open = False
        self._restart_pending = False  # restart_accumulation(): the next backward drops the gradients first
        self._step_applied = False  # the last step() updated the weights
        self.micro_steps = 0
        self.global_steps = 0

    def _cut_copies(self) -> None:
        """Note [hpZ slices at initialize] in ``plus/hpz.py``: gather each unit once through the forward strategy
        and release it, one unit at a time, so that the copies its release keeps exist from the start."""
        gather = self.strategies.forward_gather
        for unit in self.units:
            if unit.state is UnitState.SHARDED and self.residency.shard_in(unit):
                self.gathers.land(unit, gather.start(unit, Phase.OTHER))
                gather.on_release(unit)
                unit.release()
        gather.settle()

    def _cast_buffers(self, dtype: torch.dtype) -> None:
        for buf_owner in self.module.modules():
            for name, buf in buf_owner.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(buf_owner, name, buf.to(dtype))

    def _build_units(
        self, module: nn.Module, param_init_fn: Optional[Callable[[nn.Module], None]],
        trainable: Optional[set[int]],
    ) -> tuple[list[Unit], Optional[set[int]]]:
        """Cut every unit's parameters into shards, with the values every rank agrees on (Note [one model at
        initialize] in ``zero/values.py``); a meta-device model is materialized unit by unit.

        Returns the units and ``trainable`` with meta parameters' ids mapped to their replacements.
        """
        shard_rank = self.topo.rank if self.plan.shards_optimizer else 0
        plans = plan_units(module, self.policy.gather_granularity)
        agreed = Plan.agree(self.comm, module, MetaMaterializer.needed(module), self.policy.broadcast_rank0)
        meta = None
        if agreed.meta_init or agreed.meta_alloc:
            largest = max((sum(p.numel() for _, p in plan.params) for plan in plans), default=0)
            meta = MetaMaterializer(module, param_init_fn, init=agreed.meta_init, rebuild_limit=largest)
        values = UnitValues(self.comm, agreed)
        units: list[Unit] = []
        with agreed_rng(self.comm) if agreed.meta_init else contextlib.nullcontext():
            for plan in plans:
                if meta is not None:
                    plan = meta.realize(plan)
                for params, frozen in self._split_frozen(plan.params):
                    chunks = values.chunks(plan.module_name, params, self.shard_world, shard_rank)
                    for _, p in params:
                        PARAMS.adopt(p)  # the unit owns it from here
                    unit = self._make_unit(len(units), plan.module_name, params, frozen, shard_rank, chunks)
                    if self.plan.shards_weights:
                        for _, p in params:
                            listeners.partitioned(p)
                    self.residency.adopt(unit)
                    if self.plan.shards_weights:
                        self.hooks += [plan.module.register_forward_pre_hook(self._make_pre_forward(unit)),
                                       plan.module.register_forward_hook(self._make_post_forward(unit))]
                    whole = is_leaf(plan.module)  # Note [partly used units]
                    for slot_index, slot in enumerate(unit.slots):
                        if slot.param.requires_grad and self.plan.reduces_as_ready:
                            self.hooks.append(slot.param.register_post_accumulate_grad_hook(
                                self._make_grad_hook(unit, slot_index, whole)))
                    units.append(unit)
            if meta is not None:
                meta.finish()
        values.finish(module)
        if not len(PARAMS):
            idle_watch.unwatch(PARAMS)  # nothing partitioned at construction is left unadopted
        if meta is not None and trainable is not None:
            trainable = {id(meta.replaced[pid]) if pid in meta.replaced else pid for pid in trainable}
        return units, trainable

    def _split_frozen(self, params: list[tuple[str, nn.Parameter]]) -> list[tuple[list, bool]]:
        """One module's parameters as ``(params, frozen)`` unit contents: in stage 3 the trainable and the
        frozen ones apart (Note [frozen units]), else all of them in one unit. Under NVMe optimizer offload
        every unit keeps a gradient record in the swap files, so units stay whole there."""
        apart = self.plan.shards_weights and not self.residency.swaps_states
        if self.strategies.frozen_units is None and not apart:
            return [(params, False)]
        trainable = [(n, p) for n, p in params if p.requires_grad]
        frozen = [(n, p) for n, p in params if not p.requires_grad]
        return [(part, part is frozen) for part in (trainable, frozen) if part]

    def _make_unit(self, index: int, module_name: str, params: list[tuple[str, nn.Parameter]], frozen: bool,
                   shard_rank: int, chunks: Optional[list[Optional[torch.Tensor]]] = None) -> Unit:
        if frozen and self.strategies.frozen_units is not None:
            return self.strategies.frozen_units.make_unit(index, module_name, params, self.shard_world, shard_rank,
                                                          self.policy.compute_dtype, chunks)
        # A delayed update writes the masters while the next forward gathers the shard, and NVMe moves
        # shards and masters separately: never alias them then. Masters on NVMe: keep a 16-bit shard to
        # rebuild resident weights from (stages 1-2). A frozen unit is never stepped: no upload to stage.
        swaps = self.residency.swaps_shards or self.residency.swaps_states
        kind = FrozenUnit if frozen else Unit
        return kind(index, module_name, params, self.shard_world, shard_rank, self.policy.compute_dtype,
                    keep_shard=self.plan.shards_weights or self.residency.swaps_states,
                    alias_fp32_shard=self.policy.delayed_update_after is None and not swaps,
                    host_masters=self.policy.offload_optimizer, host_shard=self.policy.offload_param,
                    host_zeros=self.link.host_zeros, staged_copy_back=self.link.distinct and not frozen,
                    chunks=chunks)

    # ---- hooks -------------------------------------------------------------------------------------------
    def _pass(self) -> Pass:
        return Pass.BACKWARD if self._backward_open else Pass.FORWARD

    def _make_pre_forward(self, unit: Unit) -> Callable:
        @compiled_regions.eager
        @unwatched
        def hook(module: nn.Module, args: Any) -> None:
            current = self._pass()
            again = (self.use is not None and current is Pass.FORWARD and unit.state is UnitState.SHARDED
                     and self.use.released_in_this_pass(unit))
            self.gathers.gather(unit, current)
            if again:  # a module called twice: keep it for the second call next time
                self.use.learn(unit, unit.module_name)
        return hook

    def _make_post_forward(self, unit: Unit) -> Callable:
        @compiled_regions.eager
        @unwatched
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            use = self.use
            assert use is not None  # stage 3, whose units have these hooks, watches its reads
            if torch.is_grad_enabled():
                # gathered again before the module's backward, frozen or not: what autograd saved of the weights
                # may have been packed by another library's saved-tensor hooks (Note [frozen units in backward])
                if unit.needs_grad() or use.backward_reads(module, unit, args):
                    self._hook_outputs_for_backward(unit, output)
                if not unit.needs_grad() or unit in self._mixed:
                    use.hold_until_inputs_grad(unit, args)
            if use.defer(unit):
                return
            self.gathers.release(unit, self._pass())
        return hook

    def _hook_outputs_for_backward(self, unit: Unit, output: Any) -> None:
        def on_output_grad(grad: torch.Tensor) -> torch.Tensor:
            if unit.state is UnitState.SHARDED:
                self.gathers.gather(unit, Pass.BACKWARD)
            return grad

        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_output_grad)

    def _make_grad_hook(self, unit: Unit, slot_index: int, whole: bool) -> Callable:
        """``whole``: the unit is a leaf module's (Note [partly used units])."""
        @unwatched
        def hook(param: nn.Parameter) -> None:
            grad, param.grad = param.grad, None
            if self.grads.arrive(unit, slot_index, grad, whole) and self.plan.shards_weights \
                    and unit not in self._mixed:
                self.gathers.release(unit, Pass.BACKWARD)
        return hook

    # ---- public training API -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward, gathering each unit's weights just in time."""
        cast = lambda t: (  # noqa: E731 - floating inputs follow the compute dtype, as the weights do
            t.to(self.policy.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        )
        with self.timer.span("forward"):  # the engine's own work is in a span: untracked is the caller's
            if self.casts_inputs:
                args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
            self.gathers.begin(Pass.FORWARD)
            run = self.module if self._compiled_call is None else self._compiled_call
            compiled = self.is_compiled
            learning = compiled and self.global_steps == 0  # Note [compiled regions]: the first step runs eagerly
            self._quiet = compiled and not learning
            with compiled_regions.force_eager() if learning else contextlib.nullcontext():
                if self.use is None:
                    with contextlib.nullcontext() if self._quiet else self.activations.watching():
                        return run(*args, **kwargs)  # Note [activation meter]
                try:
                    with self._watch():
                        out = run(*args, **kwargs)
                finally:
                    self.gathers.drain(Pass.FORWARD)
                    for unit in self.units:  # a unit whose forward raised is still gathered
                        self.gathers.release(unit, Pass.FORWARD)
            self.strategies.forward_gather.settle()  # Note [deferred weight checks] in plus/qwz.py
            return out

    @contextlib.contextmanager
    def _watch(self) -> Iterator[None]:
        """Stage 3's watches over a pass: all of them (the meter chains to the weights' saved-tensor hooks), or,
        for compiled code, none that Dynamo would trace (Note [compiled regions])."""
        assert self.use is not None
        if not self._quiet:
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
        with self.timer.span("backward"):
            # the fp16 loss scale, the accumulation's mean and the reduction's pre-division, in one product
            gas = self.policy.gradient_accumulation_steps if scale_wrt_gas else 1
            factor = self.loss_scale / (gas * self.policy.grad_predivide)
            if self._restart_pending:
                self.stepper.drop_gradients()
                self._restart_pending = False
            self._backward_open = True
            self.grads.begin_backward()
            self.gathers.begin(Pass.BACKWARD)
            watch = self._watch() if self.use is not None else contextlib.nullcontext()
            if self.use is not None and self._quiet:  # a compiled graph reads the weights it saved hook-free
                for unit in self.use.spans:
                    self.gathers.gather(unit, Pass.BACKWARD)
            try:
                with watch:
                    (loss * factor if factor != 1.0 else loss).backward()
            finally:
                self._finish_backward()

    @unwatched
    def _finish_backward(self) -> None:
        self.grads.finish_backward()
        if self.plan.shards_weights:
            self.gathers.drain(Pass.BACKWARD)
            for unit in self.units:
                self.gathers.release(unit, Pass.BACKWARD)
        self._backward_open = False
        self.strategies.backward_gather.settle()

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` steps the optimizer: every ``gradient_accumulation_steps`` micro-steps,
        unless :meth:`force_boundary` said otherwise (an epoch's last, shorter window)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.policy.gradient_accumulation_steps == 0

    def force_boundary(self, is_boundary: Optional[bool]) -> None:
        """Make the next ``step()`` calls step the optimizer (True) or only accumulate (False) whatever the
        micro-step count says, until called with None; the engine counts such a window as a whole one."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"the accumulation boundary is True, False or None, got {is_boundary!r}")
        self._boundary_override = is_boundary

    @property
    def step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights (False off a boundary and for a skipped step)."""
        return self._step_applied

    def finish_backward(self) -> None:
        """Close a backward still open (its gradients reduced); nothing when none is."""
        if self._backward_open:
            self._finish_backward()

    @unwatched  # the engine's own work: no torch-function mode need see the optimizer's calls
    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary, step the optimizer on the master shards."""
        boundary = self.is_gradient_accumulation_boundary()
        scale_before = self.loss_scale
        with self.timer.span("optimizer"):  # all of this call's work is in a span: untracked is the caller's
            # unfrozen since initialize: refused; frozen: refused at the boundary if it got no gradient in the window
            check_requires_grad(self.units, self.grads.got_in_window if boundary else None)
            self._step_applied = False
            if self._backward_open:
                with self.timer.span("backward"):
                    self._finish_backward()
            self.micro_steps += 1
            if not boundary:
                return
            # a shorter window (a boundary set by hand) counts as a whole one, so that micro-steps stay a multiple
            # of the accumulation at every boundary, as checkpoints expect
            gas = self.policy.gradient_accumulation_steps
            self.micro_steps = -(-self.micro_steps // gas) * gas
            after = self.policy.delayed_update_after
            self._step_window(delayed=after is not None and self.global_steps >= after)
            self._step_applied = not self.stepper.skipped
        self.global_steps += 1
        self.strategies.reduce.end_step(self.loss_scale / scale_before)
        self.ledger.close_step()
        self.timer.close_step()
        self.activations.close_step()
        self.gathered_weights.close_step()
        if self.policy.print_every and self.global_steps % self.policy.print_every == 0 and self.topo.rank == 0:
            print(f"[zeropp] {format_time_report(self.timer.report(), self.global_steps)}", flush=True)

    def _step_window(self, delayed: bool, schedule: bool = True) -> None:
        """The optimizer step that closes an accumulation window (stages 0-1 reduce their whole gradients
        first); ``schedule=False`` leaves the learning-rate schedule where it is."""
        if not self.plan.reduces_as_ready:
            self.grads.reduce_whole(self.units)
        if delayed:
            self.join_update()  # the previous step's update becomes the next forward's weights
        self.stepper.step(background=delayed, schedule=schedule)  # raises if the ranks' collectives differed
        if self.plan.shards_weights:
            self.gathers.regroup()  # from gathers the step's check found the same on every rank
        self.grads.close_window()
        self._restart_pending = False  # the step cleared the gradients

    @unwatched
    def step_optimizer_now(self) -> None:
        """Step the optimizer on the gradients accumulated so far, whatever the micro-step count (DeepSpeed's
        ``engine.optimizer.step()``). The step counters and the learning-rate schedule do not advance: that is
        ``step()``'s part. Collective, as a boundary's step."""
        scale_before = self.loss_scale
        with self.timer.span("optimizer"):
            self.finish_backward()
            self.join_update()
            self._step_window(delayed=False, schedule=False)
        self.strategies.reduce.end_step(self.loss_scale / scale_before)

    def restart_accumulation(self) -> None:
        """Make the next ``backward`` start a new accumulation (DeepSpeed's ``optimizer.zero_grad()``): the
        gradients accumulated since the last optimizer step are dropped as it begins. Until then they stay as they
        are, readable and steppable, as DeepSpeed keeps them."""
        self._restart_pending = True

    # ---- reports (zero/reports.py: functions over the engine's state) -------------------------------------
    comm_report = reports.comm_report
    time_report = reports.time_report
    memory_report = reports.memory_report
    model_state_bytes = reports.model_state_bytes
    offload_report = reports.offload_report

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

    def join_update(self) -> None:
        """Wait for a delayed update still running and publish it (collective; a no-op when none is pending)."""
        self.stepper.join_update()

    def was_step_skipped(self) -> bool:
        return self.stepper.skipped

    def get_global_grad_norm(self) -> Optional[float]:
        """The global gradient norm before clipping, as computed at the last optimizer step."""
        return self.stepper.global_grad_norm

    def restart_counts(self) -> None:
        """Count micro-steps and optimizer steps from 0 again, keeping the weights, the optimizer's state and
        the schedule: a new run over the trained model (a Trainer's second ``train()``), whose checkpoints are
        then tagged with its own step numbers. Only between steps, at an accumulation boundary."""
        gas = self.policy.gradient_accumulation_steps
        if self._backward_open or self.micro_steps % gas:
            raise RuntimeError(f"restart_counts: inside an accumulation window ({self.micro_steps % gas} of {gas} "
                               "micro-steps taken); call it after the window's step()")
        self.join_update()  # a delayed update lands before the counters stop saying one is pending
        self.micro_steps = self.global_steps = 0

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
        if not self.plan.shards_weights or self.gathers.held_whole:
            yield
            return
        whole = sum(unit_elements(u) for u in self.units)
        if whole > self.gathered_weights.max_live:
            warnings.warn(f"held_whole: the whole model's {whole * self.gathered_weights.itemsize:,} bytes of "
                          f"{self.policy.compute_dtype} weights exceed stage3_max_live_parameters "
                          f"({self.gathered_weights.max_live:,} elements); each forward gathers the units it runs "
                          "instead (slower generation)", stacklevel=3)
            yield
            return
        self.join_update()
        held = self.gathers.gather_all()
        self.gathers.held_whole = True
        try:
            yield
        finally:
            self.gathers.held_whole = False
            self.gathers.free_all(held)

    def free_gathered(self) -> None:
        """Free every gathered unit now, persistent ones included (the next use gathers them again); between
        passes only. DeepSpeed's ``empty_partition_cache``. Below stage 3 the weights are resident, not
        gathered: nothing to free."""
        if not self.plan.shards_weights:
            return
        if self._backward_open or (self.use is not None and self.use.active) or self.gathers.held_whole:
            raise RuntimeError("free_gathered (empty_partition_cache): call it between steps, not inside a forward, "
                               "a backward or a GatheredParameters / held_whole block")
        for unit in self.units:
            if unit.state is UnitState.GATHERED:
                self.gathers.free(unit)

    def storages_moved(self) -> None:
        """A unit's full buffers moved to new storages (``GatheredParameters`` left the old ones to aliases)."""
        self._weight_storages = weight_storages(self.module)
        if self.use is not None:
            self.use.storages_moved()

    def masters_changed(self) -> None:
        """After the fp32 masters were overwritten outside a step (a state-dict or checkpoint load)."""
        self.stepper.publish_masters(Phase.OTHER, self.units)

    def unpartition(self) -> None:
        """Give the model back whole, hooks removed, and close (Note [leaving the model whole] in ``teardown.py``).
        Collective. ``initialize`` may then be called on the model again."""
        teardown.leave_whole(self)
        self.units = self.gathers.units = []  # no longer the model's: it holds its own weights
        self._stepped.clear()  # (the parts share this list)

    def close(self) -> None:
        """Wait for a delayed update, delete the NVMe offload files (also done at interpreter exit) and stop
        watching reads of the partitioned weights between passes (Note [reads between passes])."""
        self.join_update()
        self.residency.close()
        if self.use is not None:
            idle_watch.unwatch(self.use)

    # ---- compilation and the model's attributes ------------------------------------------------------------
    def compile(self, backend: Any = "inductor", compile_kwargs: Optional[dict[str, Any]] = None) -> None:
        """``torch.compile`` of the model in place, one region per block (else the whole model), with ``backend``
        and the other ``compile_kwargs``; a second call does nothing. The first optimizer step runs eagerly,
        then compiled (Note [compiled regions] in ``zero/compiled.py``)."""
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            warnings.warn("engine.compile: the backend in compile_kwargs is overridden by the backend argument",
                          stacklevel=2)
            del kwargs["backend"]
        compiled_regions.compile_model(self.module, backend, kwargs)

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
