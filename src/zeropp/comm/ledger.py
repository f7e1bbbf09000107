"""Byte accounting for every collective: what each rank receives, by training phase and by link.

Volumes are counted as the logical data movement of the collective (the bytes this rank receives from each
other member), split by whether the sender sits on this rank's node. Every volume claim in the library is
read from here, never estimated elsewhere.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


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

    def record(self, phase: Phase, intra_bytes: int, inter_bytes: int) -> None:
        for link, nbytes in ((Link.INTRA_NODE, intra_bytes), (Link.INTER_NODE, inter_bytes)):
            for table in (self.current, self.total):
                cell = table.setdefault((phase, link), Tally())
                cell.bytes += int(nbytes)
                cell.calls += 1 if nbytes else 0

    def close_step(self) -> None:
        self.last_step, self.current = self.current, {}
        self.steps_closed += 1

    def reset(self) -> None:
        self.current, self.last_step, self.total = {}, {}, {}
        self.steps_closed = 0

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
