"""The demo training job: one process per rank, started by ``zeropp train`` through torch's launcher.

Trains the shipped GPT on the shipped corpus, shows progress on rank 0, and ends with the communication
report (bytes per step by phase and link, next to the ZeRO-3 formula). ``--out`` writes the loss curve
and the report as JSON, which the convergence benchmark reads. ``--checkpoint-dir D --save-every N`` saves
every N steps (and at the end) and resumes from the newest complete checkpoint in D when there is one, so a
job launched with ``--max-restarts`` continues after a rank dies, bit for bit as if it had not.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import tempfile
import time
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

import zeropp
from zeropp import accounting
from zeropp.checkpoint import CheckpointError
from zeropp.comm.ops import PeerLostError
from zeropp.config.loader import ConfigError, ConfigWarning, ZeroppConfig, load_config, parse_config, read_json
from zeropp.tools.demo.data import corpus_tokens, get_batch
from zeropp.tools.demo.model import GPT, GPTConfig
from zeropp.topology import Layout, TopologyError

#: The embedded default: ZeRO-3 with all three ZeRO++ techniques, bf16, AdamW with warm-up.
DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3,
                                                  "warmup_num_steps": 50, "warmup_type": "linear"}},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 2_000_000,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 2,
        "zero_quantized_gradients": True,
    },
    "topology": {"ranks_per_node": 2},
}

ZEROPP_LABELS = {"zero_quantized_weights": "qwZ", "zero_hpz_partition_size": "hpZ", "zero_quantized_gradients": "qgZ"}


def job_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zeropp-job", add_help=True)
    p.add_argument("--config", default=None)
    p.add_argument("--zeropp", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--precision", choices=("bf16", "fp32"), default=None)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), default=None)
    p.add_argument("--nvme-path", default=None)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save-every", type=int, default=0)
    return p


def check_before_launch(args: argparse.Namespace, world: int) -> None:
    """What every rank would find alike, found once before any process starts: the config (file, keys,
    values, combinations) and the rank layout it asks for (ranks per node, hpZ group size). Raises
    ``ConfigError`` or ``TopologyError`` naming the key."""
    cfg = resolve_config(args, world)
    layout = Layout(world, _ranks_per_node(cfg, world))
    layout.check_hpz(cfg["zero_optimization"].get("zero_hpz_partition_size") or 1)


def resolve_config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """The default (or the user's file), with the command line's overrides applied, validated once (errors
    name the file and the key before any training starts)."""
    cfg = read_json(args.config) if args.config else json.loads(json.dumps(DEFAULT_CONFIG))
    if not isinstance(cfg, dict):
        parse_config(cfg, args.config)  # raises: the top level is not an object
    zero = cfg.setdefault("zero_optimization", {})
    if args.zeropp is not None:
        zero["zero_quantized_weights"] = args.zeropp
        zero["zero_quantized_gradients"] = args.zeropp
        zero["zero_hpz_partition_size"] = (args.ranks_per_node or _ranks_per_node(cfg, world)) if args.zeropp else 1
    if args.ranks_per_node:
        cfg.setdefault("topology", {})["ranks_per_node"] = args.ranks_per_node
    if args.offload is not None:
        _set_offload(zero, args.offload, args.nvme_path)
    if args.precision is not None:
        cfg["bf16"] = {**(cfg.get("bf16") or {}), "enabled": args.precision == "bf16"}
        if "fp16" in cfg:
            cfg["fp16"] = {**(cfg["fp16"] or {}), "enabled": False}
    try:
        with warnings.catch_warnings():  # initialize reads it again and warns there, once
            warnings.simplefilter("ignore", ConfigWarning)
            load_config(cfg)
    except ConfigError as err:  # name the user's file, as reading it would have
        raise type(err)(err.problems, args.config) from None
    return cfg


def _set_offload(zero: dict[str, Any], device: str, nvme_path: Optional[str]) -> None:
    """``--offload``: the optimizer goes to ``device``; with "nvme", stage 3's parameters go too unless hpZ is
    on (its secondary copy stays in memory, so the two do not combine)."""
    opt = zero.setdefault("offload_optimizer", {})
    opt["device"] = device
    if device != "nvme":
        return
    default = os.path.join(tempfile.gettempdir(), "zeropp-nvme")
    opt["nvme_path"] = nvme_path or opt.get("nvme_path") or default
    if zero.get("stage", 0) == 3 and (zero.get("zero_hpz_partition_size") or 1) <= 1:
        par = zero.setdefault("offload_param", {})
        par["device"] = "nvme"
        par["nvme_path"] = nvme_path or par.get("nvme_path") or opt["nvme_path"]


def _offload_words(engine: Any, cfg: dict[str, Any]) -> str:
    zero = cfg["zero_optimization"]
    opt = (zero.get("offload_optimizer") or {}).get("device", "none")
    par = (zero.get("offload_param") or {}).get("device", "none")
    words = {"cpu": "optimizer offloaded to the host", "nvme": "optimizer state on NVMe"}.get(opt, "")
    if par == "nvme":
        words += ", parameters on NVMe"
    if opt == "nvme" or par == "nvme":
        words += f" ({', '.join(engine.offload_report()['files'])})"
    return f", {words}" if words else ""


def _ranks_per_node(cfg: dict[str, Any], world: int) -> int:
    return (cfg.get("topology") or {}).get("ranks_per_node") or world


class Progress:
    """One status line on a terminal, a plain line every ``every`` steps otherwise."""

    def __init__(self, total: int, every: int) -> None:
        self.total, self.every = total, max(1, every)
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        done = step + 1
        width = 28
        bar = "#" * (width * done // self.total) + "-" * (width - width * done // self.total)
        line = f"[{bar}] step {done}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
        if self.tty:
            print("\r" + line, end="" if done < self.total else "\n", flush=True)
        elif done % self.every == 0 or done == self.total or done == 1:
            print(line, flush=True)


def precision_name(cfg: dict[str, Any]) -> str:
    """The training precision ``cfg`` asks for: bf16, fp16 or fp32."""
    for name in ("bf16", "fp16"):
        if (cfg.get(name) or {}).get("enabled") is True:
            return name
    return "fp32"


def formula_report(numels: list[int], layout: Layout, rank: int, itemsize: int = 2) -> dict[str, dict[str, int]]:
    """What plain ZeRO-3 would move per step on this rank with ``itemsize``-byte weights and gradients (2: bf16),
    for comparison."""
    gather = accounting.gather_volume(numels, layout, rank, itemsize).as_dict()
    return {"forward_gather": gather, "backward_gather": gather,
            "grad_reduce": accounting.reduce_scatter_volume(numels, layout, rank, itemsize).as_dict()}


def print_report(measured: dict[str, dict[str, int]], zero3: dict[str, dict[str, int]], precision: str = "bf16") -> None:
    print(f"\nCommunication per optimizer step, bytes received by rank 0 (ledger) vs the ZeRO-3 formula in {precision}:")
    print(f"{'phase':<16}{'intra-node':>14}{'inter-node':>14}{'ZeRO-3 intra':>16}{'ZeRO-3 inter':>16}")
    tot = [0, 0, 0, 0]
    for phase in ("forward_gather", "backward_gather", "grad_reduce"):
        m, z = measured[phase], zero3[phase]
        row = [m["intra_node_bytes"], m["inter_node_bytes"], z["intra_node_bytes"], z["inter_node_bytes"]]
        tot = [a + b for a, b in zip(tot, row)]
        print(f"{phase:<16}" + "".join(f"{v:>14,}" if i < 2 else f"{v:>16,}" for i, v in enumerate(row)))
    print(f"{'total':<16}" + "".join(f"{v:>14,}" if i < 2 else f"{v:>16,}" for i, v in enumerate(tot)))
    if tot[3]:
        print(f"inter-node bytes vs ZeRO-3: {tot[1] / tot[3]:.3f}x")


# Errors every rank meets alike (a bad config, layout or checkpoint): rank 0 prints one line, all exit 2.
USER_ERRORS = (ConfigError, TopologyError, CheckpointError)
USER_ERROR_EXIT, PEER_LOST_EXIT = 2, 3
KILL_ENV, KILL_DIR_ENV = "ZEROPP_TEST_KILL", "ZEROPP_TEST_KILL_DIR"  # test-only fault injection, see _kill_point


def _kill_point(step: int, rank: int) -> None:
    """Test hook: ``ZEROPP_TEST_KILL="STEP:RANK,..."`` SIGKILLs that rank in the middle of that step (after its
    backward), once: a marker in ``ZEROPP_TEST_KILL_DIR`` keeps a restarted job from dying there again."""
    plan, marks = os.environ.get(KILL_ENV), os.environ.get(KILL_DIR_ENV)
    if not plan or f"{step}:{rank}" not in plan.split(",") or not marks:
        return
    mark = os.path.join(marks, f"killed-{step}-{rank}")
    if os.path.exists(mark):
        return
    with open(mark, "w"):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m zeropp.tools.job``: run, and turn the errors users cause into one line and an exit status."""
    try:
        run(argv)
        return 0
    except USER_ERRORS as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"zeropp train: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    except PeerLostError as err:
        print(f"zeropp train: {err}", file=sys.stderr, flush=True)
        return PEER_LOST_EXIT


def _resume(engine: Any, args: argparse.Namespace, rank: int) -> tuple[int, list[float]]:
    """The step to start at and the losses so far: from the newest complete checkpoint in
    ``--checkpoint-dir``, or 0 and none when it holds none yet (the first launch)."""
    if not args.checkpoint_dir:
        return 0, []
    path, client = engine.load_checkpoint(args.checkpoint_dir)
    if path is None:
        return 0, []
    if rank == 0:
        print(f"zeropp: resumed from {path} at step {client['step']}", flush=True)
    return int(client["step"]), list(client["losses"])


def run(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = job_parser().parse_args(argv)
    torch.set_num_threads(1)  # several ranks share few cores
    cfg = resolve_config(args, int(os.environ.get("WORLD_SIZE", "1")))
    # through zeropp: a store prefix per restart attempt under torchrun --max-restarts, and the config's
    # comm_timeout_s on the default group too (the loss average and the final barrier use it)
    default_timeout = ZeroppConfig.model_fields["comm_timeout_s"].default
    timeout = datetime.timedelta(seconds=cfg.get("comm_timeout_s", default_timeout))
    zeropp.init_distributed("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd))
    numels = [p.numel() for p in model.parameters()]
    engine, _, _, _ = zeropp.initialize(model=model, config=cfg)
    micro = engine.policy  # the batch split, settled once by initialize (config/policy.py)
    global_batch = micro.micro_batch_per_rank * world
    tokens = corpus_tokens()
    if rank == 0:
        zero = cfg["zero_optimization"]
        on = [label for key, label in ZEROPP_LABELS.items() if zero.get(key) is True
              or (key == "zero_hpz_partition_size" and (zero.get(key) or 1) > 1)]
        print(f"zeropp: GPT {model.num_parameters():,} parameters, {world} ranks as "
              f"{world // engine.topo.ranks_per_node} nodes x {engine.topo.ranks_per_node}, "
              f"ZeRO-3{' + ' + ' + '.join(on) if on else ''}, {precision_name(cfg)}"
              f"{_offload_words(engine, cfg)}", flush=True)
    progress = Progress(args.steps, args.log_every)
    start, losses = _resume(engine, args, rank)
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        for micro_step in range(micro.gradient_accumulation_steps):
            x, y = get_batch(tokens, step * micro.gradient_accumulation_steps + micro_step, global_batch,
                             args.block_size, args.seed, rank, world)
            loss = engine(x, y)
            engine.backward(loss)
            _kill_point(step, rank)
            engine.step()
        value = loss.detach().float().reshape(1)
        engine.comm.all_reduce(value, engine.topo.world)  # counted, bounded by comm_timeout_s
        losses.append(value.item() / world)
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss is {losses[-1]} at step {step}")
        if rank == 0:
            elapsed = time.perf_counter() - t0
            progress.update(step, losses[-1], (step + 1 - start) * global_batch * args.block_size *
                            micro.gradient_accumulation_steps / elapsed)
        if args.checkpoint_dir and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            engine.save_checkpoint(args.checkpoint_dir, client_state={"step": step + 1, "losses": losses})
    report = engine.comm_report()
    precision = precision_name(cfg)
    zero3 = formula_report(numels, Layout(world, engine.topo.ranks_per_node), rank, 4 if precision == "fp32" else 2)
    result = {"losses": losses, "comm": report, "zero3_formula": zero3, "config": cfg,
              "parameters": model.num_parameters(), "seconds": time.perf_counter() - t0}
    if rank == 0:
        print_report(report, zero3, precision)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {args.out}")
    # Tear down together: a rank that destroys its groups while rank 0 is still writing the report can
    # abort inside gloo ("terminate called without an active exception"), failing the whole launch.
    engine.close()  # deletes this rank's NVMe offload files
    engine.comm.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    sys.exit(main())
