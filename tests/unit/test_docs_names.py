"""docs/architecture.md names what exists: every path it cites in backticks exists, every dotted name whose root is
one of zeropp's classes or modules resolves to an attribute of it, and every config key is in the schema."""
from __future__ import annotations

import ast
import fnmatch
import functools
import os
import re
from pathlib import Path
from typing import Iterator, Optional

import pytest
from pydantic import BaseModel

import zeropp
from zeropp.config.loader import ZeroppConfig

SRC = Path(zeropp.__file__).resolve().parent  # src/zeropp
ROOT = SRC.parent.parent
DOC = ROOT / "docs" / "architecture.md"
PATH_SUFFIXES = (".py", ".md", ".json", ".sh", ".toml", ".txt", ".cfg")
#: names that stand for an instance of one of zeropp's classes in the prose (any of the classes listed)
INSTANCES = {"engine": ("ZeroEngine", "ZeroppEngine"), "unit": ("Unit",), "policy": ("TrainPolicy",),
             "topo": ("Topology",), "link": ("HostLink",), "residency": ("Resident", "NvmeResidency"),
             "state": ("EngineState",), "gathers": ("Gathers",), "ledger": ("CommLedger",)}
#: classes of torch and others that the prose names with an attribute
EXTERNAL_CLASSES = {"Tensor", "Module", "TorchFunctionMode", "OptimizedModule", "Trainer", "TrainingArguments"}
#: dotted names in the prose that start like a config section but are a torch object's method
NOT_KEYS = {"optimizer.step", "optimizer.zero_grad", "scheduler.step"}


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text())


def backticked(text: str) -> Iterator[str]:
    """The spans in single backticks, outside fenced code blocks."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    yield from re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)


def _classes_and_modules() -> tuple[dict[str, list[Path]], dict[str, Path]]:
    """zeropp's class names (the files defining each) and its module names (dotted, and the bare last part)."""
    classes: dict[str, list[Path]] = {}
    modules: dict[str, Path] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        dotted = ".".join(rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts)
        modules[dotted] = path
        modules.setdefault(dotted.split(".")[-1], path)
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(path)
    return classes, modules


@functools.lru_cache(maxsize=None)
def _class_attributes(path: Path, name: str) -> set[str]:
    """Attributes of class ``name`` in ``path`` as its source defines them: methods, class-level names and
    ``self.x`` assignments, with those of its bases that live in the same file."""
    tree = _tree(path)
    found = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    out: set[str] = set()
    todo = [name]
    while todo:
        node = found.get(todo.pop())
        if node is None:
            continue
        todo += [b.id for b in node.bases if isinstance(b, ast.Name)]
        # a class decorator that adds attributes names them (``@_state_views("units", ...)`` on the engine)
        out.update(c.value for d in node.decorator_list if isinstance(d, ast.Call) for c in ast.walk(d)
                   if isinstance(c, ast.Constant) and isinstance(c.value, str))
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(item.name)
            elif isinstance(item, ast.Assign):
                out.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                out.add(item.target.id)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                    and isinstance(sub.ctx, ast.Store):
                out.add(sub.attr)
    return out


@functools.lru_cache(maxsize=None)
def _module_attributes(path: Path) -> set[str]:
    tree = _tree(path)
    out = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
    for n in tree.body:
        if isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, (ast.ImportFrom, ast.Import)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
    if path.name == "__init__.py":
        out.update(p.stem for p in path.parent.glob("*.py"))
        out.update(p.name for p in path.parent.iterdir() if p.is_dir())
    return out


def _config_key(dotted: str) -> Optional[bool]:
    """Whether ``dotted`` is a config key (from the top or from ``zero_optimization``); None when its first part
    is no config section at all."""
    def walk(model: type[BaseModel], parts: list[str]) -> bool:
        for i, part in enumerate(parts):
            field = model.model_fields.get(part)
            if field is None:
                return False
            if i == len(parts) - 1:
                return True
            nxt = [a for a in getattr(field.annotation, "__args__", (field.annotation,))
                   if isinstance(a, type) and issubclass(a, BaseModel)]
            if not nxt:
                return False
            model = nxt[0]
        return True
    parts = dotted.split(".")
    zero = ZeroppConfig.model_fields["zero_optimization"].annotation
    if parts[0] in ZeroppConfig.model_fields:
        return walk(ZeroppConfig, parts)
    if parts[0] in zero.model_fields:
        return walk(zero, parts)
    return None


def _files() -> list[str]:
    """Every file and folder of the repository, as a path relative to its root (``.venv`` and caches left out)."""
    out = []
    for here, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "build")]
        rel = os.path.relpath(here, ROOT)
        out += [os.path.normpath(os.path.join(rel, n)) for n in dirs + names]
    return out


def _has_attribute(classes: dict[str, list[Path]], names: tuple[str, ...], attr: str) -> bool:
    return any(attr in _class_attributes(p, name) for name in names for p in classes.get(name, ()))


@functools.lru_cache(maxsize=None)
def _defined_names() -> frozenset[str]:
    """Every name zeropp's source defines: functions, classes, arguments, attributes it assigns."""
    out: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
    return frozenset(out)


def problems(text: str) -> list[str]:
    classes, modules = _classes_and_modules()
    files = _files()
    defined = _defined_names()
    top = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    out = []
    for span in backticked(text):
        token = span.strip().split("::")[0]
        token = re.sub(r"\(.*\)$", "", token)  # a call: its name
        if " " in token or not token:
            continue
        if "/" in token or token.endswith(PATH_SUFFIXES):
            token = token.rstrip("/")
            # a path from the root, or a file or folder named by its last parts (`runtime/engine.py` in the row of
            # `deepspeed/`, `zero/engine.py` under src/zeropp)
            if not any(fnmatch.fnmatch(f, token) or fnmatch.fnmatch(f, "*/" + token) for f in files):
                out.append(f"path `{token}` does not exist")
            continue
        if re.fullmatch(r"_[a-z]\w*", token):  # a private name: the code's
            if token not in defined:
                out.append(f"`{token}` is defined nowhere in src/")
            continue
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", token):
            continue
        parts = token.split(".")
        key = _config_key(token)
        # a config key: found in the schema; `topology.build` is a module's function (topology.py)
        if token not in NOT_KEYS and (key or (key is False and parts[0] not in top)):
            if not key:
                out.append(f"config key `{token}` is not in the schema")
            continue
        if parts[0] in INSTANCES:
            if not _has_attribute(classes, INSTANCES[parts[0]], parts[1]):
                out.append(f"`{token}`: {'/'.join(INSTANCES[parts[0]])} has no attribute {parts[1]!r}")
            continue
        root = parts[0]
        if root in classes:
            if not _has_attribute(classes, (root,), parts[1]):
                out.append(f"`{token}`: {root} has no attribute {parts[1]!r}")
            continue
        if root == "zeropp":
            parts, root = parts[1:], parts[1] if len(parts) > 1 else root
        if root in top:
            path = modules[f"zeropp.{root}"]
            # walk modules as far as the dots go, then one attribute of the last module
            i = 1
            while i < len(parts) and path.name == "__init__.py" and (
                    (path.parent / f"{parts[i]}.py").exists() or (path.parent / parts[i] / "__init__.py").exists()):
                nxt = path.parent / f"{parts[i]}.py"
                path = nxt if nxt.exists() else path.parent / parts[i] / "__init__.py"
                i += 1
            if i < len(parts) and parts[i] not in _module_attributes(path):
                if parts[i] in classes and len(parts) > i + 1:
                    continue
                out.append(f"`{token}`: {path.relative_to(SRC.parent)} has no {parts[i]!r}")
            elif i + 1 < len(parts) and parts[i] in classes:
                attrs = set().union(*(_class_attributes(p, parts[i]) for p in classes[parts[i]]))
                if parts[i + 1] not in attrs:
                    out.append(f"`{token}`: {parts[i]} has no attribute {parts[i + 1]!r}")
            continue
        if root[:1].isupper() and root not in EXTERNAL_CLASSES:
            out.append(f"`{token}`: no class {root!r} in src/")
    return out


def test_architecture_names_only_what_exists() -> None:
    found = problems(DOC.read_text())
    assert not found, "docs/architecture.md names what the code lacks:\n" + "\n".join(found)


@pytest.mark.parametrize("text, bad", [
    ("`zero/engine.py` and `zero/no_such.py`", "no_such.py"),
    ("`ZeroEngine.forward` then `ZeroEngine._no_such_method`", "_no_such_method"),
    ("`Gathers.regroup`, `Gathers.nothing_here`", "nothing_here"),
    ("`zero_optimization.stage` and `zero_optimization.stage9`", "stage9"),
    ("`offload_param.device` but `offload_param.devise`", "devise"),
    ("`zeropp.zero.GatheredParameters` yet `zeropp.zero.Nothing`", "Nothing"),
    ("`zero.GatheredParameters` yet `zero.gathers.Nothing`", "Nothing"),
    ("`optimizer.step()` is torch's; `optimizer.typo_key` is no key", "typo_key"),
    ("`NoSuchClass.attr`", "NoSuchClass"),
    ("`engine.memory_report` beside `engine.no_report`", "no_report"),
    ("`_prefetch` then `_start_gather`", "_start_gather"),
])
def test_the_check_finds_a_name_that_does_not_exist(text: str, bad: str) -> None:
    found = problems(text)
    assert len(found) == 1 and bad in found[0], found
