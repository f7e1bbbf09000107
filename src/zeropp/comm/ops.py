"""The only module that calls ``torch.distributed`` collectives.

Each function takes explicit inputs (tensors, a :class:`~zeropp.topology.Group`, the phase) and records
into the :class:`CommLedger` the bytes this rank receives from members on its own node and on other nodes.
Single-member groups short-cut to a local copy and move no bytes. It also records, per phase and link, the
seconds the caller was blocked in each collective and the seconds from issue to completion (Note [collective
time] in ``ledger.py``).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from zeropp.comm.ledger import CommLedger, Link, Phase
from zeropp.topology import Group, Topology


class PeerLostError(RuntimeError):
    """A collective failed because another rank is gone (killed, crashed, unreachable) or did not take part
    within ``comm_timeout_s``; the message names the collective, its group and this rank."""


# What a lost or silent peer looks like from inside a collective. gloo raises a plain RuntimeError (not one
# of torch's DistError classes) whose message names the transport failure; anything else (a dtype the
# backend lacks, say) is a local error and propagates as it is.
_PEER_FAILURE = ("connection closed", "connection reset", "connection refused", "broken pipe", "read error",
                 "write error", "timed out", "timeout", "socket", "watchdog")


def _lost_peer(err: RuntimeError) -> bool:
    return isinstance(err, dist.DistError) or any(s in str(err).lower() for s in _PEER_FAILURE)


@contextmanager
def _peer_errors(what: str, group: Group, rank: int) -> Iterator[None]:
    """Turn a backend's transport failure inside a collective (gloo's "Connection closed by peer", NCCL's
    watchdog, a timeout) into one :class:`PeerLostError` naming the collective, its ranks and this rank."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, PeerLostError) or not _lost_peer(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PeerLostError(f"rank {rank}: {what} over ranks {list(group.ranks)} failed: a peer rank was lost "
                            f"(killed, crashed or unreachable) or did not take part within comm_timeout_s "
                            f"[{first}]") from err


@dataclass
class Handle:
    """An in-flight collective; ``wait`` is idempotent and cheap once done."""

    work: Any = None
    what: str = ""
    group: Optional[Group] = None
    rank: int = 0
    clock: Optional["_Clock"] = None

    def wait(self) -> None:
        if self.work is not None:
            start = time.perf_counter()
            with _peer_errors(self.what, self.group or Group(()), self.rank):
                self.work.wait()
            self.work = None
            if self.clock is not None:
                self.clock.finished(start, time.perf_counter())

    def is_done(self) -> bool:
        """True once the collective has completed (or failed: ``wait`` then raises); never blocks."""
        return self.work is None or bool(self.work.is_completed())


@dataclass
class _Clock:
    """Times one collective: blocked seconds in ``wait`` and issue-to-completion seconds (Note [collective
    time]). The backend's completion callback stamps the end; both are recorded on the waiting thread so a
    step's times land in that step."""

    ledger: CommLedger
    phase: Phase
    link: Link
    issued: float = 0.0
    completed: Optional[float] = None

    def watch(self, work: Any) -> None:
        try:
            work.get_future().add_done_callback(self._stamp)
        except (AttributeError, RuntimeError):  # a backend without futures: completion = end of wait
            pass

    def _stamp(self, _future: Any) -> None:
        self.completed = time.perf_counter()

    def finished(self, wait_start: float, wait_end: float) -> None:
        self.ledger.record_time("wait", self.phase, self.link, wait_end - wait_start)
        done = self.completed if self.completed is not None else wait_end
        self.ledger.record_time("busy", self.phase, self.link, max(0.0, min(done, wait_end) - self.issued))


DONE = Handle()

# torch 2.13 renamed all_gather_into_tensor; keep working on the older releases we declare.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Comm:
    """Bundles the topology and the ledger so strategies can issue counted collectives."""

    topo: Topology
    ledger: CommLedger

    def _record_per_peer(self, group: Group, bytes_per_peer: int, phase: Phase) -> None:
        me = self.topo.rank
        intra = sum(1 for r in group.ranks if r != me and self.topo.same_node(r))
        inter = sum(1 for r in group.ranks if not self.topo.same_node(r))
        self.ledger.record(phase, intra * bytes_per_peer, inter * bytes_per_peer)

    def _link(self, group: Group) -> Link:
        return Link.INTRA_NODE if all(self.topo.same_node(r) for r in group.ranks) else Link.INTER_NODE

    def _run(self, what: str, group: Group, phase: Phase, async_op: bool, call: Any) -> Handle:
        """Issue ``call()`` (a torch.distributed collective) with peer-loss translation and timing."""
        clock = _Clock(self.ledger, phase, self._link(group), issued=time.perf_counter())
        with _peer_errors(what, group, self.topo.rank):
            work = call()
        handle = Handle(work, what, group, self.topo.rank, clock)
        if async_op:
            clock.watch(work)
        else:
            handle.work = None
            end = time.perf_counter()
            clock.finished(clock.issued, end)
        return handle

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, group: Group, phase: Phase, async_op: bool = False
    ) -> Handle:
        """``out`` (``group.size * inp.numel()`` elements, contiguous) receives every member's ``inp`` in group order."""
        if out.numel() != group.size * inp.numel():
            raise ValueError(f"all_gather: out has {out.numel()} elements, expected {group.size} x {inp.numel()}")
        if group.size == 1:
            out.view(-1).copy_(inp.view(-1))
            return DONE
        self._record_per_peer(group, inp.numel() * inp.element_size(), phase)
        return self._run("all_gather", group, phase, async_op, lambda: _all_gather_single(
            out.view(-1), inp.reshape(-1), group=group.handle, async_op=async_op))

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, group: Group, phase: Phase, async_op: bool = False
    ) -> Handle:
        """Equal-split all-to-all: chunk ``i`` of ``inp`` goes to member ``i``; chunk ``i`` of ``out`` comes from it."""
        if inp.numel() % group.size or out.numel() != inp.numel():
            raise ValueError(f"all_to_all: {inp.numel()} elements do not split into {group.size} equal chunks")
        if group.size == 1:
            out.copy_(inp)
            return DONE
        self._record_per_peer(group, inp.numel() // group.size * inp.element_size(), phase)
        return self._run("all_to_all", group, phase, async_op, lambda: dist.all_to_all_single(
            out, inp, group=group.handle, async_op=async_op))

    def all_to_all_v(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                     group: Group, phase: Phase) -> None:
        """Uneven all-to-all (1-D tensors): ``in_splits[i]`` elements of ``inp`` go to member ``i``,
        ``out_splits[i]`` elements of ``out`` come from it, in member order."""
        if sum(in_splits) != inp.numel() or sum(out_splits) != out.numel() or \
                len(in_splits) != group.size or len(out_splits) != group.size:
            raise ValueError(f"all_to_all_v: splits {in_splits} -> {out_splits} do not fit {inp.numel()} -> "
                             f"{out.numel()} elements over {group.size} members")
        if group.size == 1:
            out.copy_(inp)
            return
        me, size = self.topo.rank, inp.element_size()
        intra = sum(n for r, n in zip(group.ranks, out_splits) if r != me and self.topo.same_node(r))
        inter = sum(n for r, n in zip(group.ranks, out_splits) if not self.topo.same_node(r))
        self.ledger.record(phase, intra * size, inter * size)
        self._run("all_to_all_v", group, phase, False, lambda: dist.all_to_all_single(
            out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group.handle))

    def all_reduce(self, t: torch.Tensor, group: Group, phase: Phase = Phase.OTHER, op: str = "sum",
                   async_op: bool = False) -> Handle:
        """In-place all-reduce; counted as a ring all-reduce receives, 2(P-1)/P of the tensor, split by link."""
        if group.size == 1:
            return DONE
        p = group.size
        per_peer = 2 * t.numel() * t.element_size() // p
        self._record_per_peer(group, per_peer, phase)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        return self._run("all_reduce", group, phase, async_op, lambda: dist.all_reduce(
            t, op=red, group=group.handle, async_op=async_op))

    def broadcast(self, t: torch.Tensor, src: int, group: Group, phase: Phase = Phase.OTHER) -> None:
        """In-place broadcast from global rank ``src``."""
        if group.size == 1:
            return
        me = self.topo.rank
        if me != src:
            nbytes = t.numel() * t.element_size()
            same = self.topo.same_node(src)
            self.ledger.record(phase, nbytes if same else 0, 0 if same else nbytes)
        self._run("broadcast", group, phase, False, lambda: dist.broadcast(t, src=src, group=group.handle))

    def scatter(self, out: torch.Tensor, inp: Optional[torch.Tensor], src: int, group: Group,
                phase: Phase = Phase.OTHER) -> None:
        """Member ``i`` receives chunk ``i`` of global rank ``src``'s ``inp`` (``group.size`` equal chunks,
        contiguous) into ``out``; ``inp`` is read on ``src`` only (None elsewhere)."""
        me = self.topo.rank
        if me == src and (inp is None or inp.numel() != group.size * out.numel()):
            raise ValueError(f"scatter: the source needs {group.size} x {out.numel()} elements, got "
                             f"{None if inp is None else inp.numel()}")
        if group.size == 1:
            out.view(-1).copy_(inp.view(-1))  # type: ignore[union-attr]
            return
        if me != src:
            nbytes = out.numel() * out.element_size()
            same = self.topo.same_node(src)
            self.ledger.record(phase, nbytes if same else 0, 0 if same else nbytes)
        pieces = list(inp.reshape(group.size, -1).unbind(0)) if me == src else None  # type: ignore[union-attr]
        self._run("scatter", group, phase, False, lambda: dist.scatter(
            out.view(-1), scatter_list=pieces, src=src, group=group.handle))

    def barrier(self, group: Optional[Group] = None) -> None:
        g = group or self.topo.world
        if g.size > 1:
            with _peer_errors("barrier", g, self.topo.rank):
                dist.barrier(group=g.handle)
