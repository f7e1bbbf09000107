"""Where a unit's rank-local model states are while the engine is not using them (ZeRO-Infinity).

The engine is handed one of two residencies and calls the same methods either way:

* ``Resident``: everything stays in memory (on the device, or on the host under ZeRO-Offload to "cpu").
  Every method is trivial.
* ``NvmeResidency``: the 16-bit shards (``offload_param.device: "nvme"``) and/or the fp32 masters, reduced
  gradient rows and optimizer state (``offload_optimizer.device: "nvme"``) live in per-rank files and are in
  memory only around their use, each kind in a ``SwapStore`` whose budget is ``buffer_count`` buffers:

  ================  ============================================  ==========================================
  what              in memory                                      prefetched
  ================  ============================================  ==========================================
  16-bit shard      from just before its gather to the gather's    the unit after the one being prefetched,
                    end (clean: nothing written back)              in the recorded execution order
  gradient row      while a finished bucket adds into it           the next unit's, in the norm pass
  master + state    while the optimizer steps its unit, then       the next unit's record
                    written back
  ================  ============================================  ==========================================

  The optimizer steps one unit at a time (a sub-group, as DeepSpeed's ``sub_group_size`` tiles do): every
  Adam-family update is elementwise per parameter, so the result is bit for bit the one-call step's.

Files are per rank, reserved at start-up (a full disk or an unwritable path is an ``OffloadError`` naming the
config key before the first step), and deleted by ``close()``, at garbage collection or at interpreter exit.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from zeropp.config.policy import OffloadSettings
from zeropp.offload.aio import AioPool, OffloadError, _round_up
from zeropp.offload.cpu_adam import moment_storage_bytes
from zeropp.offload.swap import SwapStore
from zeropp.partition.spec import ShardSpec
from zeropp.partition.unit import Unit

__all__ = ["NvmeResidency", "Resident", "build_residency"]

STAGING_BUFFERS, STAGING_BYTES = 8, 4 << 20  # AioPool's I/O staging (and 8 I/O threads): fixed, not model state
ADAM_MOMENTS = 2  # fp32 tensors of optimizer state per element the optimizer budget is sized for


class Resident:
    """No NVMe: every model-state tensor stays where the unit put it.

    ``step_elements`` (optimizer offload to the host: ``sub_group_size``) tiles the optimizer step into groups
    of units of at most that many elements each (a unit larger than that is a group alone): the fp32 copies of
    16-bit gradient rows that a step reads are then made one group at a time (Note [host step in groups]).
    0: one group.
    """

    swaps_shards = False  # the 16-bit shards leave memory (so they are never the fp32 master itself)
    swaps_states = False  # masters, gradient rows and optimizer state leave memory
    step_elements = 0

    # Note [host step in groups]: with the optimizer on the host, the host holds per parameter the fp32 master (4
    # bytes), Adam's two moments (8), the 16-bit gradient row (2) and the 16-bit staging row the update writes for
    # the upload (2): 16 bytes, as DeepSpeed's ZeRO-Offload. A step that converted every gradient row to fp32
    # at once (and kept the copies from the norm's pass to the update's) added 4 bytes per parameter at its peak:
    # a 5.9B model's step was killed for host memory on a 128 GiB machine. In groups of ``sub_group_size``
    # elements the conversion costs one group's fp32 rows, made twice (norm, update) instead of kept.

    def __init__(self, step_elements: int = 0) -> None:
        self.step_elements = step_elements

    @property
    def caches_grads(self) -> bool:
        """Whether the step keeps each unit's fp32 gradient between its two passes (the norm, the update)
        instead of converting the row again."""
        return not self.swaps_states and not self.step_elements

    def adopt(self, unit: Unit) -> None:
        """A unit was just built."""

    def attach(self, optimizer: torch.optim.Optimizer, optimized: set[int]) -> None:
        """The optimizer over the units' master views was just built; ``optimized`` holds the ids of the
        views it updates (frozen or left-out parameters are not among them)."""

    def shard_in(self, unit: Unit, optional: bool = False) -> bool:
        """Make ``unit.shard_row()`` readable (waits for its read); False when ``optional`` and no buffer is
        free (a prefetch that is skipped)."""
        return True

    def prefetch_shard(self, unit: Unit) -> None:
        """Start reading a shard that will be gathered soon (if the budget has room)."""

    def shard_done(self, unit: Unit) -> None:
        """The gather that read the shard completed."""

    @contextlib.contextmanager
    def grads(self, unit: Unit) -> Iterator[None]:
        """The gradient row is in memory (and accumulable) inside the block."""
        yield

    def grad_pass(self, units: list[Unit]) -> Iterator[list[Unit]]:
        """Groups of units whose gradient rows are readable while the group is current."""
        yield units

    def optimizer_pass(self, units: list[Unit]) -> Iterator[list[Unit]]:
        """Groups of units to step; inside one, masters, gradients, optimizer state and shards are in
        memory; afterwards they are written back and the gradient rows are cleared."""
        if not self.step_elements:
            yield units
            return
        group: list[Unit] = []
        elements = 0
        for u in units:
            if group and elements + u.row.numel > self.step_elements:
                yield group
                group, elements = [], 0
            group.append(u)
            elements += u.row.numel
        if group:
            yield group

    def clear_grads(self, units: list[Unit], keep_rows: bool) -> None:
        """Gradient rows back to zero after the step (``keep_rows=False``: free them)."""
        for u in units:
            if keep_rows:
                u.grad_row().zero_()
            else:
                u.drop_grad()

    @contextlib.contextmanager
    def resident(self, units: list[Unit], dirty: bool = True) -> Iterator[None]:
        """Everything of ``units`` in memory inside the block (written back after, when ``dirty``)."""
        yield

    def offloaded_bytes(self) -> int:
        """Bytes of model state held in offload files."""
        return 0

    def resident_peak(self) -> int:
        """The most bytes the swap stores held in memory at once since training began (0 without NVMe)."""
        return 0

    def budget(self) -> int:
        """The most bytes the swap stores may hold in memory at once (0 without NVMe)."""
        return 0

    def files(self) -> list[str]:
        return []

    def close(self) -> None:
        """Delete the offload files."""


class NvmeResidency(Resident):
    """Shards (``params``) and/or masters, gradients and optimizer state (``states``) in offload files."""

    def __init__(self, params: Optional[SwapStore], states: Optional[SwapStore], shard_buffer_bytes: int,
                 states_buffer_count: int) -> None:
        self.params, self.states = params, states
        self.swaps_shards, self.swaps_states = params is not None, states is not None
        self.shard_buffer_bytes = shard_buffer_bytes
        self.states_buffer_count = states_buffer_count
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self._stepped: set[int] = set()  # master views the optimizer updates
        self._seen: set[int] = set()  # ... and those it has stepped at least once (their state exists)
        self._shards_in_use: set[int] = set()  # unit indices whose shard a gather is reading
        self._fetched_states: dict[int, list[str]] = {}
        self._depth = 0  # nested resident() blocks are no-ops inside an outer one

    # ---- set-up ------------------------------------------------------------------------------------------
    def adopt(self, unit: Unit) -> None:
        if self.params is not None:
            shard = unit.kept_shard
            assert shard is not None, "offloaded shards are never the master itself"
            if shard.numel() * shard.element_size() > self.shard_buffer_bytes:
                raise OffloadError(
                    f"zero_optimization.offload_param.buffer_size: unit {unit.module_name or '<root>'!r} "
                    f"holds {shard.numel():,} elements per rank, more than one buffer "
                    f"({self.shard_buffer_bytes // shard.element_size():,}); raise buffer_size")
            self.params.put(f"{unit.index}.shard", shard)
        if self.states is not None:
            record = self._record_bytes(unit)
            self.states.budget = max(self.states.budget, self.states_buffer_count * record)
            self.states.put(f"{unit.index}.master", unit.master)
            self.states.put(f"{unit.index}.grad", unit.grad_row(), zeros=True)

    @staticmethod
    def _record_bytes(unit: Unit) -> int:
        """Bytes of one unit's optimizer record: master, gradient row and Adam's two moments per parameter
        (CpuAdam places a large moment in a buffer a page longer)."""
        n = unit.row.numel
        grad = n * torch.empty((), dtype=unit.compute_dtype).element_size()
        return 4 * n + grad + ADAM_MOMENTS * sum(moment_storage_bytes(c) for c in unit.row.chunks)

    def attach(self, optimizer: torch.optim.Optimizer, optimized: set[int]) -> None:
        self.optimizer = optimizer
        self._stepped = optimized  # frozen ones get no state
        for store in self._stores():  # the budget holds from here on; start-up writes each unit as it is cut
            store.flush()
            store.reset_peak()

    # ---- 16-bit shards -----------------------------------------------------------------------------------
    def shard_in(self, unit: Unit, optional: bool = False) -> bool:
        if self.params is None:
            return True
        name = f"{unit.index}.shard"
        if not self.params.fetch(name, optional=True):
            if optional:
                return False
            self._drop_read_ahead()  # shards read ahead for a path not taken give way to one that is needed
        self.params.get(name)
        self._shards_in_use.add(unit.index)
        return True

    def _drop_read_ahead(self) -> None:
        assert self.params is not None
        for name in self.params.resident_names():
            if int(name.split(".")[0]) not in self._shards_in_use:
                self.params.release(name, dirty=False)

    def prefetch_shard(self, unit: Unit) -> None:
        if self.params is not None:
            self.params.fetch(f"{unit.index}.shard", optional=True)

    def shard_done(self, unit: Unit) -> None:
        if self.params is not None:
            self._shards_in_use.discard(unit.index)
            self.params.release(f"{unit.index}.shard", dirty=False)

    # ---- gradient rows -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def grads(self, unit: Unit) -> Iterator[None]:
        if self.states is None or self._depth:
            yield
            return
        self.states.get(f"{unit.index}.grad")
        try:
            yield
        finally:
            self.states.release(f"{unit.index}.grad", dirty=True)

    def grad_pass(self, units: list[Unit]) -> Iterator[list[Unit]]:
        if self.states is None or self._depth:
            yield units
            return
        for i, u in enumerate(units):
            self.states.get(f"{u.index}.grad")
            for ahead in units[i + 1:]:  # read ahead as far as the buffers allow: many requests in flight
                if not self.states.fetch(f"{ahead.index}.grad", optional=True):
                    break
            yield [u]
            self.states.release(f"{u.index}.grad", dirty=False)

    def clear_grads(self, units: list[Unit], keep_rows: bool) -> None:
        if self.states is None:
            super().clear_grads(units, keep_rows)
            return
        for u in units:  # the rows stay allocated objects; their contents become zeros without any I/O
            self.states.forget_contents(f"{u.index}.grad")

    # ---- optimizer records -------------------------------------------------------------------------------
    def _state_tensors(self, unit: Unit, own: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's per-element state of ``unit`` (Adam's moments; scalars such as ``step`` stay).

        ``own``: first replace a tensor the store cannot swap (one a state-dict load left sharing a loaded
        checkpoint's storage) by a private copy in the optimizer's state.
        """
        assert self.optimizer is not None
        out = []
        for slot, view in enumerate(unit.master_views()):
            state = self.optimizer.state.get(view, {})
            for key, t in list(state.items()):
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    if own and not SwapStore.can_take(t):
                        t = state[key] = t.clone(memory_format=torch.contiguous_format)
                    out.append((f"{unit.index}.{slot}.{key}", t))
        return out

    def _record_names(self, unit: Unit) -> list[str]:
        names = [f"{unit.index}.master", f"{unit.index}.grad"]
        return names + [n for n, _ in self._state_tensors(unit) if n in self.states]  # type: ignore[operator]

    def _record_in(self, unit: Unit, read_shard: bool) -> None:
        if self.states is not None:
            names = self._record_names(unit)
            for name in names:
                self.states.get(name)
            self._fetched_states[unit.index] = names
        if self.params is not None:  # a step recasts the shard from the master: nothing to read then
            self.params.get(f"{unit.index}.shard", read=read_shard)

    def _record_out(self, unit: Unit, dirty: bool, grad_zeros: bool = False) -> None:
        if self.states is not None:
            self.states.release(f"{unit.index}.master", dirty=dirty)
            current = self._state_tensors(unit, own=dirty)
            for name, t in current:
                if dirty:
                    self.states.put(name, t)  # new tensors (a first step, a state-dict load) are taken over
                else:
                    self.states.release(name, dirty=False)
            kept = {name for name, _ in current}
            for name in self._fetched_states.pop(unit.index, []):
                if name not in kept and name not in (f"{unit.index}.master", f"{unit.index}.grad"):
                    self.states.discard(name)  # state a loaded state dict did not have
                    self._seen.discard(id(unit.master_views()[int(name.split(".")[1])]))
            self.states.release(f"{unit.index}.grad", dirty=dirty, zeros=grad_zeros)
        if self.params is not None:
            self.params.release(f"{unit.index}.shard", dirty=dirty)

    def optimizer_pass(self, units: list[Unit]) -> Iterator[list[Unit]]:
        if self._depth:
            yield units
            return
        for i, u in enumerate(units):
            self._record_in(u, read_shard=False)
            try:
                if self.states is not None:
                    self.states.reserve(self._missing_state_bytes(u))  # a first step creates the moments
                    self._read_ahead(units[i + 1:])
                yield [u]
                self._seen.update(id(v) for v in u.master_views())
            finally:  # after an error too: the record goes back out and the reservation is dropped
                self._record_out(u, dirty=True, grad_zeros=True)  # the step consumed the gradients
                if self.states is not None:
                    self.states.unreserve()

    def _read_ahead(self, units: list[Unit]) -> None:
        """Start reading the next units' records, in order, while the buffers have room. Not past a unit
        whose optimizer state does not exist yet (a first step): its moments need the room when it steps."""
        assert self.states is not None
        for u in units:
            if self._missing_state_bytes(u) or not all(
                    self.states.fetch(name, optional=True) for name in self._record_names(u)):
                return

    def _missing_state_bytes(self, unit: Unit) -> int:
        """Bytes of moments the optimizer will create for ``unit`` at its first step (0 afterwards)."""
        assert self.optimizer is not None
        return ADAM_MOMENTS * sum(moment_storage_bytes(c) for view, c in zip(unit.master_views(), unit.row.chunks)
                                  if id(view) in self._stepped and id(view) not in self._seen
                                  and not self.optimizer.state.get(view))

    @contextlib.contextmanager
    def resident(self, units: list[Unit], dirty: bool = True) -> Iterator[None]:
        if self._depth:
            yield
            return
        self._depth += 1
        try:
            with contextlib.ExitStack() as stack:
                for store in (self.params, self.states):
                    if store is not None:
                        stack.enter_context(store.unbounded())
                try:
                    for u in units:
                        self._record_in(u, read_shard=True)
                    yield
                finally:  # also after an error: memory is what the engine holds now
                    for u in units:
                        self._record_out(u, dirty)
        finally:
            self._depth -= 1

    # ---- reports and clean-up ----------------------------------------------------------------------------
    def _stores(self) -> list[SwapStore]:
        return [s for s in (self.params, self.states) if s is not None]

    def offloaded_bytes(self) -> int:
        return sum(s.stored_bytes() for s in self._stores())

    def resident_peak(self) -> int:
        return sum(s.peak_bytes for s in self._stores())

    def budget(self) -> int:
        return sum(s.budget for s in self._stores())

    def files(self) -> list[str]:
        return [s.pool.path for s in self._stores()]

    def close(self) -> None:
        for s in self._stores():
            try:
                s.flush()
            finally:
                s.pool.close()


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    return list(seen.values())


def build_residency(offload: OffloadSettings, model: nn.Module, world: int, compute_dtype: torch.dtype,
                    rank: int) -> Resident:
    """The residency ``offload`` (the policy's, from ``zero_optimization``) asks for; NVMe files are created and
    reserved here.

    Raises ``OffloadError`` naming the config key when a path cannot be written or lacks the space.
    """
    opt_nvme, par_nvme = offload.optimizer_nvme, offload.param_nvme
    if opt_nvme is None and par_nvme is None:
        return Resident(offload.sub_group_size if offload.host_step else 0)
    elem = torch.empty((), dtype=compute_dtype).element_size()
    chunks = [ShardSpec(p.numel(), p.shape, world).chunk for p in _unique_params(model)]
    params = states = None
    shard_buffer = 0
    if par_nvme is not None:
        capacity = sum(_round_up(c * elem) for c in chunks)
        pool = _pool(par_nvme.path, par_nvme.key, capacity, rank, "param")
        shard_buffer = par_nvme.buffer_size * elem
        params = SwapStore(pool, par_nvme.buffer_count * shard_buffer,
                           "zero_optimization.offload_param.buffer_count or buffer_size")
    if opt_nvme is not None:
        per_elem = (4, elem) + (4,) * ADAM_MOMENTS
        capacity = sum(_round_up(c * b) for c in chunks for b in per_elem)
        try:
            pool = _pool(opt_nvme.path, opt_nvme.key, capacity, rank, "optimizer")
        except BaseException:
            if params is not None:
                params.pool.close()
            raise
        states = SwapStore(pool, 0, "zero_optimization.offload_optimizer.buffer_count")
    return NvmeResidency(params, states, shard_buffer, opt_nvme.buffer_count if opt_nvme is not None else 0)


def _pool(path: str, key: str, capacity: int, rank: int, tag: str) -> AioPool:
    try:
        return AioPool(path, STAGING_BUFFERS, STAGING_BYTES, capacity=capacity, rank=rank, tag=tag)
    except OffloadError as e:
        raise OffloadError(f"{key}: {e}") from e
