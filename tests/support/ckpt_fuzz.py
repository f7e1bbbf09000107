"""Mutations of a saved checkpoint for the fuzz tests: flipped bits, cut and grown files, swapped, dropped
and extra shards, edited manifests (by bytes and by JSON structure), a damaged ``latest``.

``mutate(save_dir, tag, other, kind, rng)`` changes ``save_dir`` in place (``tag`` is the tag under test,
``other`` an older tag of the same run) and returns a one-line description. ``plan(n, seed)`` is the fixed
list of ``(kind, seed)`` cases, every kind equally often. ``FORGED`` kinds rewrite the manifest's own
digest too, as a writer with a bug (or a forger) would: they test that nothing but ``CheckpointError``
escapes, since a consistent lie cannot be told from the truth.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

from zeropp.checkpoint.format import LATEST, MANIFEST, shard_name
from zeropp.checkpoint.manifest import DIGEST_KEY, seal

KINDS = ("flip_shard", "flip_manifest", "cut_shard", "cut_manifest", "grow_shard", "edit_manifest",
         "swap_shard", "drop_shard", "extra_shard", "damage_latest", "forge_manifest")
FORGED = ("forge_manifest",)
#: kinds that always make tag ``tag`` invalid (the rest may, by chance, leave it meaning the same)
ALWAYS_INVALID = ("flip_shard", "cut_shard", "grow_shard", "swap_shard", "drop_shard", "extra_shard")


def plan(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(KINDS[i % len(KINDS)], rng.randrange(2**31)) for i in range(n)]


def _shards(tag_dir: str) -> list[str]:
    return sorted(f for f in os.listdir(tag_dir) if f.startswith("shard_rank"))


def _flip_bits(path: str, rng: random.Random, count: int) -> str:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        spots = [rng.randrange(len(data)) for _ in range(count)]
        for at in spots:
            data[at] ^= 1 << rng.randrange(8)
        f.seek(0)
        f.write(data)
    return f"flipped bits at {spots} of {os.path.basename(path)}"


def _cut(path: str, rng: random.Random) -> str:
    size = os.path.getsize(path)
    keep = rng.randrange(size)
    os.truncate(path, keep)
    return f"cut {os.path.basename(path)} to {keep} of {size} bytes"


def _nodes(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (dict keys and list indices), the root excluded."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        out.append(path + (key,))
        out += _nodes(child, path + (key,))
    return out


_VALUES: list[Any] = [None, -1, 0, 1, 2**40, 1.5, "x", "", [], {}, True, float("nan")]


def _edit_json(raw: dict, rng: random.Random) -> str:
    path = rng.choice(_nodes(raw))
    parent = raw
    for key in path[:-1]:
        parent = parent[key]
    key, old = path[-1], parent[path[-1]]
    op = rng.choice(["delete", "set", "set", "bump", "swap", "retype"])
    if op == "delete":
        del parent[key]
    elif op == "bump" and isinstance(old, (int, float)) and not isinstance(old, bool):
        parent[key] = old + rng.choice([-1, 1, 7])
    elif op == "swap" and isinstance(old, list) and len(old) > 1:
        parent[key] = old[::-1]
    elif op == "retype":
        parent[key] = str(old) if not isinstance(old, str) else [old]
    else:
        op, parent[key] = "set", rng.choice(_VALUES)
    return f"{op} {'.'.join(map(str, path))} (was {json.dumps(old)[:30]})"


def mutate(save_dir: str, tag: str, other: str, kind: str, rng: random.Random) -> str:
    """Apply one mutation of ``kind`` to ``save_dir`` (tag ``tag``); returns what was done."""
    tag_dir = os.path.join(save_dir, tag)
    manifest = os.path.join(tag_dir, MANIFEST)
    shard = os.path.join(tag_dir, rng.choice(_shards(tag_dir)))
    if kind == "flip_shard":
        return _flip_bits(shard, rng, rng.randint(1, 4))
    if kind == "flip_manifest":
        return _flip_bits(manifest, rng, 1)
    if kind == "cut_shard":
        return _cut(shard, rng)
    if kind == "cut_manifest":
        return _cut(manifest, rng)
    if kind == "grow_shard":
        with open(shard, "ab") as f:
            f.write(rng.randbytes(rng.randint(1, 64)))
        return f"appended bytes to {os.path.basename(shard)}"
    if kind == "swap_shard":
        shutil.copy(os.path.join(save_dir, other, os.path.basename(shard)), shard)
        return f"{os.path.basename(shard)} replaced by tag {other}'s"
    if kind == "drop_shard":
        os.unlink(shard)
        return f"deleted {os.path.basename(shard)}"
    if kind == "extra_shard":
        name = shard_name(len(_shards(tag_dir)) + rng.randrange(3))
        shutil.copy(shard, os.path.join(tag_dir, name))
        return f"added {name}"
    if kind == "damage_latest":
        text = rng.choice([b"", b"\xff\xfe", b"nope", b"../" + tag.encode(), b".hidden", other.encode() + b"x"])
        with open(os.path.join(save_dir, LATEST), "wb") as f:
            f.write(text)
        return f"latest holds {text!r}"
    with open(manifest) as f:
        raw = json.load(f)
    what = _edit_json(raw, rng)
    if kind == "forge_manifest":
        raw = seal({k: v for k, v in raw.items() if k != DIGEST_KEY})
    with open(manifest, "w") as f:
        json.dump(raw, f, indent=1)
    return ("forged: " if kind in FORGED else "") + what
