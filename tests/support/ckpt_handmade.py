"""Hand-made checkpoints for single-process tests: the real writer and manifest functions, no engine.

``make_checkpoint(save_dir, tag, seed)`` writes a 2-rank tag of a two-parameter "model" (``w`` of 5 and
``b`` of 2 elements) exactly as ``save_checkpoint`` lays one out (format version 3: safetensors + JSON
shards, sizes, SHA-256, nonce, sealed manifest; ``version=2`` writes the older pickled shards), and
``full_state(seed)`` is what it must load back to.
"""
from __future__ import annotations

import json
import os
import time

import torch

from zeropp.checkpoint.format import LATEST, MANIFEST, atomic_write, atomic_write_text, shard_name
from zeropp.checkpoint.manifest import DIGEST_KEY, seal
from zeropp.checkpoint.safe_io import write_tree

WORLD = 2
SHAPES = {"w": (5,), "b": (2,)}
CHUNKS = {"w": 3, "b": 1}


def full_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _chunk(t: torch.Tensor, rank: int, chunk: int) -> torch.Tensor:
    flat = torch.zeros(chunk * WORLD)
    flat[: t.numel()] = t.reshape(-1)
    return flat[rank * chunk : (rank + 1) * chunk].clone()


def make_checkpoint(save_dir: str, tag: str, seed: int = 0, nonce: str = "", latest: bool = True,
                    created: float | None = None, version: int = 3) -> str:
    """Write tag ``tag`` of ``save_dir`` (and point ``latest`` at it); returns the tag directory."""
    nonce = nonce or f"{seed + 1:012x}"
    state = full_state(seed)
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    shards = []
    for rank in range(WORLD):
        payload = {"format_version": version, "nonce": nonce, "rank": rank, "world_size": WORLD,
                   "params": {n: _chunk(t, rank, CHUNKS[n]) for n, t in state.items()}, "grads": None,
                   "optimizer": {"state": {}, "param_groups": [{"params": [0, 1], "lr": 0.1}]},
                   "scheduler": None, "counters": {"micro_steps": seed, "global_steps": seed}, "rng": None,
                   "buffers": {}, "client_state": {"rank": rank, "seed": seed}}
        name = shard_name(rank, version)
        write = (lambda f, p=payload: write_tree(f, p)) if version >= 3 else (lambda f, p=payload: torch.save(p, f))
        written = atomic_write(os.path.join(tag_dir, name), write)
        shards.append({"rank": rank, "file": name, "bytes": written.size, "sha256": written.sha256})
    raw = {
        "format_version": version, "zeropp_version": "test", "torch_version": torch.__version__, "tag": tag,
        "nonce": nonce, "created_unix": time.time() if created is None else created, "config": None,
        "engine": {"stage": 3, "micro_steps": seed, "global_steps": seed, "gradient_accumulation_steps": 1,
                   "optimizer": "AdamW", "scheduler": None},
        "topology": {"world_size": WORLD, "ranks_per_node": WORLD, "num_nodes": 1, "hpz_partition_size": 1},
        "params": [{"name": n, "aliases": [n], "shape": list(SHAPES[n]), "numel": int(torch.Size(SHAPES[n]).numel()),
                    "unit": 0, "chunk": CHUNKS[n], "world": WORLD, "optimizer_index": i}
                   for i, n in enumerate(SHAPES)],
        "state_dict_keys": [{"key": n, "param": n} for n in SHAPES],
        "shards": shards,
    }
    atomic_write_text(os.path.join(tag_dir, MANIFEST), json.dumps(seal(raw), indent=1))
    if latest:
        atomic_write_text(os.path.join(save_dir, LATEST), tag)
    return tag_dir


def read_raw(tag_dir: str) -> dict:
    with open(os.path.join(tag_dir, MANIFEST)) as f:
        return json.load(f)


def write_raw(tag_dir: str, raw: dict, reseal: bool = False) -> None:
    """Overwrite the manifest (``reseal``: with a matching digest, as a careful forger would)."""
    if reseal:
        raw = seal({k: v for k, v in raw.items() if k != DIGEST_KEY})
    with open(os.path.join(tag_dir, MANIFEST), "w") as f:
        json.dump(raw, f, indent=1)


def to_version_1(tag_dir: str) -> None:
    """Rewrite a version-2 manifest (``make_checkpoint(..., version=2)``) as version 1 wrote it: no nonce, no
    checksums, no digest."""
    raw = read_raw(tag_dir)
    for key in ("nonce", DIGEST_KEY):
        raw.pop(key, None)
    raw["format_version"] = 1
    for shard in raw["shards"]:
        shard.pop("sha256", None)
    write_raw(tag_dir, raw)


def to_legacy(tag_dir: str, version: int) -> None:
    """Rewrite a version-3 tag as zeropp wrote it before (pickled ``.pt`` shards; ``version`` 2 or 1): Python's
    and NumPy's RNG states as their tuples again, a NumPy array among them, as the older writer saved them."""
    import random as _random  # noqa: F401 - the tuples below are the ones random.getstate() returns

    import numpy as np

    from zeropp.checkpoint.format import sha256_file
    from zeropp.checkpoint.safe_io import read_tree
    raw = read_raw(tag_dir)
    for entry in raw["shards"]:
        path = os.path.join(tag_dir, entry["file"])
        shard = read_tree(path)
        rng = shard.get("rng")
        if rng is not None:
            py, nump = rng["python"], rng["numpy"]
            rng["python"] = (py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"])
            rng["numpy"] = (nump["kind"], nump["keys"].numpy().astype(np.uint32), nump["pos"], nump["has_gauss"],
                            nump["cached_gaussian"])
        shard["format_version"] = version
        name = shard_name(entry["rank"], version)
        torch.save({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in shard.items()},
                   os.path.join(tag_dir, name))
        os.unlink(path)
        entry.update(file=name, bytes=os.path.getsize(os.path.join(tag_dir, name)),
                     sha256=sha256_file(os.path.join(tag_dir, name)))
    raw["format_version"] = 2
    write_raw(tag_dir, raw, reseal=True)
    if version == 1:
        to_version_1(tag_dir)
