"""Fuzzing the config loader (issue 19, point 4): real configs from the corpus, mutated with a fixed seed
(wrong types, unknown keys, deleted keys, nested nulls, huge, negative and non-finite numbers, broken JSON
text, non-object documents). Every case either loads or raises zeropp's ConfigError (NotSupportedError
included) whose every problem line starts with a JSON path, and that names the mutated key where one was
mutated; never another exception."""
from __future__ import annotations

import json
import math
import random
import re
import warnings
from pathlib import Path
from typing import Any

from zeropp.config import ConfigError, ConfigWarning, load_config
from zeropp.config.auto import AutoValues

CORPUS = Path(__file__).resolve().parents[1] / "data" / "configs"
SEED, CASES, TEXT_CASES = 20261123, 1200, 200
WRONG = ["x", "", "auto", [], [1, 2, 3], {}, {"enabled": True}, None, True, False, 10**30, -7, -1e300, 1.5,
         float("nan"), float("inf"), 0, "5e8", [None], {"": None}]
LINE = re.compile(r"^[^:\s][^:]*: ")  # "<dotted.json.path>: ..." (keys may hold spaces)
GIVEN = AutoValues(given={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                          "gradient_clipping": 1.0, "fp16.enabled": False, "bf16.enabled": True,
                          "optimizer.params.lr": 1e-3, "optimizer.params.betas": [0.9, 0.999],
                          "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
                          "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 1e-3,
                          "scheduler.params.warmup_num_steps": 1, "scheduler.params.total_num_steps": 10},
                   hidden_size=64)


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, prefix + (k,))
    return out


def _parent(tree: dict, path: tuple) -> dict:
    for part in path[:-1]:
        tree = tree[part]
    return tree


def mutate(raw: dict, rng: random.Random) -> tuple[dict | Any, str | None]:
    """One mutation; returns the new document and the key it touched (None when it touched no one key)."""
    raw = json.loads(json.dumps(raw))
    paths = _paths(raw)
    kind = rng.choice(["wrong", "wrong", "wrong", "unknown", "delete", "null_section", "deep", "document"])
    if kind == "document":
        return rng.choice([[raw], 3, "config", None, True]), None
    if kind == "unknown" or not paths:
        dicts = [()] + [p for p in paths if isinstance(_parent(raw, p + ("x",)), dict) and
                        isinstance(_parent(raw, p)[p[-1]], dict)]
        where = rng.choice(dicts)
        key = rng.choice(["stag", "zero_optimisation", "lr ", "enable", "Stage", "x" * 40, "_"]) + str(rng.random())[2:5]
        (_parent(raw, where + ("x",)) if where else raw)[key] = rng.choice(WRONG)
        return raw, key
    path = rng.choice(paths)
    parent, leaf = _parent(raw, path), path[-1]
    if kind == "delete":
        del parent[leaf]
        return raw, None  # a missing key may be legal, or named as required
    if kind == "null_section":
        parent[leaf] = None
    elif kind == "deep":
        parent[leaf] = {"a": {"b": [rng.choice(WRONG)]}}
    else:
        parent[leaf] = rng.choice(WRONG)
    return raw, str(leaf)


def _load(doc: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        load_config(doc, GIVEN)


def test_mutated_configs_load_or_raise_our_error_naming_the_key() -> None:
    rng = random.Random(SEED)
    sources = [json.loads(p.read_text()) for p in sorted(CORPUS.glob("*.json"))]
    loaded = rejected = 0
    for case in range(CASES):
        doc, key = mutate(rng.choice(sources), rng)
        try:
            _load(doc)
            loaded += 1
        except ConfigError as err:
            rejected += 1
            assert err.problems, case
            if isinstance(doc, str):  # a string is a path: the error names the file
                assert f"config file {doc!r}" in str(err), err
                continue
            for line in err.problems:
                assert LINE.match(line), f"case {case}: problem line without a JSON path: {line!r}"
            if key is not None and isinstance(doc, dict):
                assert key in str(err) or _key_hidden(doc, key), f"case {case}: {key!r} not named in {err}"
        # anything else propagates and fails the test: never another exception type
    print(f"\nconfig fuzz: {CASES} cases, {loaded} loaded, {rejected} rejected with ConfigError, 0 other outcomes")
    assert loaded + rejected == CASES and rejected > CASES // 2 and loaded > 0


def _key_hidden(doc: dict, key: str) -> bool:
    """A mutated key the error need not name: it sits under a section that is itself wrong (the error names
    the section), or it is a comment/ignored key, or an "auto"/harmless value that the loader accepts."""
    return key.startswith("_") or key in ("params",)


def test_broken_json_text_names_the_file_and_position(tmp_path: Path) -> None:
    rng = random.Random(SEED + 1)
    texts = [p.read_text() for p in sorted(CORPUS.glob("*.json"))]
    path = tmp_path / "broken.json"
    named = 0
    for case in range(TEXT_CASES):
        text = rng.choice(texts)
        cut = rng.randrange(1, len(text))
        text = text[:cut] if case % 2 else text[:cut] + rng.choice("{}[],:\"x") + text[cut + 1:]
        path.write_text(text)
        try:
            _load(str(path))
        except ConfigError as err:
            assert str(path) in str(err), err
            named += 1
    print(f"\nbroken JSON: {TEXT_CASES} cases, {named} rejected naming the file, {TEXT_CASES - named} still valid")
    assert named > TEXT_CASES // 2


def test_non_finite_numbers_are_named() -> None:
    for value in (float("nan"), float("inf"), -float("inf")):
        try:
            _load({"train_batch_size": 8, "gradient_clipping": value})
        except ConfigError as err:
            assert str(err).startswith("gradient_clipping: ")
        else:
            raise AssertionError(f"gradient_clipping {value} loaded")
        assert math.isnan(value) or math.isinf(value)
