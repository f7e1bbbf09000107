"""Whether every rank issued the same collectives, for the same units, in the same order, in a step.

Note [collective order]. A gather is a collective: every rank must issue the same ones in the same order. When
ranks run different sub-modules (a data-dependent branch, an MoE expert that got no tokens on one rank, two
modules called in a different order), stage 3's gathers no longer pair up. If their sizes differ, gloo or NCCL
fails or hangs (``PeerLostError`` after the timeout); if they are the same size, nothing fails: a rank receives
another unit's shards as this unit's weights, and the run is silently corrupted (measured: stage 3 trained on
wrong values). At stage 3 the same holds for gradient reductions, whose buckets are filled in arrival order there
(Note [arrival order at stage 3] in ``zero/grad_intake.py``): a rank whose gradients arrive in another order
hands one parameter's gradients to another. At stages 0-2 reductions pair whatever each rank ran (Note
[positional buckets] in ``zero/buckets.py``), except for gradients the bucket layout has no place for (Note
[extra gradients]).

So each rank keeps running digests of what it did this step, each folded into two 16-bit values: its gathers
and stage 3 reductions (the units of its forward gathers in order, those of its backward gathers, the unit and
slot of every gradient it added to a bucket, where its passes ended), the order its gradients arrived in at
stages 0-2 (whether the bucket layout may follow it: every rank must agree), and which extra gradients it
kept. They ride on the global-norm all-reduce the optimizer step already makes (twelve more float64
values): the all-reduce sums ``d`` and ``d**2`` of each digest, and all ranks hold the same ``d`` exactly when
``(sum d)**2 == P * sum(d**2)`` (Cauchy-Schwarz). Digests below 2**16 keep every sum exact in float64 up to
2**21 ranks. A mismatch of gathers or of extra gradients is raised before the optimizer reads a gradient, so the
weights and optimizer states stay as the last good step left them (that step's loss, computed from mixed
weights, was wrong already). A mismatch that goes unseen needs both 16-bit digests to collide.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

__all__ = ["CollectiveOrder", "CollectiveOrderError", "NormCheck"]

_PRIMES = (65521, 65519)  # the largest primes below 2**16: digests stay below it
_BASE = 257
# what a noted event is: a gather; a gradient added to a bucket in arrival order (stage 3) or placed by the
# layout (stages 0-2); an extra gradient
GATHER_FORWARD, GATHER_BACKWARD, REDUCE, ARRIVE, EXTRA = 1, 2, 3, 5, 4
_GROUPS = ((GATHER_FORWARD, GATHER_BACKWARD, REDUCE), (ARRIVE,), (EXTRA,))  # digests checked apart, in this order


class NormCheck(NamedTuple):
    """The step's first all-reduce: the global gradient norm, and whether the ranks' gradients arrived in one order
    (Note [positional buckets]); ``arrivals_agree`` is None for a group of one (stage 0), where nothing is checked.
    Returned only where the ranks' gathers and reductions agreed (else :class:`CollectiveOrderError`)."""

    norm: float
    arrivals_agree: Optional[bool]


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
        """``d1, d1**2, d2, d2**2`` of each group of digests (gathers, arrivals, extra gradients), each group's
        kinds folded together."""
        out: list[float] = []
        for group in _GROUPS:
            folded = [1, 1]
            for kind in group:
                if kind not in self._digests:
                    continue
                for i, p in enumerate(_PRIMES):
                    for value in (kind, self._digests[kind][i]):
                        folded[i] = (folded[i] * _BASE + value + 1) % p
            d1, d2 = folded
            out += [float(d1), float(d1 * d1), float(d2), float(d2 * d2)]
        return out

    def reset(self) -> None:
        """Start the next step's digests."""
        self._digests, self.noted = {}, 0

    def check(self, summed: Sequence[float], world: int) -> bool:
        """Raise :class:`CollectiveOrderError` unless every rank contributed this rank's gather and extra
        gradient digests to ``summed`` (the all-reduced :meth:`payload`); then start the next step's digests.
        Returns whether the ranks' gradients arrived in the same order."""
        values = [int(v) for v in summed]
        agree = [all(values[g + i] * values[g + i] == world * values[g + i + 1] for i in (0, 2))
                 for g in range(0, len(values), 4)]
        noted = self.noted
        self.reset()
        if not agree[0]:
            raise CollectiveOrderError(
                f"the ranks did not issue the same weight gathers and gradient reductions in this step (this rank "
                f"noted {noted}): some rank ran a different set of sub-modules, or ran them in a different "
                "order. With stage 3 every rank must run the same modules with parameters in the same order each "
                "step (an MoE expert that got no tokens on one rank, or a branch taken on some ranks only, breaks "
                "this); collectives that do not pair up hand one unit's weights or gradients to another. The "
                "step was refused before the optimizer read any gradient, so the weights are those of the last "
                "step. Make every rank call the same modules (e.g. run an unused expert on an empty batch, or "
                "mark the mixture-of-experts block a leaf module: zero_optimization.leaf_module), or use stage 2, "
                "whose gradient reductions pair whatever each rank ran.")
        if not agree[2]:
            raise CollectiveOrderError(
                "the ranks' backwards ran some module a different number of times in this step (a parameter got "
                "more gradients on some ranks than on others, and more than in the backward the reduce buckets "
                "follow): its extra gradients cannot be paired between the ranks, so they were not reduced "
                "(Note [extra gradients] in zero/grad_intake.py). The step was refused before the optimizer read "
                "any gradient, so the weights are those of the last step. Make every rank run the same modules "
                "the same number of times.")
        return agree[1]
