"""Accounting for every collective: the bytes each rank receives and the seconds it spends, by phase and link.

Volumes are counted as the logical data movement of the collective (the bytes this rank receives from each
other member), split by whether the sender sits on this rank's node. Every volume claim in the library is
read from here, never estimated elsewhere.

Times (Note [collective time]) come in two kinds per (phase, link), where a group's link is inter-node when
any member sits on another node:
* ``wait``: seconds the calling thread was blocked inside the collective (a synchronous call, or
  ``Handle.wait`` of an asynchronous one): the communication that compute did not hide (exposed).
* ``busy``: seconds from issuing each collective to its completion, summed over collectives (two in flight
  at once count twice): the communication that ran, hidden or not.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Optional


class Phase(str, enum.Enum):
    """Why a collective ran; each step's bytes are reported per phase."""

    FORWARD_GATHER = "forward_gather"
    BACKWARD_GATHER = "backward_gather"
    GRAD_REDUCE = "grad_reduce"
    OTHER = "other"


class Link(str, enum.Enum):
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


@dataclass
class Tally:
    """Bytes and call count for one (phase, link) cell."""

    bytes: int = 0
    calls: int = 0


@dataclass
class CommLedger:
    """Accumulates the current step's bytes; :meth:`close_step` snapshots them as the last completed step."""

    current: dict[tuple[Phase, Link], Tally] = field(default_factory=dict)
    last_step: dict[tuple[Phase, Link], Tally] = field(default_factory=dict)
    total: dict[tuple[Phase, Link], Tally] = field(default_factory=dict)
    steps_closed: int = 0
    times: dict[tuple[str, Phase, Link], float] = field(default_factory=dict)  # current step's seconds
    last_step_times: dict[tuple[str, Phase, Link], float] = field(default_factory=dict)
    _time_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, phase: Phase, intra_bytes: int, inter_bytes: int) -> None:
        for link, nbytes in ((Link.INTRA_NODE, intra_bytes), (Link.INTER_NODE, inter_bytes)):
            for table in (self.current, self.total):
                cell = table.setdefault((phase, link), Tally())
                cell.bytes += int(nbytes)
                cell.calls += 1 if nbytes else 0

    def record_time(self, kind: str, phase: Phase, link: Link, seconds: float) -> None:
        """Add ``seconds`` of ``kind`` ("wait" or "busy"); completion callbacks call this from the backend's
        threads, hence the lock."""
        with self._time_lock:
            key = (kind, phase, link)
            self.times[key] = self.times.get(key, 0.0) + seconds

    def close_step(self) -> None:
        with self._time_lock:
            self.last_step_times, self.times = self.times, {}
        self.last_step, self.current = self.current, {}
        self.steps_closed += 1

    def reset(self) -> None:
        self.current, self.last_step, self.total = {}, {}, {}
        with self._time_lock:
            self.times, self.last_step_times = {}, {}
        self.steps_closed = 0

    def seconds(self, kind: str, phase: Phase, link: Optional[Link] = None, last: bool = True) -> float:
        """Seconds of ``kind`` in ``phase`` (on ``link``, or both) of the last completed step (or the current)."""
        table = self.last_step_times if last else self.times
        with self._time_lock:
            return sum(v for (k, p, ln), v in table.items() if k == kind and p == phase and link in (None, ln))

    @staticmethod
    def report(table: dict[tuple[Phase, Link], Tally]) -> dict[str, dict[str, int]]:
        """``{phase: {"intra_node_bytes": int, "inter_node_bytes": int}}`` for all four phases."""
        out: dict[str, dict[str, int]] = {}
        for phase in Phase:
            out[phase.value] = {
                f"{link.value}_bytes": table.get((phase, link), Tally()).bytes for link in Link
            }
        return out

    def last_step_report(self) -> dict[str, dict[str, int]]:
        return self.report(self.last_step)

    def current_report(self) -> dict[str, dict[str, int]]:
        return self.report(self.current)
