"""Parameters partitioned at construction, before any engine exists (``zeropp.zero.Init``, sharded loading).

Note [partitioned at construction]: a parameter partitioned here keeps its identity, its full shape and dtype
(``p.shape`` is the model's shape, readable as metadata, as after ``initialize``); its data is a view of a
padded full-size buffer whose storage is freed, as a released unit's (Note [shard layout] in ``spec.py``).
What this rank holds of it is its chunk, in a table here keyed by the parameter, not an attribute on it.
Partitioning takes rank 0's values: rank 0 scatters each parameter's chunks, so ranks that initialized
differently (other seeds, weights loaded on rank 0 only) end with one model, as DeepSpeed's ``zero.Init``
broadcasts from rank 0.

A partitioned parameter is :attr:`State.PARTITIONED` or, while code reads or writes it during construction
or inside ``GatheredParameters``, :attr:`State.GATHERED` (its storage holds the full values, gathered from
every rank's chunk). :meth:`PartitionedParams.repartition` makes it partitioned again from the values of one
rank (rank 0, or ``GatheredParameters``' modifier), or drops the gathered copy unchanged.
``initialize`` takes each rank's chunk with :meth:`PartitionedParams.chunk` and adopts the parameter: from
then on the engine owns it and this table forgets it.

Every method that communicates is collective: all ranks call it for the same parameters in the same order,
which construction code (the same ``__init__`` on every rank) does by nature.
"""
from __future__ import annotations

import enum
import functools
import itertools
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, TypeVar, Union

import torch
from torch import nn

from zeropp.comm.ledger import CommLedger, Phase
from zeropp.comm.ops import Comm
from zeropp.partition import listeners
from zeropp.partition.access import METADATA, STORAGE_INFO, ParameterAccessError, call_args, call_name
from zeropp.partition.spec import ShardSpec, take_chunk
from zeropp.topology import world_only
from zeropp.zero.memory import freed_storage_key, storage_key

# calls that make an alias of a parameter without reading its elements
ALIASING = frozenset({"detach"})

# Note [large host gathers]: gloo's all-gather into one host tensor stages its whole output once more before
# copying it out (a 64 MiB gather on 4 ranks raised a rank's RSS by 130 MiB, output included). Gathering a large
# parameter at construction (GatheredParameters; transformers' ZeRO-3 loading gathers each module's parameters
# on every rank while rank 0 writes them) would then hold it twice. Host parameters over 16 MiB are gathered as
# one broadcast per rank, each rank's chunk straight into its row of the full buffer: gloo broadcasts a
# contiguous tensor in place. transformers' ZeRO-3 load of a 0.54B Llama on 4 ranks peaked at 408 MiB on ranks 1-3
# (424 MiB as all-gathers in pieces of 1/8, the way before; bench/bench_pretrained_load.py --transformers). CUDA
# tensors (NCCL gathers in place) and small ones take one all-gather.
HOST_BROADCAST_FROM = 16 << 20  # bytes of a host parameter from which it is gathered by broadcasts


def _by_broadcasts(full: torch.Tensor, world: int) -> bool:
    return full.device.type == "cpu" and world > 1 and full.numel() * full.element_size() >= HOST_BROADCAST_FROM


F = TypeVar("F", bound=Callable[..., Any])


def _plain(fn: F) -> F:
    """Run ``fn`` with torch-function handling off: this table's own tensor work is not the user's code that
    the construction and idle modes watch (and it touches parameters whose storage is freed)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


class State(enum.Enum):
    PARTITIONED = "partitioned"
    GATHERED = "gathered"


@dataclass(eq=False)
class Partitioned:
    """This rank's part of one parameter partitioned at construction."""

    label: str  # for messages: "Linear.weight" at construction, the model's name once known
    spec: ShardSpec  # over the world
    shard: torch.Tensor  # this rank's chunk (``spec.chunk`` elements, padding zero), the parameter's dtype
    full: torch.Tensor  # the padded buffer the parameter's data views; storage freed while partitioned
    state: State = State.PARTITIONED
    pins: int = 0  # GatheredParameters holding it gathered
    serial: int = 0  # the order in which this process partitioned its parameters

    @property
    def nbytes(self) -> int:
        return self.spec.padded * self.full.element_size()


class PartitionedParams:
    """The parameters partitioned at construction on this rank, and the collectives that move them."""

    def __init__(self, comm: Optional[Comm] = None) -> None:
        self._comm = comm
        self._records: dict[int, tuple[weakref.ref, Partitioned]] = {}
        self._storages: dict[int, int] = {}  # a record's full buffer's storage -> the parameter's key (aliases)
        self._storage_of: dict[int, int] = {}  # and back
        self._serial = itertools.count()

    @property
    def comm(self) -> Comm:
        if self._comm is None:  # first use: the process group exists by now (zero.Init creates it)
            self._comm = Comm(world_only(), CommLedger())
        return self._comm

    # ---- lookup -----------------------------------------------------------------------------------------------
    def get(self, param: Any) -> Optional[Partitioned]:
        hit = self._records.get(id(param))
        return hit[1] if hit is not None and hit[0]() is param else None

    def __len__(self) -> int:
        return len(self._records)

    def _add(self, param: nn.Parameter, rec: Partitioned) -> None:
        key = id(param)
        self._records[key] = (weakref.ref(param, lambda _, k=key: self._forget(k)), rec)
        storage = storage_key(rec.full)
        assert storage is not None
        self._storages[storage] = key
        self._storage_of[key] = storage

    def _forget(self, key: int) -> None:
        """Drop ``key``'s record (plain dict work: this runs from a weakref callback, also at exit)."""
        self._records.pop(key, None)
        self._storages.pop(self._storage_of.pop(key, -1), None)

    def _aliased(self, t: torch.Tensor) -> Optional[Partitioned]:
        """The partitioned record whose freed buffer ``t`` views (a ``detach()`` or ``state_dict()`` value of a
        partitioned parameter), else None. A freed storage has no data (pointer 0): the cheap test first."""
        if not self._storages:
            return None
        key = self._storages.get(freed_storage_key(t))
        hit = self._records.get(key) if key is not None else None
        return hit[1] if hit is not None and hit[1].state is State.PARTITIONED else None

    # ---- partitioning -----------------------------------------------------------------------------------------
    @_plain
    def partition(self, params: Iterable[tuple[str, nn.Parameter]], dtype: Optional[torch.dtype] = None,
                  shard_device: Optional[torch.device] = None) -> None:
        """Partition ``params`` (those not partitioned yet) from rank 0's values; collective.

        ``dtype`` casts floating-point parameters (``zero.Init(dtype=...)``); the chunk lives on
        ``shard_device`` (default: the parameter's device).
        """
        comm = self.comm
        world, rank = comm.topo.world_size, comm.topo.rank
        for label, p in params:
            if self.get(p) is not None:
                continue
            kind = dtype if dtype is not None and p.is_floating_point() else p.dtype
            spec = ShardSpec(p.numel(), p.shape, world)
            device = shard_device or p.device
            shard = torch.zeros(spec.chunk, dtype=kind, device=device)
            source = None
            if rank == 0:
                source = torch.zeros(spec.padded, dtype=kind, device=p.device)
                source[: spec.numel].copy_(p.detach().reshape(-1))
            comm.scatter(shard, source if source is None else source.to(device), 0, comm.topo.world)
            self.place(p, label, shard, spec, p.device)

    @_plain
    def place(self, param: nn.Parameter, label: str, shard: torch.Tensor, spec: ShardSpec,
              device: Optional[torch.device] = None) -> None:
        """Record ``shard`` as this rank's chunk of ``param`` (no collective: every rank was handed its own,
        e.g. read from a checkpoint); ``param`` keeps its identity and takes ``spec``'s shape and the chunk's
        dtype, with no storage (on ``device``, default the chunk's)."""
        if spec.world != self.comm.topo.world_size or shard.numel() != spec.chunk:
            raise ValueError(f"{label}: a chunk of {shard.numel()} elements over {spec.world} ranks does not fit "
                             f"{spec.chunk} elements over {self.comm.topo.world_size}")
        full = torch.empty(spec.padded, dtype=shard.dtype, device=device or shard.device)
        param.data = full[: spec.numel].view(spec.shape)
        full.untyped_storage().resize_(0)
        self._add(param, Partitioned(label, spec, shard, full, serial=next(self._serial)))
        listeners.partitioned(param)

    @_plain
    def gather(self, param: nn.Parameter) -> Partitioned:
        """Give ``param`` its full values (all-gathered from every rank's chunk); collective."""
        rec = self.get(param)
        assert rec is not None
        if rec.state is State.PARTITIONED:
            rec.full.untyped_storage().resize_(rec.nbytes)
            comm, shard = self.comm, rec.shard.to(rec.full.device)
            if not _by_broadcasts(rec.full, comm.topo.world_size):
                comm.all_gather(rec.full, shard, comm.topo.world, Phase.OTHER)
            else:  # Note [large host gathers]
                rows = rec.full.view(comm.topo.world_size, rec.spec.chunk)
                rows[comm.topo.rank].copy_(shard)
                for src in range(comm.topo.world_size):
                    comm.broadcast(rows[src], src, comm.topo.world, Phase.OTHER)
            rec.state = State.GATHERED
        return rec

    @_plain
    def repartition(self, param: nn.Parameter, src: Optional[int] = 0) -> None:
        """Make a gathered ``param`` partitioned again: each rank's chunk from rank ``src``'s values, or
        (``src=None``) the chunks as they were, the gathered values dropped; collective when ``src`` is set."""
        rec = self.get(param)
        if rec is None or rec.state is State.PARTITIONED:
            return
        if src is not None:
            comm = self.comm
            # straight into the chunk where it lives beside the full buffer (no second chunk while it is whole)
            direct = rec.shard.device == rec.full.device and rec.shard.is_contiguous()
            out = rec.shard if direct else torch.empty_like(rec.shard, device=rec.full.device)
            comm.scatter(out, rec.full if comm.topo.rank == src else None, src, comm.topo.world)
            if not direct:
                rec.shard.copy_(out)
        rec.full.untyped_storage().resize_(0)
        rec.state = State.PARTITIONED

    def gathered(self) -> list[nn.Parameter]:
        """The parameters gathered now, unpinned ones first, each group in the order they were recorded."""
        out = [(ref(), rec) for ref, rec in self._records.values() if rec.state is State.GATHERED]
        return [p for p, rec in sorted(out, key=lambda pr: pr[1].pins > 0) if p is not None]

    # ---- the engine takes over -----------------------------------------------------------------------------
    @_plain
    def chunk(self, param: nn.Parameter, spec: ShardSpec, rank: int) -> torch.Tensor:
        """This rank's chunk of ``param`` split as ``spec`` says (``initialize``); collective when ``spec``'s
        world is not the one it was partitioned over (stage 0 keeps whole copies: gathered here)."""
        rec = self.get(param)
        assert rec is not None
        self.repartition(param)  # a value written since: rank 0's, as any write at construction
        if spec.world == rec.spec.world and rank == self.comm.topo.rank:
            return rec.shard
        self.gather(param)
        try:
            return take_chunk(rec.full[: rec.spec.numel], spec, rank, spec.world)
        finally:
            self.repartition(param, src=None)

    def adopt(self, param: nn.Parameter) -> None:
        """``initialize`` made ``param`` its own: forget it here."""
        self._forget(id(param))

    # ---- reads outside construction (Note [reads between passes] in zero/idle_watch.py) ---------------------
    def check_idle(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Refuse a call that would read a partitioned parameter's elements (it has no storage), on the
        parameter or on an alias of it. Making an alias reads nothing (``model.state_dict()``, which
        transformers' ZeRO-3 loading calls for the keys, detaches every parameter): it is allowed, and the alias
        is refused in turn when read."""
        for a, _ in call_args(args, kwargs):
            if not isinstance(a, torch.Tensor):
                continue
            rec = self.get(a)
            alias = rec is None
            if alias:
                rec = self._aliased(a)
            if rec is None or rec.state is State.GATHERED:
                continue
            name = call_name(func)
            if name in METADATA or name in STORAGE_INFO or (name in ALIASING and not alias):
                continue
            what = "a view of it (a detach() or state_dict() value)" if alias else "it"
            raise ParameterAccessError(
                f"parameter {rec.label!r} was partitioned over the ranks at construction (zeropp.zero.Init) and "
                f"{what} was read by {name!r} outside a module's __init__: this rank holds only its chunk. Read or "
                "change it inside zeropp.zero.GatheredParameters(params, modifier_rank=0) entered on every rank, "
                "or after zeropp.initialize through the engine")


def local_device() -> torch.device:
    """Where construction puts a model by default: this rank's CUDA device (torchrun's ``LOCAL_RANK``) when
    there is one, as DeepSpeed's ``zero.Init`` does, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        here = torch.cuda.current_device()
        return (a.index if a.index is not None else here) == (b.index if b.index is not None else here)
    return a.index == b.index or a.index is None or b.index is None


def move_model(model: nn.Module, device: Union[torch.device, str]) -> nn.Module:
    """``model.to(device)`` for a model that may hold parameters partitioned at construction.

    A partitioned parameter has no full values to move (``.to`` on it is refused by name), so it must already
    live on ``device`` (``zero.Init`` builds on this rank's device, ``from_pretrained`` takes ``device=``);
    everything else (buffers, parameters made outside the context) moves as ``.to`` moves it. A model with no
    partitioned parameter is simply moved.
    """
    device = torch.device(device)
    params = list(model.parameters())
    partitioned = [p for p in params if PARAMS.get(p) is not None]
    if not partitioned:
        return model.to(device)
    for p in partitioned:
        if not _same_device(p.device, device):
            label = PARAMS.get(p).label
            raise ValueError(f"parameter {label!r} was partitioned at construction on {p.device} and cannot be moved "
                             f"to {device} (this rank holds only its chunk): build the model on {device} "
                             "(zero.Init builds on this rank's device; zeropp.hf.from_pretrained(..., device=...))")
    with torch.no_grad():
        for p in params:
            if PARAMS.get(p) is None and not _same_device(p.device, device):
                p.data = p.data.to(device)  # in place of the Parameter: tied holders keep one object
        for module in model.modules():
            for attr, buf in module._buffers.items():
                if buf is not None and not _same_device(buf.device, device):
                    module._buffers[attr] = buf.to(device)
    return model


#: the one table of this process (construction is per process; an engine adopts what it trains)
PARAMS = PartitionedParams()
