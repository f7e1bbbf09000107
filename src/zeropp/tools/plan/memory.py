"""Memory per rank: the model states ``engine.model_state_bytes()`` reports (exactly, by kind), where they live,
and estimates of what a step needs on top (gathered units, buckets, activations).

Model states are read at the point where a step holds the most of them: after backward, before the optimizer
step (stages 0-1 hold whole gradients then; stage 2 its gradient shard; hpZ's slices exist since forward).
The formulas are ``accounting.py``'s (ZeRO section 5, with our padding; ZeRO++ section 3.2 for hpZ): each kind
is one of them with the other kinds' byte counts set to zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from zeropp import accounting
from zeropp.config.policy import BUCKETS_IN_FLIGHT, largest_bucket
from zeropp.offload.cpu_adam import moment_storage_bytes
from zeropp.partition.spec import ShardSpec
from zeropp.tools.plan.choices import Choice
from zeropp.tools.plan.model import ModelSpec, activation_bytes

KINDS = ("master_fp32", "shard_16bit", "grad_shard", "optimizer_state", "gathered_params", "full_grads",
         "bucket_grads", "hpz_secondary")
#: Kinds that optimizer offload keeps in host memory.
HOST_KINDS = ("master_fp32", "optimizer_state", "grad_shard")


def _rows(numels: Sequence[int], world: int, bytes_per_elem: int) -> int:
    """Bytes of one flat row per rank (every parameter's chunk, padded) at ``bytes_per_elem``."""
    return accounting.model_state_bytes(numels, world, grad_bytes=0, optimizer_bytes=bytes_per_elem, shard_bytes=0)


def model_states(numels: Sequence[int], choice: Choice, world: int, bf16: bool = True, moment_bytes: int = 8,
                 separate_device: bool = False) -> dict[str, int]:
    """``engine.model_state_bytes()`` after backward and before the step, by kind, plus ``total``.

    ``moment_bytes``: optimizer state per element (8: Adam's two fp32 moments; 4: SGD momentum).
    ``separate_device``: the ranks compute on an accelerator apart from host memory; with optimizer offload
    the engine then keeps a device copy of the 16-bit shard and a host row to stage its upload.
    """
    elem = 2 if bf16 else 4
    shard_world = world if choice.stage >= 1 else 1
    out = dict.fromkeys(KINDS, 0)
    out["master_fp32"] = _rows(numels, shard_world, 4)
    out["optimizer_state"] = _rows(numels, shard_world, moment_bytes)
    if choice.offload and moment_bytes == 8:  # CpuAdam staggers large moments inside slightly longer buffers
        out["optimizer_state"] = sum(2 * moment_storage_bytes(ShardSpec(n, (n,), shard_world).chunk) for n in numels)
    staged = choice.offload and separate_device
    if choice.stage == 3:
        out["shard_16bit"] = _rows(numels, world, elem) if bf16 or staged else 0  # fp32: the master itself
        out["grad_shard"] = _rows(numels, world, elem)
        if choice.hpz > 1:
            out["hpz_secondary"] = (accounting.model_state_bytes(numels, world, 0, 0, elem, hpz_group=choice.hpz)
                                    - accounting.model_state_bytes(numels, world, 0, 0, elem))
    else:
        out["gathered_params"] = _rows(numels, shard_world, elem) * shard_world  # padded full weights
        if choice.stage == 2:
            out["grad_shard"] = _rows(numels, world, elem)
        else:
            out["full_grads"] = sum(numels) * elem
        if staged:
            out["shard_16bit"] = _rows(numels, shard_world, elem)  # the device copy of the shard
    if staged and bf16:
        out["shard_16bit"] += _rows(numels, shard_world, elem)  # the host row the optimizer writes
    out["total"] = sum(out[k] for k in KINDS)
    return out


@dataclass(frozen=True)
class Memory:
    """Per rank: model states (exact), where they sit, and the step's working set (estimated)."""

    states: dict[str, int]
    device_states: int  # model states in accelerator memory
    host_states: int
    working: int  # gathered units and gradient buckets in flight
    activations: int

    @property
    def need(self) -> int:
        """Accelerator bytes a step needs: model states there, plus working set and activations."""
        return self.device_states + self.working + self.activations


def memory(model: ModelSpec, choice: Choice, world: int, micro_batch: int, seq_len: int, bucket: int,
           checkpointing: bool, bf16: bool = True, separate_device: bool = True) -> Memory:
    """Model states of ``choice`` for ``model`` plus estimates of the step's working set and activations.

    Working set: stage 3 holds the root unit and two more units' full 16-bit weights at once (the one
    computing and the prefetched one); every stage with more than one rank holds two buckets of gradients
    of half ``bucket`` each (the one filling, the one reducing) and the reducing one's received rows.
    """
    elem = 2 if bf16 else 4
    states = model_states(model.numels, choice, world, bf16, separate_device=separate_device)
    host = 0  # without a separate device, host memory is the ranks' memory: everything counts
    if choice.offload and separate_device:
        host = sum(states[k] for k in HOST_KINDS) + (states["shard_16bit"] // 2 if bf16 else 0)  # + staged row
    # two buckets in flight, each with its receive rows (Note [bucket size]); nothing with one rank
    per_bucket = min(largest_bucket(bucket, max(model.numels, default=0)), model.params)
    working = BUCKETS_IN_FLIGHT * per_bucket * 2 * elem if world > 1 else 0
    if choice.stage == 3:
        sizes = sorted((u.numel for u in model.units[1:]), reverse=True)[:2]
        working += (model.units[0].numel + sum(sizes)) * elem
    acts = activation_bytes(model, micro_batch, seq_len, checkpointing, elem)
    return Memory(states, states["total"] - host, host, working, acts)
