"""Stage 3: the modules whose forwards are running, and how long a unit read outside its own forward stays
gathered (:class:`Spans`; Note [external reads] in ``param_use.py``).

A unit read outside its module's forward is kept gathered until the forward of the innermost running module that
contains it ends (its *span*), and the span is remembered, so from the next forward on the unit is released there
instead of after its own forward. This part keeps the facts (the running forwards, the units each holds, the
learned spans); ``Releases`` (``zero/release.py``) decides from them, and ``ParamUse`` reports the module entries
and exits it sees.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Iterable, Optional

from zeropp.partition.unit import Unit

log = logging.getLogger("zeropp")


class Spans:
    """The running module forwards, the units held until one of them ends, and the learned spans."""

    def __init__(self) -> None:
        self._stack: list[tuple[str, int]] = []  # (name, call number) of the running forwards, outermost first
        self._calls = 0
        self._running: Counter[str] = Counter()
        self._held: dict[str, set[Unit]] = {}  # units kept gathered until that running module's forward ends
        self.learned: dict[Unit, str] = {}  # the module whose forward end releases the unit
        self._released_in: dict[Unit, set[int]] = {}  # the forward calls running when it was last released
        self._reported: set[tuple[str, str]] = set()

    def reset(self) -> None:
        """A pass starts: nothing runs and nothing is held (the engine released every unit at the last pass's end)."""
        self._stack.clear()
        self._running.clear()
        self._held.clear()
        self._released_in.clear()

    # ---- the module stack --------------------------------------------------------------------------------
    def enter(self, name: str) -> None:
        self._calls += 1
        self._stack.append((name, self._calls))
        self._running[name] += 1

    def running(self, name: str) -> bool:
        return bool(self._running[name])

    @property
    def empty(self) -> bool:
        """No module forward is running."""
        return not self._stack

    @property
    def reader(self) -> str:
        """The innermost running module ("" for the root, or for none)."""
        return self._stack[-1][0] if self._stack else ""

    @property
    def outermost(self) -> str:
        """The outermost running module (the module a direct call entered), "" when none runs."""
        return self._stack[0][0] if self._stack else ""

    def exit(self, name: str) -> list[Unit]:
        """The forward of ``name`` ended: the units whose hold ended with it (inner modules whose own exit was not
        seen end here too: Note [exit hooks in compiled regions] in ``param_use.py``)."""
        if not self._running[name]:
            return []
        ended: list[Unit] = []
        if any(n == name for n, _ in self._stack):  # modules inside that raised with a plain exit hook
            while self._stack[-1][0] != name:      # end here
                ended += self._ended(self._stack.pop()[0])
            self._stack.pop()
        return ended + self._ended(name)

    def _ended(self, name: str) -> list[Unit]:
        """One forward of the module ``name`` ended: its held units go once no call of it is running."""
        self._running[name] -= 1
        if self._running[name]:
            return []
        return list(self._held.pop(name, ()))

    # ---- holds -------------------------------------------------------------------------------------------
    def hold(self, name: str, unit: Unit) -> None:
        """Keep ``unit`` gathered until the forward of ``name`` ends."""
        self._held.setdefault(name, set()).add(unit)

    def holding(self, unit: Unit) -> bool:
        """Whether a running forward holds ``unit`` (declared external, or kept by a span already)."""
        return any(unit in held for held in self._held.values())

    def note_release(self, unit: Unit) -> None:
        """``unit``'s own forward released it: remember which forward calls were running."""
        self._released_in[unit] = {call for _, call in self._stack}

    def released_in_this_pass(self, unit: Unit) -> bool:
        """Whether ``unit``'s own forward already ran and released it since this pass began."""
        return unit in self._released_in

    def learn(self, unit: Unit, reader: str, direct: bool) -> None:
        """``unit`` was gathered (again) outside its own forward: keep it gathered until the forward of the
        innermost module that was running both when it was released and now ends, in every later forward
        too. Never released before in this forward: the innermost running module that contains it. In a
        forward called on a part of the model (``direct``): kept until that forward ends, nothing learned
        (Note [direct calls] in ``param_use.py``)."""
        part = self.outermost if direct else ""  # the module called
        if part:
            self.hold(part, unit)
            return
        owner = unit.module_name
        before = self._released_in.get(unit)
        if before is not None:
            span = next((m for m, call in reversed(self._stack) if call in before and m != owner), "")
        else:
            span = next((m for m, _ in reversed(self._stack)
                         if m != owner and (m == "" or owner.startswith(m + "."))), "")
        self.learned[unit] = span
        self.hold(span, unit)
        if (owner, reader) not in self._reported:
            self._reported.add((owner, reader))
            log.info("stage 3: module %r reads the weights of %r outside its forward; they stay gathered "
                     "until the forward of %r ends", reader or "<root>", owner or "<root>", span or "<root>")

    def span_of(self, unit: Unit) -> Optional[str]:
        """The learned span of ``unit``, if any."""
        return self.learned.get(unit)

    def with_spans(self) -> Iterable[Unit]:
        """The units that have a learned span."""
        return self.learned.keys()
