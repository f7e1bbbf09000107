"""A test matrix whose every axis value runs in ``make test`` and whose full product runs under the ``full_matrix``
marker (``pytest -m full_matrix``).

``make test`` runs a cover of the product: rows chosen so that every value of every axis appears at least once
(the diagonal: row ``i`` takes value ``i`` of each axis, modulo its length, as many rows as the longest axis has
values). The other rows of the product are marked ``full_matrix``. A world that computes every cell at once (a
module's ``run_world`` worker) asks :meth:`Matrix.cells` which cells this session runs: the cover, or the whole
product when the session selected any ``full_matrix`` test (``tests/conftest.py`` records the selection).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Optional, Sequence

import pytest

#: set by tests/conftest.py once collection is done: whether this session runs any full_matrix test
FULL = {"selected": False}


def full_run() -> bool:
    """Whether this session runs the full products (it selected a ``full_matrix`` test)."""
    return FULL["selected"]


class Matrix:
    """The product of named axes (``Matrix(family=[...], variant=[...])``), in the order given."""

    def __init__(self, ids: Optional[dict[str, Callable[[Any], str]]] = None, **axes: Sequence[Any]) -> None:
        """``ids``: how a value of an axis is named in a test id (default ``str``)."""
        if not axes or any(len(values) == 0 for values in axes.values()):
            raise ValueError(f"a matrix needs axes with values, got {axes}")
        self.names = list(axes)
        self.axes = [list(values) for values in axes.values()]
        self.ids = [(ids or {}).get(name, str) for name in self.names]

    @property
    def product(self) -> list[tuple]:
        return list(itertools.product(*self.axes))

    @property
    def cover(self) -> list[tuple]:
        """Rows of the product in which every value of every axis appears (the diagonal)."""
        rows = max(len(values) for values in self.axes)
        out: list[tuple] = []
        for i in range(rows):
            row = tuple(values[i % len(values)] for values in self.axes)
            if row not in out:
                out.append(row)
        return out

    def cells(self) -> list[tuple]:
        """The rows this session runs: the whole product under ``full_matrix``, else the cover."""
        return self.product if full_run() else self.cover

    def params(self) -> list[Any]:
        """The product as ``pytest.param``s, the rows outside the cover marked ``full_matrix``."""
        cover = self.cover
        return [pytest.param(*row, id="-".join(name(v) for name, v in zip(self.ids, row)),
                             marks=() if row in cover else pytest.mark.full_matrix) for row in self.product]

    def parametrize(self, fn: Callable) -> Callable:
        """``@matrix.parametrize`` on a test taking the axes as arguments."""
        return pytest.mark.parametrize(",".join(self.names), self.params())(fn)


class Cases:
    """Hand-picked cases, each a row of attributes (not a whole product): ``make test`` runs a subset in which every
    value of every attribute appears, chosen in the order given; the others are marked ``full_matrix``."""

    def __init__(self, rows: Sequence[tuple], attributes: Sequence[Callable[[tuple], Any]],
                 name: Callable[[tuple], str] = lambda row: str(row[0])) -> None:
        self.rows, self.name = list(rows), name
        missing = {(i, attr(row)) for row in self.rows for i, attr in enumerate(attributes)}
        self.cover: list[tuple] = []
        while missing:  # greedy: the row that covers most of what is missing, first among equals
            best = max(self.rows, key=lambda row: len({(i, a(row)) for i, a in enumerate(attributes)} & missing))
            self.cover.append(best)
            missing -= {(i, a(best)) for i, a in enumerate(attributes)}
        self.cover = [row for row in self.rows if row in self.cover]  # in the given order

    def cells(self) -> list[tuple]:
        return self.rows if full_run() else self.cover

    def params(self) -> list[Any]:
        return [pytest.param(row, id=self.name(row), marks=() if row in self.cover else pytest.mark.full_matrix)
                for row in self.rows]


def covers_every_value(rows: Iterable[tuple], axes: Sequence[Sequence[Any]]) -> bool:
    rows = list(rows)
    return all({row[i] for row in rows} >= set(values) for i, values in enumerate(axes))
