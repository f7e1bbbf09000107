"""Step time compiled against eager: zeropp ZeRO-3 and PyTorch FSDP2, each compiled per block, side by side.

    python bench/bench_compile.py [--backend inductor] [--layers 4] [--embd 256] [--seq 128] [--batch 4]
                                  [--rounds 8] [--warmup 3] [--out bench/results/compile.json]

Two gloo ranks on this machine (an unlimited link), fp32, the demo GPT. Four systems over the same weights and
batches: zeropp stage 3 eager and compiled (``engine.compile(backend)``: one region per block), FSDP2
(``fully_shard`` per block and on the root) eager and compiled (``block.compile(backend)`` per block, as
torchtitan does). Each round runs one step of each system in turn (interleaved, so all see the same machine
load), after ``--warmup`` steps each (zeropp's first step runs eagerly by design, the next ones compile).
Reported: median step seconds of rank 0, the compiled/eager ratio of each library, zeropp compiled over
FSDP2 compiled, Dynamo's graph count after warm-up and at the end (equal: no recompiles), and the losses.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SYSTEMS = ("zeropp_eager", "zeropp_compiled", "fsdp2_eager", "fsdp2_compiled")


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from zeropp.tools.demo.model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=args.seq, n_layer=args.layers, n_embd=args.embd, n_head=4))


def _zeropp(args: argparse.Namespace, compiled: bool) -> Callable[[torch.Tensor, torch.Tensor], float]:
    import zeropp
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zeropp.initialize(model=_model(args), config=cfg)
    if compiled:
        engine.compile(backend=args.backend)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step


def _fsdp2(args: argparse.Namespace, compiled: bool) -> Callable[[torch.Tensor, torch.Tensor], float]:
    from torch.distributed.fsdp import fully_shard
    model = _model(args)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    if compiled:
        for block in model.transformer.h:
            block.compile(backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        # as in a process of its own: zeropp's watch for reads between passes (a torch-function mode this
        # process has because zeropp engines live in it) stays out of FSDP2's ops and compiled frames
        with torch._C.DisableTorchFunction():
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch._dynamo.utils import counters

    from zeropp.tools.demo.data import corpus_tokens, get_batch
    tokens = corpus_tokens()
    steps = {name: (_zeropp if name.startswith("zeropp") else _fsdp2)(args, name.endswith("compiled"))
             for name in SYSTEMS}
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    losses: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    graphs_after_warmup = 0
    for i in range(args.warmup + args.rounds):
        if i == args.warmup:
            graphs_after_warmup = counters["stats"]["unique_graphs"]
        x, y = get_batch(tokens, i, args.batch * world, args.seq, seed=1, rank=rank, world_size=world)
        for name, step in steps.items():
            dist.barrier()
            t = time.perf_counter()
            losses[name].append(step(x, y))
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    result = {"median_s": {n: statistics.median(t) for n, t in times.items()}, "times_s": times, "losses": losses,
              "graphs_after_warmup": graphs_after_warmup, "graphs_at_end": counters["stats"]["unique_graphs"]}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="bench/results/compile.json")
    args = p.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = args.out + ".rank0"
    mp.start_processes(_worker, args=(2, port, args, tmp), nprocs=2, start_method="spawn")
    with open(tmp) as f:
        res: dict[str, Any] = json.load(f)
    os.remove(tmp)
    med = res["median_s"]
    res["ratios"] = {
        "zeropp_compiled_over_eager": med["zeropp_compiled"] / med["zeropp_eager"],
        "fsdp2_compiled_over_eager": med["fsdp2_compiled"] / med["fsdp2_eager"],
        "zeropp_compiled_over_fsdp2_compiled": med["zeropp_compiled"] / med["fsdp2_compiled"],
    }
    res["meta"] = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "argv": sys.argv[1:],
                   "args": vars(args), "cpus": os.cpu_count()}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for name in SYSTEMS:
        print(f"{name:<18}{med[name] * 1e3:9.1f} ms   losses {res['losses'][name][-1]:.4f}")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.3f}")
    print(f"graphs after warm-up {res['graphs_after_warmup']}, at the end {res['graphs_at_end']}; wrote {args.out}")


if __name__ == "__main__":
    main()
