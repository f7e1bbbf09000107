"""The engine's state, one typed object its parts share (:class:`EngineState`), and where the pass is.

Note [engine state]. The engine is a set of parts (gathers, releases, external reads, gradient intake, the
optimizer step), each owning one concern; what more than one of them reads lives here, once, under one name:
the units, the topology with its comm and ledger, the timer, the resolved policy, the strategies, where states
wait (residency and link), the collective order, the prefetch budget and the persistent units. A part is handed
this state and its own few inputs; it never holds another part's state, and no part sets another part's
attribute.

Where the pass is, is one :class:`EnginePhase` (idle, forward, backward, step) and three modes that can hold
together with it. Each has exactly one writer:

* ``phase``: the engine's forward, backward and step (``ZeroEngine``);
* ``quiet`` (a pass of compiled code, run without the watches: Note [compiled regions]): the engine's passes;
* ``held_whole`` (every unit gathered and none released: generation): :class:`~zeropp.zero.release.Releases`;
* ``direct`` (the model, or a module of it, called outside the engine: Note [direct calls]): ``ParamUse``.

``tests/unit/test_engine_state.py`` checks on the source that nothing else assigns them.

Functions over an engine (reports, memory, checkpoints, ``GatheredParameters``) take this state, or the small
:class:`EngineHandle` protocol where they also call the engine (join a delayed update, publish new masters);
none imports ``zero/engine.py``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from torch import nn

from zeropp.comm.ledger import CommLedger
from zeropp.comm.ops import Comm
from zeropp.config.policy import StagePlan, TrainPolicy
from zeropp.offload.link import HostLink
from zeropp.offload.residency import Resident
from zeropp.partition.unit import Unit
from zeropp.topology import Topology
from zeropp.zero.budget import PrefetchBudget
from zeropp.zero.order_check import CollectiveOrder
from zeropp.zero.persistence import KeptUnits
from zeropp.zero.strategies import Strategies
from zeropp.zero.timing import StepTimer


class EnginePhase(enum.Enum):
    """Where the engine is: between calls, in a forward or a backward it runs, or in an optimizer step."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


@dataclass
class EngineState:
    """What the engine's parts share (Note [engine state]). Built by the engine; the units are its to set."""

    topo: Topology
    ledger: CommLedger
    comm: Comm
    timer: StepTimer
    policy: TrainPolicy
    strategies: Strategies
    residency: Resident
    link: HostLink
    budget: PrefetchBudget  # stage 3's gathered elements and the prefetch bounds
    config: Any = None  # the validated config the engine was built from (recorded in checkpoint manifests)
    order: CollectiveOrder = field(default_factory=CollectiveOrder)  # Note [collective order]
    kept: KeptUnits = field(default_factory=lambda: KeptUnits(frozenset()))  # Note [persistent units]
    units: list[Unit] = field(default_factory=list)
    stepped: list[Unit] = field(default_factory=list)  # units with gradient rows and a step (not frozen)
    mixed: frozenset[Unit] = frozenset()  # stepped units that also hold frozen parameters (NVMe offload)
    phase: EnginePhase = EnginePhase.IDLE
    quiet: bool = False  # this pass runs compiled code without watches (Note [compiled regions])
    held_whole: bool = False  # every unit gathered and kept: nothing is released (Note [generation gathers])
    direct: bool = False  # a forward called outside the engine is being watched (Note [direct calls])
    micro_steps: int = 0
    global_steps: int = 0
    plan: StagePlan = field(init=False)  # what the stage partitions

    def __post_init__(self) -> None:
        self.plan = StagePlan(self.policy.stage)

    @property
    def shard_world(self) -> int:
        """Ranks the fp32 masters and optimizer state are cut over."""
        return self.plan.shard_world(self.topo.world_size)

    @property
    def device(self) -> torch.device:
        """The compute device of the units (the host when there are none)."""
        return self.units[0].device if self.units else torch.device("cpu")

    def set_units(self, units: list[Unit]) -> None:
        """The engine's units, and the lists derived from them (the engine, at construction and teardown)."""
        self.units = units
        self.stepped = [u for u in units if u.steps]
        # units with frozen parameters beside trainable ones (NVMe optimizer offload keeps units whole): released
        # as frozen units are, once their inputs' gradients are in (Note [frozen units in backward])
        self.mixed = frozenset(u for u in self.stepped if any(not s.trainable for s in u.slots))

    @property
    def in_pass(self) -> bool:
        """Whether a forward or backward of the engine is running, or a direct call is being watched."""
        return self.phase in (EnginePhase.FORWARD, EnginePhase.BACKWARD) or self.direct

    @property
    def backward_open(self) -> bool:
        return self.phase is EnginePhase.BACKWARD


class EngineHandle(Protocol):
    """What functions over an engine read and call besides its state (checkpoints, parameter states)."""

    state: EngineState
    module: nn.Module

    @property
    def master_optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def lr_scheduler(self) -> Any: ...

    @property
    def loss_scaler(self) -> Optional[Any]: ...

    micro_steps: int  # (a checkpoint load sets the counters)
    global_steps: int

    @property
    def grad_unscale(self) -> float: ...

    def unit_of(self, t: torch.Tensor) -> Optional[Unit]: ...

    def join_update(self) -> None: ...

    def masters_changed(self) -> None: ...

    def storages_moved(self) -> None: ...
