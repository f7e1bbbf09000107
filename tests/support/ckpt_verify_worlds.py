"""Worker functions for tests/dist/test_checkpoint_integrity.py: each runs on every rank of one world.

- ``verify_world`` (2 ranks): the resume idiom on nothing, saves ``s1`` and ``s2`` of one run, a full disk
  at each write of a save, a failed directory rename of a re-save, a 16-bit export that cannot create its
  directory, every corruption case through the engine with an explicit tag, the ``latest`` fall back, a
  version-1 tag, a few fuzz mutations, checkpoints that do not fit (other parameter groups, other buffer
  shapes), which shard files each rank stats, and a checkpoint saved mid-accumulation.
- ``reshard_world`` (3 ranks): the 2-rank checkpoints loaded on 3 ranks: verified re-sharding, the
  mid-accumulation checkpoint that cannot be re-sharded, a damaged file that only some ranks read, and
  the checkpoints that do not fit.

Results are plain data: errors as ``"Type: message"`` strings, warnings as their messages, and state
comparisons done here (``same_as``) so that little crosses back.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import os
import random
import shutil
import warnings
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import torch
import torch.distributed as dist

import zeropp
from support.ckpt_fuzz import ALWAYS_INVALID, mutate, plan
from support.ckpt_handmade import read_raw, to_legacy, write_raw
from support.ckpt_worlds import SCHED, run_steps
from support.models import TiedNet
from support.train import config
from zeropp.checkpoint import CheckpointWarning, load_full_checkpoint
from zeropp.checkpoint.convert import convert_checkpoint
from zeropp.checkpoint.format import FAULT_ENV, LATEST, MANIFEST, shard_name

CFG = {**config(4), "scheduler": SCHED}
MIDACC = {**config(8), "gradient_accumulation_steps": 2}
FAULTS = ("shard:1", "shard:0", "manifest:0", "latest:0")  # each write of a save, on the rank that does it
FUZZ_SEED = 1919


class BufferNet(TiedNet):
    """TiedNet with a buffer of ``n`` elements (a checkpoint saves it; a load must fit its shape)."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.register_buffer("counts", torch.arange(float(n)))


def _engine(cfg: dict, seed: int, model: Optional[torch.nn.Module] = None, optimizer: Any = None) -> Any:
    torch.manual_seed(seed)
    engine, *_ = zeropp.initialize(model=model if model is not None else TiedNet(), config=copy.deepcopy(cfg),
                                   optimizer=optimizer)
    return engine


def two_groups(params: list) -> torch.optim.Optimizer:
    """AdamW over the masters in the config's order, split in two groups: the same flat positions as the
    one-group optimizer of ``CFG``, so only the grouping differs."""
    return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, weight_decay=0.01)


def outcome(fn: Callable[[], Any]) -> dict:
    """``fn()``'s result or error, and the CheckpointWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, error = fn(), None
        except Exception as err:  # noqa: BLE001 - the test reads the message
            result, error = None, f"{type(err).__name__}: {err}"
    return {"result": result, "error": error,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]}


def same_as(got: dict, want: dict) -> bool:
    return list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def _on_rank0(rank: int, fn: Callable[[], Any]) -> None:
    """Change the shared files on rank 0 only, and let no rank go on before it is done."""
    if rank == 0:
        fn()
    dist.barrier()


def _shard(d: str, tag: str, rank: int) -> str:
    return os.path.join(d, tag, shard_name(rank))


def _flip(path: str, at: int = 300) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def _nonsense(d: str) -> None:
    raw = read_raw(os.path.join(d, "s2"))
    raw["shards"][0]["bytes"] = -1
    write_raw(os.path.join(d, "s2"), raw)


def _edited(d: str) -> None:
    raw = read_raw(os.path.join(d, "s2"))
    raw["engine"]["global_steps"] = 99
    write_raw(os.path.join(d, "s2"), raw)


#: each corruption of tag s2 and the (file, problem) every rank's error must name
CORRUPTIONS: dict[str, tuple[Callable[[str], None], str, str]] = {
    "truncated": (lambda d: os.truncate(_shard(d, "s2", 0), 100), shard_name(0), "truncated"),
    "bitflip_rank1": (lambda d: _flip(_shard(d, "s2", 1)), shard_name(1), "corrupted|checksum mismatch"),
    "missing": (lambda d: os.unlink(_shard(d, "s2", 1)), shard_name(1), "missing"),
    "extra": (lambda d: shutil.copy(_shard(d, "s2", 1), _shard(d, "s2", 2)), shard_name(2), "unexpected"),
    # another save's file differs in its digest, or already in its size (its JSON holds other counters)
    "foreign_shard": (lambda d: shutil.copy(_shard(d, "s1", 1), _shard(d, "s2", 1)), shard_name(1),
                      "corrupted|checksum mismatch|truncated|longer than recorded"),
    "foreign_manifest": (lambda d: shutil.copy(os.path.join(d, "s1", MANIFEST), os.path.join(d, "s2", MANIFEST)),
                         "shard_rank0000", "corrupted|checksum mismatch|truncated|longer than recorded"),
    "nonsense_manifest": (_nonsense, MANIFEST, "key 'shards\\[0\\].bytes' must be an integer >= 0"),
    "edited_manifest": (_edited, MANIFEST, "altered after the save"),
}


def verify_world(rank: int, world: int, root: str) -> dict:
    out: dict[str, Any] = {}
    engine = _engine(CFG, seed=0)
    _on_rank0(rank, lambda: os.makedirs(os.path.join(root, "empty", ".s1.tmp-0123456789ab")))
    out["fresh"] = {name: outcome(lambda d=d: engine.load_checkpoint(os.path.join(root, d)))
                    for name, d in (("missing", "nothing_here"), ("empty", "empty"))}
    run = os.path.join(root, "run")
    states = {}
    for step, tag in enumerate(("s1", "s2")):
        run_steps(engine, rank, world, step, 1, 4)
        engine.save_checkpoint(run, tag=tag, client_state={"tag": tag})
        states[tag] = engine.consolidated_state_dict()
    out["enospc"] = _full_disk(engine, rank, world, os.path.join(root, "full"), states["s2"])
    _on_rank0(rank, lambda: open(os.path.join(root, "blocked"), "w").close())
    out["export_blocked"] = outcome(lambda: engine.save_16bit_model(os.path.join(root, "blocked", "sub")))
    _engine(CFG, seed=0, model=BufferNet(4)).save_checkpoint(os.path.join(root, "buf"), tag="b")
    out["misfits"] = misfits(root)
    out["stats"] = _shard_stats(_engine(CFG, seed=5), run)
    victim = _engine(CFG, seed=5)
    out["corruptions"] = _corruptions(victim, rank, root, run)
    out["fallback"] = _fallbacks(victim, rank, root, run, states)
    out["fuzz"] = _engine_fuzz(victim, rank, root, run, states["s2"])
    gas = _engine(MIDACC, seed=0)
    run_steps(gas, rank, world, 0, 1, 4)  # one micro-step of two: between accumulation boundaries
    gas.save_checkpoint(os.path.join(root, "midacc"))
    return out


def _full_disk(engine: Any, rank: int, world: int, save_dir: str, good_state: dict) -> dict:
    """ENOSPC at each write of a save: the save fails everywhere, the previous tag and ``latest`` stay."""
    engine.save_checkpoint(save_dir, tag="good")
    run_steps(engine, rank, world, 2, 1, 4)  # the engine moves on: a save now would differ from `good`
    out: dict[str, Any] = {}
    for point in FAULTS:
        os.environ[FAULT_ENV] = point
        try:
            res = outcome(lambda: engine.save_checkpoint(save_dir, tag="next"))
        finally:
            del os.environ[FAULT_ENV]
        dist.barrier()
        with open(os.path.join(save_dir, LATEST)) as f:
            res["latest"] = f.read()
        res["listing"] = sorted(os.listdir(save_dir))
        out[point] = res
    dist.barrier()  # every rank listed the directory before rank 0 clears it (a slow rank saw it cleared)
    _on_rank0(rank, lambda: shutil.rmtree(os.path.join(save_dir, "next")))  # complete: left by the `latest` fault
    with _failing_rename(rank, ".good.tmp-"):  # re-saving `good`: the old one is aside when this fails
        res = outcome(lambda: engine.save_checkpoint(save_dir, tag="good"))
    dist.barrier()
    res["listing"] = sorted(os.listdir(save_dir))
    out["rename"] = res
    fresh = _engine(CFG, seed=9)
    loaded = outcome(lambda: fresh.load_checkpoint(save_dir))
    loaded["same_as_good"] = same_as(fresh.consolidated_state_dict(), good_state)
    out["load_after"] = loaded
    return out


@contextlib.contextmanager
def _failing_rename(rank: int, prefix: str) -> Iterator[None]:
    """On rank 0 (the publisher), ``os.rename`` of a directory named ``prefix...`` fails as a full disk does."""
    real = os.rename

    def rename(src: str, dst: str) -> None:
        if os.path.basename(src).startswith(prefix):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src)
        real(src, dst)

    with mock.patch.object(os, "rename", rename) if rank == 0 else contextlib.nullcontext():
        yield


def misfits(root: str) -> dict:
    """Intact checkpoints that do not fit the engine, loaded on this world (same size or re-sharded): the
    run's ``s2`` into an optimizer with two parameter groups (one was saved), and ``buf`` (a 4-element
    buffer) into a model whose buffer has 5 elements. Each must fail on every rank with the engine unchanged."""
    batch = {**CFG, "train_batch_size": 2 * dist.get_world_size()}
    grouped = _engine(batch, seed=3, optimizer=two_groups)
    wider = _engine(batch, seed=3, model=BufferNet(5))
    out = {"groups": _load_keeping_state(grouped, os.path.join(root, "run"), "s2"),
           "buffer": _load_keeping_state(wider, os.path.join(root, "buf"), "b"),
           "groups_weights_only": _load_keeping_state(grouped, os.path.join(root, "run"), "s2",
                                                      load_optimizer_states=False)}
    for res in out.values():
        res.pop("state")
    return out


def _shard_stats(engine: Any, run: str) -> list[str]:
    """The shard files this rank ``stat``s while loading tag ``s2`` (a shared file system pays for each)."""
    seen: list[str] = []
    real = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        name = os.path.basename(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else ""
        if name.startswith("shard_rank"):
            seen.append(name)
        return real(path, *args, **kwargs)

    with mock.patch.object(os, "stat", counting_stat):
        engine.load_checkpoint(run, tag="s2")
    return seen


def _copy(rank: int, src: str, dst: str, damage: Optional[Callable[[str], None]] = None) -> str:
    def make() -> None:
        shutil.copytree(src, dst)
        if damage is not None:
            damage(dst)

    _on_rank0(rank, make)
    return dst


def _load_keeping_state(engine: Any, d: str, tag: Optional[str], **kwargs: Any) -> dict:
    before = engine.consolidated_state_dict()
    res = outcome(lambda: engine.load_checkpoint(d, tag=tag, **kwargs))
    after = engine.consolidated_state_dict()
    res["unchanged"] = same_as(after, before)
    res["state"] = after
    return res


def _corruptions(victim: Any, rank: int, root: str, run: str) -> dict:
    out = {}
    for name, (damage, _, _) in CORRUPTIONS.items():
        d = _copy(rank, run, os.path.join(root, "corrupt", name), damage)
        res = _load_keeping_state(victim, d, "s2")
        res.pop("state")
        out[name] = res
    return out


def _fallbacks(victim: Any, rank: int, root: str, run: str, states: dict) -> dict:
    cases = {
        "corrupt_latest": lambda d: _flip(_shard(d, "s2", 1)),
        "deleted_latest": lambda d: shutil.rmtree(os.path.join(d, "s2")),
        "all_damaged": lambda d: (_flip(_shard(d, "s2", 1)), os.truncate(_shard(d, "s1", 0), 10)),
        # an older zeropp's pickles: refused (weights_only), then loadable once converted
        "version_1": lambda d: to_legacy(os.path.join(d, "s2"), 1),
        "version_1_converted": lambda d: (to_legacy(os.path.join(d, "s2"), 1),
                                          convert_checkpoint(d, "s2", trust_pickle=True)),
    }
    out = {}
    for name, damage in cases.items():
        d = _copy(rank, run, os.path.join(root, "fallback", name), damage)
        res = _load_keeping_state(victim, d, None)
        state = res.pop("state")
        res.update({f"same_as_{tag}": same_as(state, s) for tag, s in states.items()})
        res["explicit"] = outcome(lambda d=d: victim.load_checkpoint(d, tag="s2"))["error"]
        out[name] = res
    return out


def _engine_fuzz(victim: Any, rank: int, root: str, run: str, want: dict) -> list[dict]:
    """Fuzz mutations through the engine's own load path: the kinds that always invalidate a tag, and a
    few drawn from the fuzz plan (those may, by chance, leave the tag meaning the same)."""
    cases = [(kind, FUZZ_SEED + i) for i, kind in enumerate(ALWAYS_INVALID)] + plan(6, FUZZ_SEED)
    out = []
    for i, (kind, seed) in enumerate(cases):
        what: list[str] = []
        d = _copy(rank, run, os.path.join(root, "engine_fuzz", str(i)),
                  lambda d, kind=kind, seed=seed: what.append(mutate(d, "s2", "s1", kind, random.Random(seed))))
        tag = None if kind == "damage_latest" else "s2"
        res = _load_keeping_state(victim, d, tag)
        res["loaded_same"] = same_as(res.pop("state"), want) and res["error"] is None
        res.update(kind=kind, what=what[0] if what else None, result=None)
        out.append(res)
    return out


def reshard_world(rank: int, world: int, root: str) -> dict:
    """Load the 2-rank checkpoints on 3 ranks."""
    engine = _engine({**CFG, "train_batch_size": 6}, seed=7)
    run = os.path.join(root, "run")
    out: dict[str, Any] = {}
    res = _load_keeping_state(engine, run, "s2")
    res["same_as_s2"] = same_as(res.pop("state"), load_full_checkpoint(run, tag="s2").state_dict)
    out["resharded"] = res
    midacc = _load_keeping_state(engine, os.path.join(root, "midacc"), None)
    midacc.pop("state")
    out["midacc"] = midacc
    d = _copy(rank, run, os.path.join(root, "reshard_corrupt"), lambda d: _flip(_shard(d, "s2", 1)))
    bad = _load_keeping_state(engine, d, "s2")
    bad.pop("state")
    out["corrupt"] = bad
    fell = _load_keeping_state(engine, d, None)
    fell["same_as_s1"] = same_as(fell.pop("state"), load_full_checkpoint(run, tag="s1").state_dict)
    out["fallback"] = fell
    out["misfits"] = misfits(root)
    return out
