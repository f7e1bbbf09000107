"""The import graph keeps its layers (docs/architecture.md): checked on the source with ``ast``, so an import
inside a function body counts as much as one at the top of a file, and nothing has to be imported to check."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

import zeropp

SRC = Path(zeropp.__file__).resolve().parent  # src/zeropp
#: Packages below the entry points (L0-L3): they must not import the package root, whose __init__ imports
#: api.py and so the whole library (a cycle from below; a version string comes from zeropp._version).
BELOW_ROOT = ("zero", "checkpoint", "comm", "partition", "plus", "quant", "offload")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of everything ``source`` (the text of ``module``) imports, at any depth:
    ``import a.b``, ``from a import b`` (as ``a.b``), relative imports resolved, and
    ``importlib.import_module("a.b")`` / ``__import__("a.b")`` with a literal name."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from ..x import y: climb level - 1 packages from this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def _sources(*packages: str) -> Iterator[tuple[Path, str]]:
    for package in packages:
        for path in sorted((SRC / package).rglob("*.py")):
            yield path, _module_name(path)


def _imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    return imported_modules(path.read_text(), module, is_package=path.name == "__init__.py")


def _is_checkpoint(name: str) -> bool:
    return name == "zeropp.checkpoint" or name.startswith("zeropp.checkpoint.")


def test_engine_never_imports_checkpoint() -> None:
    # The engine exposes state and checkpoint/ reads it (checkpoint.CheckpointingEngine adds the methods);
    # an import back, even a lazy one inside a method, is the cycle zero/engine -> checkpoint -> zero/engine.
    found = [f"{path.relative_to(SRC.parent)}:{line} imports {name}"
             for path, module in _sources("zero") for line, name in _imports(path, module) if _is_checkpoint(name)]
    assert not found, "zeropp.zero must not import zeropp.checkpoint:\n" + "\n".join(found)


def test_lower_layers_never_import_the_package_root() -> None:
    submodules = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir() if p.is_dir()}
    found = []
    for path, module in _sources(*BELOW_ROOT):
        for line, name in _imports(path, module):
            # `from zeropp import native` names a module (fine); `import zeropp` or `from zeropp import
            # initialize` runs zeropp/__init__.py
            if name == "zeropp" or (name.startswith("zeropp.") and name.count(".") == 1
                                    and name.split(".")[1] not in submodules):
                found.append(f"{path.relative_to(SRC.parent)}:{line} imports {name}")
    assert not found, "import the specific module instead of the zeropp package:\n" + "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "from zeropp.checkpoint import save_checkpoint",
    "import zeropp.checkpoint.engine_io as io",
    "from zeropp import checkpoint",
    "from ..checkpoint import format",
    "def save(self):\n    from zeropp.checkpoint import save_checkpoint\n    return save_checkpoint(self)",
    "class E:\n    def f(self):\n        import importlib\n        return importlib.import_module('zeropp.checkpoint')",
])
def test_the_check_sees_every_form_of_import(snippet: str) -> None:
    names = [n for _, n in imported_modules(textwrap.dedent(snippet), "zeropp.zero.engine")]
    assert any(_is_checkpoint(n) for n in names), names


def test_the_check_reads_the_real_tree() -> None:
    # not vacuous: the engine module is found and its own imports are seen
    modules = {module: path for path, module in _sources("zero")}
    assert "zeropp.zero.engine" in modules
    names = {n for _, n in _imports(modules["zeropp.zero.engine"], "zeropp.zero.engine")}
    assert "zeropp.zero.grad_intake.GradIntake" in names


# ---- no cycles ---------------------------------------------------------------------------------------------
def _typing_only(tree: ast.AST) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:`` (annotations only: no import at run time)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for n in ast.walk(node))
    return out


def import_graph(typing_too: bool = False) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports at run time, at any depth of its body
    (``typing_too``: and under ``if TYPE_CHECKING:``). ``from a.b import c`` is an edge to ``a.b.c`` where that is
    a module (a package's ``__init__`` that only names its modules is no dependency of theirs), else to ``a.b``."""
    paths = {module: path for path, module in _sources(*[p.name for p in SRC.iterdir() if p.is_dir()])}
    paths.update({_module_name(p): p for p in SRC.glob("*.py")})
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        source = path.read_text()
        tree = ast.parse(source)
        skip = _typing_only(tree)
        typing_lines = {n.lineno for n in ast.walk(tree) if id(n) in skip and hasattr(n, "lineno")}
        deps = set()
        for line, name in imported_modules(source, module, is_package=path.name == "__init__.py"):
            if line in typing_lines and not typing_too:
                continue
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])  # zeropp.zero.engine -> zeropp.zero; zeropp.api stays


def test_no_module_imports_itself_round_a_cycle() -> None:
    assert not cycles(import_graph())


def test_no_cycle_even_through_annotations() -> None:
    # imports under `if TYPE_CHECKING:` count too: an annotation that needs a cycle is a dependency that goes up
    assert not cycles(import_graph(typing_too=True))


#: functions over an engine take its state (zero/state.py), never the engine's module (Note [engine state])
OVER_THE_ENGINE = ("zeropp.zero.reports", "zeropp.zero.memory", "zeropp.zero.gathered", "zeropp.zero.teardown",
                   "zeropp.zero.consolidated", "zeropp.zero.param_state")


def test_functions_over_the_engine_do_not_import_it() -> None:
    graph = import_graph(typing_too=True)
    over = [m for m in graph if m in OVER_THE_ENGINE or _is_checkpoint(m)]
    assert len(over) >= len(OVER_THE_ENGINE) + 5  # not vacuous: the modules and checkpoint/ are there
    found = [m for m in over if "zeropp.zero.engine" in graph[m]]
    assert not found, f"these import zeropp.zero.engine (take zeropp.zero.state's EngineState/EngineHandle): {found}"


def test_no_two_packages_import_each_other() -> None:
    packages: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        packages.setdefault(_package(module), set()).update(_package(d) for d in deps if _package(d) != _package(module))
    assert not cycles(packages)


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not cycles({"a": {"b"}, "b": set()})
    graph = import_graph()  # not vacuous: the real tree, with the edges the code has
    assert "zeropp.zero.grad_intake" in graph["zeropp.zero.engine"] and len(graph) > 100


# ---- DeepSpeed's vocabulary stays in zeropp/deepspeed -----------------------------------------------------
#: modules outside zeropp/deepspeed whose code may name DeepSpeed, and why (docstrings, comments, messages and
#: config keys, which are strings, may name it anywhere)
DEEPSPEED_NAMES_ALLOWED = {
    "zeropp": "the root exports DeepSpeed's module API (import zeropp as deepspeed) and the alias installer",
    "zeropp.tools.cli": "the export-deepspeed command calls the layer's exporter",
    "zeropp.tools.run": "the launcher installs the alias before the script it runs",
    "zeropp.tools.cluster_bench.systems": "the benchmark runs real DeepSpeed as a peer",
    "zeropp.tools.cluster_bench.run": "the benchmark runs real DeepSpeed as a peer",
    "zeropp.hf.trainer": "the Trainer detects TrainingArguments.deepspeed",
    "zeropp.tools.boot.sitecustomize": "the launcher's spawned processes install the alias at start",
}


def deepspeed_names(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every identifier (not string or comment) that contains "deepspeed", any case."""
    import io
    import tokenize
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.NAME and "deepspeed" in tok.string.lower()]


def test_deepspeed_names_live_in_the_deepspeed_package() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        if module == "zeropp.deepspeed" or module.startswith("zeropp.deepspeed.") or module in DEEPSPEED_NAMES_ALLOWED:
            continue
        found += [f"{path.relative_to(SRC.parent)}:{line} {name}" for line, name in deepspeed_names(path.read_text())]
    assert not found, "DeepSpeed's names belong in zeropp/deepspeed/:\n" + "\n".join(found)


def test_the_name_check_sees_identifiers_only() -> None:
    snippet = ('"""DeepSpeed\'s behaviour."""\nfrom zeropp.deepspeed import x  # deepspeed\n'
               'msg = "zero_optimization: as DeepSpeed reads it"\nDeepSpeedThing = is_deepspeed_on()\n')
    assert deepspeed_names(snippet) == [(2, "deepspeed"), (4, "DeepSpeedThing"), (4, "is_deepspeed_on")]
    allowed = {m for m in DEEPSPEED_NAMES_ALLOWED if m != "zeropp"}  # not vacuous: each names a real module
    assert all((SRC.parent / (m.replace(".", "/") + ".py")).exists() for m in allowed)


# ---- sizes ------------------------------------------------------------------------------------------------
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def test_no_module_is_over_800_lines() -> None:
    long = {str(p.relative_to(SRC.parent)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules (over {MAX_MODULE_LINES} lines): {long}"


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name}"] = n
    assert not long, f"split these functions (over {MAX_FUNCTION_LINES} lines): {long}"
