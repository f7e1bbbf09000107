"""Host cost per unit: a launch-bound model (many tiny blocks) where the step is the library's Python, not math.

    python bench/bench_host_cost.py [--layers 48] [--width 64] [--seq 64] [--micro-batch 2] [--rounds 20]
                                    [--warmup 3] [--systems ddp,zeropp,fsdp2,deepspeed] [--profile]
                                    [--out bench/results/host_cost.json]

Two gloo ranks over loopback, bf16, AdamW. The model (``zeropp.tools.cluster_bench.models``' ``launch-bound``)
is ``--layers`` blocks of LayerNorm and two ``--width`` x ``--width`` Linears: a block costs microseconds of
arithmetic, so each library's per-unit work (hooks, gathers, copies, checks) is the step. Systems:

- ``ddp``: ``DistributedDataParallel`` over the model in fp32 under ``torch.autocast(bfloat16)``;
- ``zeropp``: zeropp stage 3 (bf16), one unit per block, its defaults (small units gathered in groups: Note
  [gather groups]);
- ``zeropp_ungrouped``: the same with ``zeropp_coalesced_prefetch: false`` (one all-gather per unit);
- ``fsdp2``: ``fully_shard`` per block and on the root, ``MixedPrecisionPolicy(bf16)``;
- ``deepspeed``: DeepSpeed ZeRO-3 (bf16, torch's AdamW; where DeepSpeed imports, ``DS_ACCELERATOR=cpu``).

The systems take turns each round in the same two processes (interleaved: the same machine load for all),
DeepSpeed apart: once initialized, its ZeRO-3 replaces ``torch.nn.functional.linear`` for the whole process, so
it runs in a second pair of processes, interleaved with DDP again. Each system's ratio is to the DDP of its own
pair. The systems other than zeropp run with torch-function handling off, as in a process of their own (zeropp's
watch for reads between passes is a torch-function mode of every process holding an engine). Reported: rank
0's median step in ms and the ratio to DDP. ``--profile`` also runs 10 steps of each zeropp system under
cProfile on rank 0 and prints the top host costs.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import os
import pstats
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SYSTEMS = ("ddp", "zeropp", "zeropp_ungrouped", "fsdp2", "deepspeed")
LR = 1e-3


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from zeropp.tools.cluster_bench.models import build_model
    torch.manual_seed(0)
    return build_model({"kind": "launch-bound", "n_layer": args.layers, "n_embd": args.width, "n_head": 1,
                        "block_size": args.seq})


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _torch_step(model: torch.nn.Module, autocast: bool = False) -> Step:
    """One training step of a model torch trains itself (DDP, FSDP2), AdamW; ``autocast``: bf16 on the CPU."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _engine_step(engine: Any) -> Step:
    """One training step through an engine (zeropp's or DeepSpeed's)."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return step


def _ddp(args: argparse.Namespace) -> Step:
    from torch.nn.parallel import DistributedDataParallel
    return _torch_step(DistributedDataParallel(_model(args)), autocast=True)


def _zeropp(args: argparse.Namespace, grouped: bool = True) -> Step:
    import zeropp
    zero = {"stage": 3, **json.loads(os.environ.get("ZEROPP_BENCH_ZERO", "{}"))}
    if not grouped:
        zero["zeropp_coalesced_prefetch"] = False
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": zero}
    engine, *_ = zeropp.initialize(model=_model(args), config=cfg)
    return _engine_step(engine)


def _fsdp2(args: argparse.Namespace) -> Step:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = _model(args)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return _torch_step(model)


def _deepspeed(args: argparse.Namespace) -> Step:
    import deepspeed
    model = _model(args)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)
    return _engine_step(engine)


MAKERS = {"ddp": _ddp, "zeropp": _zeropp, "zeropp_ungrouped": lambda a: _zeropp(a, grouped=False), "fsdp2": _fsdp2,
          "deepspeed": _deepspeed}


def _batch(args: argparse.Namespace, i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _profile(step: Step, args: argparse.Namespace, rank: int) -> str:
    prof = cProfile.Profile()
    for i in range(10):
        x, y = _batch(args, 10_000 + i, rank)
        prof.enable()
        step(x, y)
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats(args.profile_sort).print_stats(args.profile_lines)
    return out.getvalue()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if "deepspeed" in args.system_list:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    steps = {name: MAKERS[name](args) for name in args.system_list}
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.warmup + args.rounds):
        x, y = _batch(args, i, rank)
        for name, step in steps.items():
            # the others as in a process of their own: zeropp's torch-function mode stays out of their calls
            off = contextlib.nullcontext() if name.startswith("zeropp") else torch._C.DisableTorchFunction()
            dist.barrier()
            t = time.perf_counter()
            with off:
                loss = step(x, y)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
            losses[name].append(float(loss))
    result: dict[str, Any] = {"median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
                              "times_s": times, "losses": losses}
    if args.profile:
        result["profile"] = "".join(f"--- {name}\n{_profile(step, args, rank)}" for name, step in steps.items()
                                    if name.startswith("zeropp"))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--profile", action="store_true", help="also print zeropp's top host costs (cProfile)")
    p.add_argument("--profile-sort", default="tottime", help="pstats order: tottime (own time) or cumulative")
    p.add_argument("--profile-lines", type=int, default=30)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "host_cost.json"))
    args = p.parse_args()
    args.system_list = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.system_list if s not in SYSTEMS]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if "deepspeed" in args.system_list:
        try:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            import deepspeed  # noqa: F401
        except ImportError as err:
            print(f"deepspeed left out: {err}")
            args.system_list.remove("deepspeed")
    res: dict[str, Any] = {"median_ms": {}, "vs_ddp": {}, "times_s": {}, "losses": {}}
    main_set = [s for s in args.system_list if s != "deepspeed"]
    sets = [("ddp", *[s for s in main_set if s != "ddp"])] if main_set else []
    if "deepspeed" in args.system_list:
        sets.append(("ddp", "deepspeed"))
    profile = None
    for systems in sets:
        part = _run_pair(args, list(systems))
        profile = part.pop("profile", None) or profile  # (DeepSpeed's pair profiles nothing)
        for name in systems:
            key = name if name != "ddp" or "ddp" not in res["median_ms"] else "ddp_beside_deepspeed"
            res["median_ms"][key] = part["median_ms"][name]
            res["vs_ddp"][key] = part["median_ms"][name] / part["median_ms"]["ddp"]
            res["times_s"][key], res["losses"][key] = part["times_s"][name], part["losses"][name]
    med = res["median_ms"]
    res["meta"] = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                   "command": "python bench/bench_host_cost.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
                   "args": {k: v for k, v in vars(args).items() if k != "system_list"}}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results_io import write_results
    write_results(args.out, res)
    if profile:
        print(profile)
    for name, ms in med.items():
        print(f"{name:<22}{ms:9.1f} ms   {res['vs_ddp'][name]:.2f}x DDP   last loss {res['losses'][name][-1]:.4f}")


def _run_pair(args: argparse.Namespace, systems: list[str]) -> dict[str, Any]:
    """Two fresh ranks that run ``systems`` interleaved; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = args.out + ".rank0"
    os.makedirs(os.path.dirname(tmp) or ".", exist_ok=True)
    pair = argparse.Namespace(**{**vars(args), "system_list": systems})
    mp.start_processes(_worker, args=(2, port, pair, tmp), nprocs=2, start_method="spawn")
    with open(tmp) as f:
        part: dict[str, Any] = json.load(f)
    os.remove(tmp)
    return part


if __name__ == "__main__":
    main()
