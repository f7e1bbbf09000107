"""Gather units: the parameters gathered and released together, with their flat shard buffers.

A unit owns, on this rank, one flat row of each kind (see Note [shard layout] in ``spec.py``):
``shard`` (compute dtype, what is all-gathered), ``master`` (fp32, what the optimizer steps; the same
tensor as ``shard`` when computing in fp32) and ``grad`` (compute dtype, the reduced gradient shard).
Each parameter keeps its identity and shape; its data is a view of a padded full-size buffer whose
storage is freed (resized to 0) while the unit is sharded, so autograd metadata never changes.

Note [released storage]: a released parameter keeps its shape over a storage of 0 bytes, whose data pointer
is null; a native kernel handed it reads through that pointer and the process dies with SIGSEGV, no message.
DeepSpeed swaps a released parameter's data for a tensor of shape ``[0]``, so a stray kernel fails a size
check instead, at the price of every metadata read (``weight.shape`` in a module's ``__init__``-time logic,
``numel()`` in a parameter count, the optimizer's views) seeing ``[0]``, which is why it carries ``ds_shape``
and ``ds_numel`` beside it. zeropp keeps the true shape and keeps released storage away from native code by
what sees every call instead:

* the rule: while an engine is alive, no torch call that reaches a released storage goes unseen. Both
  torch-function watches stay on through the Python that torch functions run (Note [watches stay on] in
  ``zero/idle_watch.py``: the backward, its hooks, custom ``Function`` backwards and recomputed forwards ran
  without them before), and they look at every tensor argument, not only the parameters: a tensor whose
  storage is a released unit's (a ``detach()``, a view, a ``state_dict()`` value) counts as a read of that
  unit. Inside the engine's passes such a read gathers the unit (its storage is refilled, so the alias sees
  the weights again); between them it raises :class:`ParameterAccessError` naming the parameters.
* before a module's backward its units are gathered again, frozen ones too (Note [frozen units in backward]),
  so what autograd saved of the weights under another library's saved-tensor hooks (the checkpoint's
  recomputation, TRL's and transformers' activation offloading) is valid when the backward reads it; weights
  saved under the engine's own hooks are gathered when unpacked.
* aliases that must outlive a release: ``GatheredParameters`` counts the users of each storage it gathered;
  at exit a storage that gained users (``sd = model.state_dict()`` inside the block) is handed over to them
  (:meth:`ParamSlot.hand_over`: the parameter moves to a new empty storage) instead of freed. That costs what
  DeepSpeed's swap costs: the aliases keep the gathered weights alive until their last reference goes, and
  nothing once they are gone.

Not seen: native code called with torch functions disabled (an extension's C++ that takes the tensor
directly, code under ``torch._C.DisableTorchFunction``) and torch calls made on threads other than the one
that built the engine (the mode stack is per thread; autograd's own threads inherit it).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from zeropp.partition.spec import RowLayout, ShardSpec, take_chunk


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERED = "gathered"


@dataclass(eq=False)
class ParamSlot:
    """One parameter inside a unit: its name, spec and the padded buffer its data views."""

    name: str
    param: nn.Parameter
    spec: ShardSpec
    full: torch.Tensor  # padded 1-D buffer in compute dtype; storage freed while sharded
    trainable: bool  # requires_grad at initialize: what the engine keeps gradient rows and optimizer state for

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def users(self) -> int:
        """How many tensors hold the full buffer's storage (this buffer and the parameter among them)."""
        with torch._C.DisableTorchFunction():
            storage = self.full.untyped_storage()
            return torch._C._storage_Use_Count(storage._cdata) - 1  # less the reference just taken

    def hand_over(self) -> None:
        """Leave the gathered storage to the tensors that still view it (Note [released storage]): the
        parameter and the buffer move to a new, empty storage; the old one lives while any of those does."""
        with torch._C.DisableTorchFunction(), torch.no_grad():
            fresh = torch.empty(self.spec.padded, dtype=self.full.dtype, device=self.full.device)
            self.param.data = fresh[: self.spec.numel].view(self.spec.shape)  # views first: a storage of
            fresh.untyped_storage().resize_(0)                                 # 0 bytes takes no new view
            self.full = fresh

    def allocate(self) -> None:
        nbytes = self.spec.padded * self.full.element_size()
        if self.full.untyped_storage().nbytes() != nbytes:
            self.full.untyped_storage().resize_(nbytes)


class Unit:
    """Parameters that one module gathers before its forward/backward and releases after.

    ``version`` counts weight changes made through the engine; anything derived from the weights (the
    hpZ secondary copy) records the version it was made from and is stale once they differ.
    """

    #: False for units that keep no fp32 master (``plus/frozen.py``: frozen weights kept as int8)
    holds_master = True
    #: False for units of parameters frozen at ``initialize``: no gradient row, never stepped (:class:`FrozenUnit`)
    steps = True

    def __init__(
        self,
        index: int,
        module_name: str,
        named_params: list[tuple[str, nn.Parameter]],
        world: int,
        rank: int,
        compute_dtype: torch.dtype,
        keep_shard: bool = True,
        alias_fp32_shard: bool = True,
        device: torch.device | None = None,
        host_masters: bool = False,
        host_shard: bool = False,
        host_zeros: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None,
        staged_copy_back: bool = False,
        chunks: Optional[list[Optional[torch.Tensor]]] = None,
    ) -> None:
        """Cut each parameter's chunk ``rank`` of ``world`` into the master row and free the full weights.

        ``chunks`` gives a parameter's chunk where it does not come from the parameter's own values (rank 0's,
        or a chunk partitioned at construction: ``zero/values.py``); None entries are cut from the
        parameter.
        ``keep_shard=False`` (stages 0-2, whose full weights stay resident) keeps no 16-bit shard between
        steps: it is derived from the master when the weights are gathered after an optimizer step. In fp32
        the kept shard is the master itself unless ``alias_fp32_shard`` is False (delayed updates).
        Every row lives on ``device`` (default: the first parameter's device; the host for meta ones),
        except with ``host_masters`` (optimizer offload): the fp32 master and the gradient row live on the
        host, where the optimizer steps, and only the 16-bit shard and the full weights on the device.
        ``host_shard`` (parameter offload): the kept 16-bit shard lives on the host too and is copied to the
        device for each gather. Host rows come from ``host_zeros`` (the host link's, page-locked on CUDA).
        ``staged_copy_back`` (host masters, device memory apart from the host): the unit keeps a device
        shard at every stage and a host row in the compute dtype that the optimizer writes in its pass;
        the engine uploads it after the step (see :meth:`copy_back`).
        """
        self.index = index
        self.module_name = module_name
        self.world = world
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.state = UnitState.GATHERED
        self.version = 0
        self.slots: list[ParamSlot] = []
        self.row = RowLayout(tuple(ShardSpec(p.numel(), p.shape, world).chunk for _, p in named_params))
        first = named_params[0][1].device if named_params else torch.device("cpu")
        self.device = device or (torch.device("cpu") if first.type == "meta" else first)
        self.state_device = torch.device("cpu") if host_masters else self.device
        host = torch.device("cpu")
        self._host_zeros = host_zeros
        self.master = self._zeros(self.row.numel, torch.float32, self.state_device)
        given = chunks or [None] * len(named_params)
        for (name, p), off, c, chunk in zip(named_params, self.row.offsets, self.row.chunks, given):
            spec = ShardSpec(p.numel(), p.shape, world)
            with torch.no_grad():
                self.master[off : off + c].copy_(take_chunk(p.detach(), spec, rank, world) if chunk is None else chunk)
            full = torch.zeros(spec.padded, dtype=compute_dtype, device=self.device)
            p.data = full[: spec.numel].view(spec.shape)
            self.slots.append(ParamSlot(name, p, spec, full, p.requires_grad))
        self._shard: Optional[torch.Tensor] = None
        # the host row the optimizer writes when the shard is device memory apart from the masters
        self._staged: Optional[torch.Tensor] = None
        staged = staged_copy_back and host_masters and not host_shard
        if keep_shard or staged:
            shard_device = host if host_shard else self.device
            alias = (compute_dtype == torch.float32 and alias_fp32_shard and self.state_device == shard_device
                     and not staged)
            self._shard = self.master if alias else self._copy_of_master(shard_device)
        if staged and compute_dtype != torch.float32:  # fp32: the master itself is what goes up
            self._staged = self._copy_of_master(host)
        self._uploads_shard = staged
        # Fixed views: the optimizer keys its state by tensor identity, so they are made once.
        self._master_views = self._split(self.master)
        self.grad: Optional[torch.Tensor] = None  # allocated at first use: see grad_row()
        self._grad_views: list[torch.Tensor] = []
        self.release()

    def _zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A row of zeros; host rows come from the host link's allocator when one was given."""
        if device.type == "cpu" and self._host_zeros is not None:
            return self._host_zeros(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=device)

    def _copy_of_master(self, device: torch.device) -> torch.Tensor:
        row = self._zeros(self.row.numel, self.compute_dtype, device)
        row.copy_(self.master)
        return row

    def _split(self, row: torch.Tensor) -> list[torch.Tensor]:
        return [row[o : o + c] for o, c in zip(self.row.offsets, self.row.chunks)]

    # ---- views -----------------------------------------------------------------------------------------
    def master_views(self) -> list[torch.Tensor]:
        """Per-parameter views of the fp32 master row: what the optimizer steps (the same objects each call)."""
        return self._master_views

    def master_values(self) -> list[torch.Tensor]:
        """Per-parameter fp32 chunks to read (a unit without a master makes copies; nothing is kept)."""
        return self._master_views

    def quantized_state(self) -> Optional[torch.Tensor]:
        """The int8 row a unit keeps instead of a master and a shard (``plus/frozen.py``), else None."""
        return None

    def load_quantized_state(self, row: torch.Tensor) -> None:
        """Overwrite the int8 row that :meth:`quantized_state` returns (units that keep one)."""
        raise TypeError(f"unit {self.module_name!r} keeps no quantized row")

    def shard_row(self) -> torch.Tensor:
        """This rank's row in the compute dtype: what a gather sends (derived from the master if not kept)."""
        if self._shard is not None:
            return self._shard.to(self.device)  # the shard itself unless it is kept on the host
        return self.master.to(self.device, self.compute_dtype)  # the master itself when nothing changes

    @property
    def staged_row(self) -> Optional[torch.Tensor]:
        """The host copy-back row in the compute dtype (``staged_copy_back``, 16-bit training), else None."""
        return self._staged

    @property
    def kept_shard(self) -> Optional[torch.Tensor]:
        """The persistent 16-bit shard, or None where it is derived on demand (or is the fp32 master)."""
        return self._shard if self._shard is not self.master else None

    def grad_row(self) -> torch.Tensor:
        """The reduced gradient row (compute dtype), allocated as zeros on first use."""
        if self.grad is None:
            self.grad = self._zeros(self.row.numel, self.compute_dtype, self.state_device)
            self._grad_views = self._split(self.grad)
        return self.grad

    def grad_views(self) -> list[torch.Tensor]:
        """Per-parameter views of the reduced gradient row."""
        self.grad_row()
        return self._grad_views

    def drop_grad(self) -> None:
        """Free the gradient row (stages that reduce only at the step boundary hold none in between)."""
        self.grad, self._grad_views = None, []

    def params(self) -> Iterator[nn.Parameter]:
        return (s.param for s in self.slots)

    def needs_grad(self) -> int:
        return sum(1 for s in self.slots if s.param.requires_grad)

    def segment_names(self) -> list[str]:
        return [s.name for s in self.slots]

    def group_layout(self, group_size: int) -> RowLayout:
        """Row layout of this unit when the padded parameters are split over ``group_size`` ranks."""
        return RowLayout(tuple(s.spec.chunk_for(group_size) for s in self.slots))

    # ---- state changes -----------------------------------------------------------------------------------
    def materialize(self, gathered: torch.Tensor, layout: RowLayout) -> None:
        """Fill every parameter from gathered rows ``[..., layout.numel]`` whose leading dimensions, read in
        order, are the group's ranks (``[G, numel]``, or a two-hop gather's ``[n, D, numel]`` view)."""
        lead = gathered.shape[:-1]
        for slot, off, c in zip(self.slots, layout.offsets, layout.chunks):
            slot.allocate()
            slot.full.view(*lead, c).copy_(gathered[..., off : off + c])
        self.state = UnitState.GATHERED

    def release(self, users: Optional[dict[int, int]] = None) -> bool:
        """Free the full weights. ``users`` (slot id -> :meth:`ParamSlot.users` when gathered): a slot whose
        storage has more users now is handed over instead of freed; True if any was (its storage changed)."""
        moved = False
        for slot in self.slots:
            if users is not None and id(slot) in users and slot.users() > users[id(slot)]:
                slot.hand_over()
                moved = True
            else:
                slot.free()
        self.state = UnitState.SHARDED
        return moved

    def full_chunk_row(self, index: int, group_size: int) -> torch.Tensor:
        """While gathered: this unit's row of chunk ``index`` when split over ``group_size`` ranks."""
        layout = self.group_layout(group_size)
        return torch.cat([s.full.view(group_size, c)[index] for s, c in zip(self.slots, layout.chunks)])

    def host_shard_views(self) -> Optional[list[torch.Tensor]]:
        """Per-parameter views of the 16-bit row beside the fp32 master (the kept shard in host memory, or
        the staged copy-back row), so a host optimizer can write the recast in its own pass; else None."""
        shard = self._staged if self._staged is not None else self.kept_shard
        if shard is None or shard.device != self.master.device or shard.dtype == torch.float32:
            return None
        return self._split(shard)

    def refresh_shard_from_master(self, recast: bool = True) -> None:
        """After the optimizer changed the masters: recast the 16-bit shard (``recast=False``: the optimizer
        already wrote it) and mark derived copies stale."""
        # with an upload (copy_back), the staged row is what the host writes; fp32 uploads the master itself
        target = self._staged if self._uploads_shard else self._shard
        if recast and target is not None and target is not self.master:
            target.copy_(self.master)
        self.version += 1

    def copy_back(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """After the masters changed: ``(host row, device shard)`` to upload when the shard is device memory
        apart from the masters (``staged_copy_back``), else None (the shard was written in place)."""
        if not self._uploads_shard:
            return None
        assert self._shard is not None
        return (self._staged if self._staged is not None else self.master), self._shard


class FrozenUnit(Unit):
    """A unit of parameters frozen at ``initialize`` (Note [frozen units]): master and shard as any unit, but no
    gradient row and no optimizer step.

    Note [frozen units]: in stage 3 the engine puts a module's frozen parameters (``requires_grad=False`` at
    ``initialize``) in a unit of their own, apart from its trainable ones. Two costs go away. A unit that mixes
    them kept a gradient row for every element, frozen ones included (2 bytes per element in 16-bit training,
    zeros that were reduced and normed every step); a frozen unit keeps none. And a mixed unit was released as
    soon as its trainable parameters' gradients were in, while its frozen weights were still needed for the
    inputs' gradient, so it was gathered a second time in the same backward (LoRA on a Llama: the backward
    gather was 1.42x the forward one); a frozen unit is gathered once for its module's backward and released
    when its inputs' gradients are computed. The
    fp32 master stays, so what a checkpoint or an export holds of a frozen weight is its exact value, as before.
    A parameter made trainable after ``initialize`` is refused by name (the engine holds no gradient row and
    no optimizer state for it).

    Note [frozen units in backward]: a frozen unit is released at the end of its module's forward and gathered
    again, like a trainable one, when the gradient of its module's output arrives, before the module's
    backward reads the weights; it is released once its inputs' gradients are computed (or when backward ends,
    where no input needs one). It was gathered again only when autograd unpacked a weight saved under the
    engine's saved-tensor hooks, and a weight saved under another library's hooks never was: activation
    checkpointing recomputes the forward under its own hooks (and transformers checkpoints a layer's
    ``forward``, so the layer's unit hooks stay outside the recomputation), TRL's activation offloading keeps
    parameters raw. The recomputed forward then read released frozen weights, and a LoRA fine-tune with
    checkpointing died with SIGSEGV. Without recomputation the bytes do not change: one gather per frozen unit
    in forward and one in backward. With it the recomputed forward needs the weights again where the first
    forward's saved tensors would have carried them, so a frozen unit costs what a trainable one costs, one
    gather per pass; ``bench/bench_recompute_bytes.py`` measures it against DeepSpeed's count. A unit that keeps
    frozen parameters beside trainable ones (under NVMe optimizer offload, where units stay whole) is released
    the same way, once its inputs' gradients are in, not as soon as its trainable gradients are: the frozen
    weights are still read for the inputs' gradient after those.
    """

    steps = False

    def __init__(self, index: int, module_name: str, named_params: list[tuple[str, nn.Parameter]], *args: Any,
                 **kwargs: Any) -> None:
        trainable = [n for n, p in named_params if p.requires_grad]
        if trainable:
            raise ValueError(f"a frozen unit holds frozen parameters only; {trainable} require grad")
        super().__init__(index, module_name, named_params, *args, **kwargs)

    def needs_grad(self) -> int:
        """0; a parameter made trainable since ``initialize`` is refused (its gradient would be dropped)."""
        check_requires_grad([self])
        return 0

    def grad_row(self) -> torch.Tensor:
        """Zeros, made for the caller and not kept: a frozen unit has no gradient."""
        return torch.zeros(self.row.numel, dtype=self.compute_dtype, device=self.state_device)

    def grad_views(self) -> list[torch.Tensor]:
        return self._split(self.grad_row())


def check_requires_grad(units: Iterable[Unit],
                        got_grad: Optional[Callable[[Unit, int], bool]] = None) -> None:
    """Refuse, by name, parameters whose ``requires_grad`` changed since ``initialize`` in a way the engine
    cannot train as the user means.

    The engine sized gradient rows and optimizer state by what required grad then. A parameter unfrozen since
    would get no update (its gradient dropped): refused at once. Turning ``requires_grad`` off for some
    micro-steps of an accumulation window (DeepSpeed's "unbalanced gradients") is fine: the parameter simply
    has no gradient from those micro-steps. But one that got no gradient in a whole window (``got_grad``, given
    at the boundary) would still be updated from its optimizer state (momentum, weight decay), so a "frozen"
    weight would keep moving: refused at that boundary.
    """
    unfrozen, frozen = [], []
    for unit in units:
        for i, s in enumerate(unit.slots):
            if s.param.requires_grad and not s.trainable:
                unfrozen.append(s.name)
            elif s.trainable and not s.param.requires_grad and got_grad is not None and not got_grad(unit, i):
                frozen.append(s.name)
    if unfrozen:
        raise RuntimeError(f"parameters {unfrozen} were frozen (requires_grad=False) at zeropp.initialize and "
                           "require grad now; the engine keeps no gradient row and no optimizer state for them "
                           "(as DeepSpeed, it trains what required grad at initialize): set requires_grad "
                           "before initialize")
    if frozen:
        raise RuntimeError(f"parameters {frozen} required grad at zeropp.initialize, are frozen now and got no "
                           "gradient in this accumulation window; the engine would go on updating them from "
                           "their optimizer state (momentum, weight decay), so they would not stay frozen: set "
                           "requires_grad before initialize (leaving a parameter out of some micro-steps of a "
                           "window is fine)")
