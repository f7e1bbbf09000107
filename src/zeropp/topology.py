"""Rank arithmetic and every process group the library uses, in one file that can be checked by eye.

Ranks are laid out node-major, as torchrun starts them: rank ``r`` lives on node ``r // D`` with local index
``r % D``, where ``D`` is the number of ranks per node. One host can play several nodes by setting ``D``
smaller than the real local world size (``topology.ranks_per_node`` in the config).

Groups:
- world: every rank.
- intra-node: the ``D`` ranks of one node.
- inter-node: the ``n = W / D`` ranks that share a local index, one per node (qgZ's second hop).
- inter-node, early: a second communicator over the inter-node ranks, for collectives issued at moments
  that differ between ranks (qgZ's second hop, Note [overlapped second hop] in ``plus/qgz.py``); the
  inter-node group itself carries only collectives issued in program order (the first hop of a world
  gather, Note [two-hop gather] in ``comm/gather.py``), so the two never interleave differently on two ranks.
  Made only with several nodes of several ranks (else it is the inter-node group).
- hpZ: groups of ``s`` consecutive ranks (the secondary weight partition); ``s == D`` reuses intra-node.

``torch.distributed.new_group`` must be called by every rank for every group in the same order; ``build``
does exactly that, once. The resulting ``Topology`` is passed explicitly; there is no global registry.
"""
from __future__ import annotations

import atexit
import os
import socket
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


class TopologyError(ValueError):
    """A rank layout that cannot work (e.g. ranks_per_node does not divide the world size)."""


class Group:
    """One process group as seen from this rank: its member ranks (global ids, in group order) and handle.

    ``handle`` is ``None`` for the trivial single-rank group and in pure rank-arithmetic use (tests). Two
    groups are equal when their ranks are; the handle is not part of identity.

    The handle is held weakly: ``torch.distributed`` owns its process groups, and ``destroy_process_group``
    must be able to free them (gloo joins its worker threads only when a group is freed, Note [leaving the
    process group] at :func:`ensure_process_group`). A group read after that raises instead of falling back to the default one.
    """

    __slots__ = ("ranks", "_ref")

    def __init__(self, ranks: tuple[int, ...], handle: Any = None) -> None:
        self.ranks = tuple(ranks)
        self._ref: Optional[Callable[[], Any]]
        if handle is None:
            self._ref = None
        else:
            try:
                self._ref = weakref.ref(handle)
            except TypeError:  # a stand-in handle (rank-arithmetic tests) that takes no weak reference
                self._ref = lambda: handle

    @property
    def handle(self) -> Any:
        if self._ref is None:
            return None
        handle = self._ref()
        if handle is None:
            raise RuntimeError(f"the process group of ranks {list(self.ranks)} was destroyed "
                               "(torch.distributed.destroy_process_group): no collective can run on it")
        return handle

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index_of(self, rank: int) -> int:
        return self.ranks.index(rank)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Group) and other.ranks == self.ranks

    def __hash__(self) -> int:
        return hash(self.ranks)

    def __repr__(self) -> str:
        return f"Group(ranks={self.ranks})"


@dataclass(frozen=True)
class Layout:
    """Pure rank arithmetic for ``world_size`` ranks, ``ranks_per_node`` to a node."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise TopologyError(f"world size must be >= 1, got {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise TopologyError(
                f"topology.ranks_per_node={self.ranks_per_node} must divide the world size {self.world_size}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def intra_node_ranks(self, node: int) -> tuple[int, ...]:
        d = self.ranks_per_node
        return tuple(range(node * d, node * d + d))

    def inter_node_ranks(self, local: int) -> tuple[int, ...]:
        return tuple(node * self.ranks_per_node + local for node in range(self.num_nodes))

    def hpz_ranks(self, group_index: int, size: int) -> tuple[int, ...]:
        return tuple(range(group_index * size, group_index * size + size))

    def check_hpz(self, size: int) -> None:
        """hpZ groups must tile the world; a group larger than a node would cross the slow link."""
        if size < 1 or self.world_size % size:
            raise TopologyError(
                f"zero_optimization.zero_hpz_partition_size={size} must divide the world size {self.world_size}"
            )


@dataclass(frozen=True)
class Topology:
    """This rank's position and its groups. Built once by :func:`build` and handed to every layer above."""

    layout: Layout
    rank: int
    world: Group
    intra_node: Group
    inter_node: Group
    hpz: Group
    inter_node_early_group: Optional[Group] = None  # see ``inter_node_early``

    @property
    def inter_node_early(self) -> Group:
        """The inter-node ranks' communicator for collectives issued at rank-dependent moments."""
        return self.inter_node_early_group or self.inter_node

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def ranks_per_node(self) -> int:
        return self.layout.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.layout.num_nodes

    @property
    def node(self) -> int:
        return self.layout.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.layout.local_of(self.rank)

    def same_node(self, other_rank: int) -> bool:
        return self.layout.node_of(other_rank) == self.node


def ensure_process_group(backend: Optional[str] = None, **kwargs: Any) -> None:
    """Join torchrun's process group (default backend: gloo for host tensors, NCCL for CUDA ones, chosen per
    tensor where CUDA is present); without torchrun's environment and without ``init_method``/``rank``/
    ``world_size`` a lone process forms a world of one. ``kwargs`` go to ``init_process_group``
    (``init_method``, ``rank``, ``world_size``, ``timeout``)."""
    if dist.is_initialized():
        _leave_at_exit()  # a group the script or a library (accelerate) made: its workers hold zeropp's tensors too
        return
    # Dynamo keeps references to a default group that exists when it is first imported (torch 2.13; every
    # torch optimizer imports it), and that group could then never be freed: Note [leaving the process group].
    import torch._dynamo  # noqa: F401
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if "RANK" not in os.environ and not (kwargs.keys() - {"timeout"}):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **kwargs)
    else:
        store = _attempt_store(kwargs.get("timeout")) if not (kwargs.keys() - {"timeout"}) else None
        if store is not None:
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend, **kwargs)
    _leave_at_exit()


_LEAVE_REGISTERED = False  # the exit hook, once registered


def _leave_at_exit() -> None:
    global _LEAVE_REGISTERED
    if not _LEAVE_REGISTERED:
        atexit.register(_leave_process_group)
        _LEAVE_REGISTERED = True


def _leave_process_group() -> None:
    """At interpreter exit, destroy the process group zeropp created (a script need not do it).

    Note [leaving the process group]: gloo's worker threads drop a finished collective's tensors a moment
    after its ``wait`` returns; when the last reference to a tensor is theirs, they take the GIL to free its
    Python object. A script that ends right after its last collective can reach that while the interpreter
    is finalizing, and the worker then aborts the process ("terminate called without an active exception",
    a lost rank under torchrun: 5 of 40 launches of examples/deepspeed_train.py on 2 busy cores). A group
    joins its workers only when it is freed (``shutdown`` leaves gloo's running), so ``Group`` holds its
    handle weakly, Dynamo is imported before the default group exists (imported after, it holds references
    to that group for good), and this hook destroys the groups while the interpreter is whole (torch
    releases the GIL while it frees a group, so a worker waiting for it can finish). Peers are not waited
    for: the teardown is local, and a barrier here would hang behind a rank that failed. A group someone else
    made (accelerate's, under the Trainer; a script's) carries zeropp's collectives just the same, and the
    same abort was seen there (1 of 3 runs of a GRPO step on the emulated cluster): it is destroyed at exit
    too, unless the script destroyed it first. Its workers are joined only if Dynamo was imported before the
    group was made (transformers' Trainer imports it first; a script that makes its group earlier keeps them).
    """
    if dist.is_initialized():
        dist.destroy_process_group()


def _attempt_store(timeout: Optional[timedelta]) -> Optional[dist.Store]:
    """Under torchrun's agent, its store with a prefix per restart attempt.

    The agent keeps one store for every restart of a job (``TORCHELASTIC_USE_AGENT_STORE``): a restarted
    worker's gloo mesh would read the previous attempt's addresses from it and fail with "connection
    refused". Keys under ``/zeropp/attempt_<TORCHELASTIC_RESTART_COUNT>`` keep each attempt apart, which is
    what lets ``torchrun --max-restarts`` resume a job (tests/dist/test_faults.py).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout or timedelta(minutes=30))
    return dist.PrefixStore(f"/zeropp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def default_ranks_per_node(world_size: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE, or every rank on one node when it is not set."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else world_size


def build(
    ranks_per_node: Optional[int] = None,
    hpz_partition_size: int = 1,
    new_group: Optional[Callable[[list[int]], Any]] = None,
    timeout: Optional[timedelta] = None,
) -> Topology:
    """Create every process group collectively; call on all ranks with the same arguments.

    ``timeout`` bounds every collective on these groups (a world group of zeropp's own is made for it, since
    the default group's timeout is whoever created it). ``new_group`` defaults to
    ``torch.distributed.new_group`` and is a parameter only so that the rank arithmetic can be exercised
    without a process group.
    """
    if new_group is None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: launch with torchrun (or zeropp train)")
        new_group = lambda ranks: dist.new_group(ranks=ranks, timeout=timeout)  # noqa: E731
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        world_size, rank = _fake_world()
    layout = Layout(world_size, ranks_per_node or default_ranks_per_node(world_size))
    layout.check_hpz(hpz_partition_size)

    def make_all(rank_sets: list[tuple[int, ...]]) -> Group:
        mine = None
        for ranks in rank_sets:  # every rank creates every group, in the same order
            handle = new_group(list(ranks))
            if rank in ranks:
                mine = Group(ranks, handle)
        assert mine is not None
        return mine

    everyone = tuple(range(world_size))
    if timeout is not None and world_size > 1:
        world = make_all([everyone])
    else:
        world = Group(everyone, dist.group.WORLD if dist.is_initialized() else None)
    intra = make_all([layout.intra_node_ranks(n) for n in range(layout.num_nodes)])
    inter = make_all([layout.inter_node_ranks(j) for j in range(layout.ranks_per_node)])
    if hpz_partition_size == layout.ranks_per_node:
        hpz = intra
    elif hpz_partition_size == world_size:
        hpz = world
    else:
        s = hpz_partition_size
        hpz = make_all([layout.hpz_ranks(g, s) for g in range(world_size // s)])
    early = None
    if layout.num_nodes > 1 and layout.ranks_per_node > 1:
        early = make_all([layout.inter_node_ranks(j) for j in range(layout.ranks_per_node)])
    return Topology(layout, rank, world, intra, inter, hpz, early)


def world_only() -> Topology:
    """This rank in the default group, for collectives over the whole world before ``initialize`` builds the
    groups (construction: ``zero.Init``, loading a checkpoint into shards). Only ``world`` is a real group;
    the node groups are this rank alone, and the node layout (torchrun's ``LOCAL_WORLD_SIZE``) serves only to
    count bytes by link."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: launch with torchrun (or zeropp train)")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout(world_size, default_ranks_per_node(world_size))
    me = Group((rank,))
    return Topology(layout, rank, Group(tuple(range(world_size)), dist.group.WORLD), me, me, me)


def _fake_world() -> tuple[int, int]:
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
