"""The engine's parts share one state with one writer per mode, and one part decides releases (Note [engine state]
in zero/state.py, Note [one owner for release] in zero/release.py): checked on the source with ``ast``."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import zeropp
from zeropp.zero import buckets, gathers, grad_intake, hooks, optimizer_step, param_use, release, spans, stepping

SRC = Path(zeropp.__file__).resolve().parent
ZERO = SRC / "zero"

#: where the pass is: each mode of the state and the one module that assigns it
WRITERS = {"phase": "stepping.py", "quiet": "stepping.py", "held_whole": "release.py", "direct": "param_use.py"}


def _trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(SRC)): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}


def _on_state(node: ast.Attribute) -> bool:
    """``state.x`` or ``<...>.state.x``: an attribute of the engine's state."""
    owner = node.value
    return (owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")) == "state"


def _assigned_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    """The state's attributes assigned in ``tree``."""
    out = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and _on_state(t):
                    out.append((t.lineno, t.attr))
    return out


def test_each_mode_of_the_state_has_one_writer() -> None:
    found = {name: set() for name in WRITERS}
    for path, tree in _trees().items():
        for _, attr in _assigned_attributes(tree):
            if attr in found:
                found[attr].add(path)
    for name, module in WRITERS.items():
        assert found[name] == {f"zero/{module}"}, (name, found[name])


def test_the_writer_check_sees_assignments() -> None:
    tree = ast.parse("state.phase = 1\nself.state.quiet, state.held_whole = a, b\nx.state.direct += 1\n"
                     "y = state.phase\nother.phase = 2\n")
    assert {a for _, a in _assigned_attributes(tree)} == {"phase", "quiet", "held_whole", "direct"}


def _calls(tree: ast.AST, receiver: str, methods: set[str]) -> list[int]:
    """Lines calling ``<...>.receiver.method(...)`` or ``receiver.method(...)`` for a method in ``methods``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name == receiver:
                out.append(node.lineno)
    return out


def test_units_are_dropped_only_where_releases_decide() -> None:
    # Gathers.drop / Gathers.free release a unit's full weights; only Releases calls them (Gathers itself frees
    # a persistent unit whose shard changed before gathering it afresh)
    callers = {path for path, tree in _trees().items() if _calls(tree, "gathers", {"drop", "free"})}
    assert callers == {"zero/release.py"}, callers


def _reads(tree: ast.AST, attrs: set[str]) -> list[tuple[int, str]]:
    """The state's (or the spans') attributes in ``attrs`` read in ``tree``."""
    def on(n: ast.Attribute) -> bool:
        owner = n.value
        return _on_state(n) or (owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")) == "spans"
    return [(n.lineno, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in attrs and on(n)]


def test_release_conditions_are_read_in_one_class() -> None:
    # what holds a unit: the model held whole, a mixed unit, a running forward's hold or learned span
    conditions = {"held_whole", "mixed", "holding", "span_of"}
    where = {path for path, tree in _trees().items() if _reads(tree, conditions)}
    assert where == {"zero/release.py"}, where
    assert {a for _, a in _reads(_trees()["zero/release.py"], conditions)} == conditions


PARTS = [gathers.Gathers, spans.Spans, release.Releases, param_use.ParamUse, grad_intake.GradIntake,
         buckets.GradBuckets, hooks.ModuleHooks, optimizer_step.OptimizerStep, stepping.Stepping]


@pytest.mark.parametrize("part", PARTS, ids=lambda c: c.__name__)
def test_parts_take_the_state_and_a_few_inputs(part: type) -> None:
    params = [p for p in inspect.signature(part.__init__).parameters.values() if p.name not in ("self", "state")]
    assert len(params) <= 6, (part.__name__, [p.name for p in params])
    assert not [p for p in params if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    annotations = " ".join(str(p.annotation) for p in params)
    assert "Callable" not in annotations, (part.__name__, annotations)  # no calls back into the engine


def test_the_engine_hands_its_parts_no_lambdas() -> None:
    tree = ast.parse((ZERO / "engine.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"
                and any(isinstance(a, ast.arg) and a.arg == "module" for a in n.args.args))
    parts = {c.__name__ for c in PARTS} | {"ActivationMeter", "PrefetchBudget", "EngineState"}
    handed = [n for n in ast.walk(init) if isinstance(n, ast.Call) and getattr(n.func, "id", "") in parts]
    assert len(handed) >= 8  # not vacuous: the parts are built here
    assert not [n.lineno for c in handed for n in ast.walk(c) if isinstance(n, ast.Lambda)]


def test_the_engine_module_is_at_most_400_lines() -> None:
    assert len((ZERO / "engine.py").read_text().splitlines()) <= 400
