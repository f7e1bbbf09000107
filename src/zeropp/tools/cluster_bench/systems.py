"""The systems compared by ``zeropp bench``, each behind one small interface, built inside a rank.

Every system trains the same GPT from the same seed on the same batches with the same AdamW (lr, betas, eps,
weight decay on every parameter), gradient clipping at 1.0, bf16 compute and bf16 gradient communication:

- ``ddp``: ``DistributedDataParallel`` (gloo), fp32 weights under ``torch.autocast(bf16)``, gradients
  all-reduced in bf16 (torch's ``bf16_compress_hook`` minus its CUDA-only check).
- ``fsdp2`` / ``fsdp2_hpz``: ``fully_shard`` per transformer block and on the root, ``MixedPrecisionPolicy(param_dtype
  =bf16, reduce_dtype=bf16)``; ``fsdp2_hpz`` passes ``reshard_after_forward=R`` (keeps a 1/R shard after forward
  and gathers backward inside groups of R consecutive ranks: FSDP2's analogue of hpZ).
- ``ds_zero3`` / ``ds_zero3_hpz``: DeepSpeed ZeRO-3 (``DS_ACCELERATOR=cpu``, gloo), bf16, ``zero_hpz_partition_size=R``
  for hpZ; ``stage3_max_reuse_distance: 0``, ``stage3_param_persistence_threshold: 0`` and
  ``stage3_prefetch_bucket_size: 0`` so that it releases parameters after forward and re-gathers them in backward
  like the others. Measured with DeepSpeed 0.19.8 on this model: with any prefetch bucket > 0 (2e6, 5e6 tried)
  every step after the first gathers the whole model in forward and 0 bytes in backward, i.e. it keeps all
  parameters gathered from forward to backward (ZeRO-2-like memory and traffic). ``ds_zero3_prefetch`` runs it
  that way (prefetch bucket = the reduce bucket) for reference. Its qwZ/qgZ need CUDA kernels and cannot run on
  CPU.
- ``zeropp_*``: ``zeropp.initialize`` with a DeepSpeed-style config dict.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from zeropp.tools.cluster_bench.catalog import SYSTEMS, ZEROPP_SWITCHES, ZEROPP_VARIANTS

@dataclass(frozen=True)
class TrainSettings:
    """What every system shares: optimizer, clipping, micro-batch, bucket size, node size."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    clip: float
    micro_batch: int
    bucket_elements: Optional[int]  # None: each system's own default
    ranks_per_node: int
    precision: str = "bf16"  # or "fp32" (zeropp systems only)

    def adamw(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


class System:
    """One training system on this rank: forward -> backward -> step, and what it holds."""

    name: str

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model-state tensors this rank holds right now, by kind, plus ``total``."""
        raise NotImplementedError

    def comm_report(self) -> Optional[dict[str, dict[str, int]]]:
        """The ledger's bytes of the last step by phase and link (zeropp only)."""
        return None

    def time_report(self) -> Optional[dict[str, Any]]:
        """The engine's breakdown of the last step's time (zeropp only; Note [time report])."""
        return None


class StorageCounter:
    """Sums tensor storage bytes, each storage once (views and tied weights are not counted twice)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def __call__(self, t: Optional[torch.Tensor]) -> int:
        if t is None:
            return 0
        if hasattr(t, "to_local"):  # DTensor: what this rank holds
            t = t.to_local()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self.seen:
            return 0
        self.seen.add(key)
        return storage.nbytes()


def optimizer_state_bytes(opt: torch.optim.Optimizer, count: StorageCounter) -> int:
    """Shard-shaped optimizer state (Adam moments); scalar step counters are bookkeeping and are left out."""
    return sum(count(t) for state in opt.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _with_total(out: dict[str, int]) -> dict[str, int]:
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------------------------ torch DDP
def bf16_allreduce_hook(group: Optional[dist.ProcessGroup], bucket: dist.GradBucket) -> torch.futures.Future:
    """torch's ``bf16_compress_hook`` (all-reduce the bucket in bf16, mean, back to fp32) without its CUDA check."""
    group = group or dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        out = bucket.buffer()
        out.copy_(f.value()[0])
        return out

    return fut.then(decompress)


# DDP checks the hook's annotations as objects; this module's annotations are strings (PEP 563).
bf16_allreduce_hook.__annotations__ = {"group": Optional[dist.ProcessGroup], "bucket": dist.GradBucket,
                                       "return": torch.futures.Future[torch.Tensor]}


class DDPSystem(System):
    name = "ddp"

    def __init__(self, model: nn.Module, s: TrainSettings) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.module = model
        cap = {} if s.bucket_elements is None else {"bucket_cap_mb": s.bucket_elements * 4 / 2**20}
        self.model = DistributedDataParallel(model, gradient_as_bucket_view=True, **cap)
        self.model.register_comm_hook(None, bf16_allreduce_hook)
        self.opt = s.adamw(model.parameters())
        self.clip = s.clip

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # keep the bucket views, as DDP users do

    def state_bytes(self) -> dict[str, int]:
        count = StorageCounter()
        params = list(self.module.parameters())
        return _with_total({"params": sum(count(p) for p in params),
                            "grads": sum(count(p.grad) for p in params),
                            "optimizer_state": optimizer_state_bytes(self.opt, count)})


# ---------------------------------------------------------------------------------------------- PyTorch FSDP2
class FSDP2System(System):
    def __init__(self, model: nn.Module, s: TrainSettings, hpz: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.name = "fsdp2_hpz" if hpz else "fsdp2"
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        reshard: Any = s.ranks_per_node if hpz else True
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        self.model = model
        self.opt = s.adamw(model.parameters())
        self.clip = s.clip

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        count = StorageCounter()
        params = list(self.model.parameters())
        out = {"params": sum(count(p) for p in params), "grads": sum(count(p.grad) for p in params),
               "optimizer_state": optimizer_state_bytes(self.opt, count)}
        # What FSDP2 keeps between forward and backward: the bf16 post-forward shard (reshard_after_forward=R)
        # or the unsharded parameters; private attributes, read if present.
        extra = 0
        for module in self.model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if state else None
            for fp in getattr(group, "fsdp_params", []) or []:
                extra += count(getattr(fp, "_sharded_post_forward_param_data", None))
                extra += sum(count(t) for t in getattr(fp, "all_gather_outputs", []) or [])
        out["gathered_or_post_forward"] = extra
        return _with_total(out)


# ---------------------------------------------------------------------------------------------- DeepSpeed
def deepspeed_available() -> tuple[bool, str]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # ImportError, or a broken install raising anything
        return False, f"deepspeed is not importable ({type(err).__name__}: {err})"
    return True, ""


class EngineSystem(System):
    """A system driven like DeepSpeed's engine: ``engine(x, y)``, ``engine.backward``, ``engine.step``."""

    engine: Any

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.engine(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


class DeepSpeedSystem(EngineSystem):
    def __init__(self, model: nn.Module, s: TrainSettings, hpz: bool, prefetch: bool = False) -> None:
        import deepspeed

        self.name = "ds_zero3_hpz" if hpz else ("ds_zero3_prefetch" if prefetch else "ds_zero3")
        zero = {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": (s.bucket_elements or 50_000_000) if prefetch else 0,
                "overlap_comm": True, "contiguous_gradients": True}
        if s.bucket_elements is not None:
            zero["reduce_bucket_size"] = s.bucket_elements
        if hpz:
            zero["zero_hpz_partition_size"] = s.ranks_per_node
        config = {"train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": s.clip, "bf16": {"enabled": True}, "zero_optimization": zero,
                  "steps_per_print": 10**9, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True}
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=s.adamw(model.parameters()),
                                                           config=config)

    def state_bytes(self) -> dict[str, int]:
        count = StorageCounter()
        zopt = self.engine.optimizer  # DeepSpeedZeroOptimizer_Stage3
        params = list(self.engine.module.parameters())

        def listed(name: str) -> int:
            value = getattr(zopt, name, None)
            if isinstance(value, torch.Tensor):
                return count(value)
            if isinstance(value, (list, tuple)):
                return sum(count(t) for t in value if isinstance(t, torch.Tensor))
            if isinstance(value, dict):
                return sum(count(t) for t in value.values() if isinstance(t, torch.Tensor))
            return 0

        inner = getattr(zopt, "optimizer", None)
        return _with_total({
            "params_16bit_partition": sum(count(getattr(p, "ds_tensor", None)) for p in params)
            + listed("fp16_partitioned_groups_flat"),
            "hpz_secondary": sum(count(getattr(p, "ds_secondary_tensor", None)) for p in params),
            "master_fp32": listed("fp32_partitioned_groups_flat"),
            "grads": listed("grad_partitions_flat_buffer") + listed("averaged_gradients"),
            "optimizer_state": optimizer_state_bytes(inner, count) if inner is not None else 0,
            "gathered_params": sum(count(p.data) for p in params if p.data.numel() > 1),
        })


# ---------------------------------------------------------------------------------------------- zeropp
def zeropp_config(name: str, s: TrainSettings) -> dict[str, Any]:
    qwz, hpz, qgz = ZEROPP_SWITCHES[name if name in ZEROPP_SWITCHES else "zeropp_all"]
    bucket = {} if s.bucket_elements is None else {"reduce_bucket_size": s.bucket_elements}
    return {
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": s.clip,
        "bf16": {"enabled": s.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": s.lr, "betas": list(s.betas), "eps": s.eps,
                                                  "weight_decay": s.weight_decay}},
        "zero_optimization": {"stage": 3, **bucket,
                              "zero_quantized_weights": qwz, "zero_quantized_gradients": qgz,
                              **ZEROPP_VARIANTS.get(name, {}),
                              "zero_hpz_partition_size": s.ranks_per_node if hpz else 1},
        "topology": {"ranks_per_node": s.ranks_per_node},
    }


class ZeroppSystem(EngineSystem):
    def __init__(self, model: nn.Module, s: TrainSettings, name: str) -> None:
        import zeropp

        self.name = name
        self.config = zeropp_config(name, s)
        self.engine, _, _, _ = zeropp.initialize(model=model, config=self.config)

    def state_bytes(self) -> dict[str, int]:
        return dict(self.engine.model_state_bytes())

    def comm_report(self) -> Optional[dict[str, dict[str, int]]]:
        return self.engine.comm_report()

    def time_report(self) -> Optional[dict[str, Any]]:
        return self.engine.time_report()


# ---------------------------------------------------------------------------------------------- factory
def init_process_group(name: str) -> None:
    """Join the world the launcher described (DeepSpeed through its own init, which also sets up its comm layer)."""
    if SYSTEMS[name][0] == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")


def build(name: str, model: nn.Module, s: TrainSettings) -> System:
    makers: dict[str, Callable[[], System]] = {
        "ddp": lambda: DDPSystem(model, s),
        "fsdp2": lambda: FSDP2System(model, s, hpz=False),
        "fsdp2_hpz": lambda: FSDP2System(model, s, hpz=True),
        "ds_zero3": lambda: DeepSpeedSystem(model, s, hpz=False),
        "ds_zero3_hpz": lambda: DeepSpeedSystem(model, s, hpz=True),
        "ds_zero3_prefetch": lambda: DeepSpeedSystem(model, s, hpz=False, prefetch=True),
    }
    if name in ZEROPP_SWITCHES or name in ZEROPP_VARIANTS:
        return ZeroppSystem(model, s, name)
    if name not in makers:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    return makers[name]()
