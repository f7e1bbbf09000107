"""Whether every rank issued the same collectives, for the same units, in the same order, in a step.

Note [collective order]. A gather or a gradient reduction is a collective: every rank must issue the same
ones in the same order. When ranks run different sub-modules (a data-dependent branch, an MoE expert that got
no tokens on one rank, two modules called in a different order), the collectives no longer pair up. If their
sizes differ, gloo or NCCL fails or hangs (``PeerLostError`` after the timeout); if they are the same size,
nothing fails: a rank receives another unit's shards as this unit's weights, or another parameter's
gradients, and the run is silently corrupted (measured: stage 2 and stage 3 both trained on wrong values).

So each rank keeps running digests of what it issued this step: the units of its forward gathers in order,
those of its backward gathers, and the unit and slot of every gradient it added to a reduction bucket (the
add order decides what each bucket holds), folded into two 16-bit values. They ride on the global-norm
all-reduce the optimizer step already makes (four more float64 values): the all-reduce sums ``d`` and
``d**2`` of each digest, and all ranks hold the same ``d`` exactly when ``(sum d)**2 == P * sum(d**2)``
(Cauchy-Schwarz). Digests below 2**16 keep every sum exact in float64 up to 2**21 ranks. A mismatch is
raised before the optimizer reads a gradient, so the weights and optimizer states stay as the last good step
left them (that step's loss, computed from mixed weights, was wrong already). A mismatch that goes unseen
needs both 16-bit digests to collide.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["CollectiveOrder", "CollectiveOrderError"]

_PRIMES = (65521, 65519)  # the largest primes below 2**16: digests stay below it
_BASE = 257
GATHER_FORWARD, GATHER_BACKWARD, REDUCE = 1, 2, 3  # what a noted collective is


class CollectiveOrderError(RuntimeError):
    """Ranks issued different gathers or reductions in one step (Note [collective order])."""


class CollectiveOrder:
    """The running digests of one rank's collectives since the last check."""

    def __init__(self) -> None:
        self._digests: dict[int, list[int]] = {}
        self.noted = 0

    def note(self, kind: int, unit_index: int, slot: int = 0) -> None:
        """One collective issued (or one gradient added to a bucket) on this rank. Each kind has a sequence of
        its own: only the order within a kind must agree (when a gather is issued relative to a gradient's
        add may depend on timing, e.g. an NVMe prefetch that found its buffers busy)."""
        digests = self._digests.setdefault(kind, [1, 1])
        for value in (unit_index, slot):
            digests[:] = [(d * _BASE + value + 1) % p for d, p in zip(digests, _PRIMES)]
        self.noted += 1

    def note_end(self, kind: int) -> None:
        """The end of a pass that issued collectives of ``kind``: where passes end is checked too (a marker that
        no unit's index folds to), without counting as a collective."""
        digests = self._digests.setdefault(kind, [1, 1])
        digests[:] = [(d * _BASE) % p for d, p in zip(digests, _PRIMES)]

    def payload(self) -> list[float]:
        """``d1, d1**2, d2, d2**2`` of the digests of all kinds folded together."""
        folded = [1, 1]
        for kind in sorted(self._digests):
            for i, p in enumerate(_PRIMES):
                for value in (kind, self._digests[kind][i]):
                    folded[i] = (folded[i] * _BASE + value + 1) % p
        d1, d2 = folded
        return [float(d1), float(d1 * d1), float(d2), float(d2 * d2)]

    def reset(self) -> None:
        """Start the next step's digests."""
        self._digests, self.noted = {}, 0

    def check(self, summed: Sequence[float], world: int) -> None:
        """Raise :class:`CollectiveOrderError` unless every rank contributed this rank's digests to
        ``summed`` (the all-reduced :meth:`payload`); then start the next step's digests."""
        values = [int(v) for v in summed]
        agree = all(values[i] * values[i] == world * values[i + 1] for i in (0, 2))
        noted = self.noted
        self.reset()
        if not agree:
            raise CollectiveOrderError(
                f"the ranks did not issue the same weight gathers and gradient reductions in this step (this "
                f"rank issued {noted}): some rank ran a different set of sub-modules, or ran them in a "
                "different order. With stage 2 or 3 every rank must run the same modules with parameters in the "
                "same order each step (an MoE expert that got no tokens on one rank, or a branch taken on some "
                "ranks only, breaks this); collectives that do not pair up hand one unit's weights or "
                "gradients to another. The step was refused before the optimizer read any gradient, so the "
                "weights are those of the last step. Make every rank call the same modules (e.g. run an "
                "unused expert on an empty batch), or use stage 1, which reduces whole gradients in a fixed "
                "order.")
