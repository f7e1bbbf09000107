"""One device: tokens/s, MFU and peak memory of a transformers Llama trained by plain PyTorch, FSDP2, DeepSpeed
ZeRO-3 and zeropp, side by side in one call.

    python bench/bench_device.py [--device cuda] [--model 1b] [--seq 2048] [--micro-batch 8]
                                 [--rows plain,fsdp2,...] [--warmup 2] [--steps 4] [--row-timeout 120]
                                 [--out bench/results/device.json]
    python bench/bench_device.py --offload [--model 6b] [--micro-batch 4]   # ZeRO-Offload's headline rows

World 1, one process per row (a fresh process: its own peak memory, its own compile caches, a row that fails
or overruns ``--row-timeout`` costs only itself). Every row trains the same model (built from a config with
the same seed) on the same token batches with AdamW, bf16 compute and fp32 master weights:

- ``plain``: the model in fp32 under ``torch.autocast(bfloat16)``, ``AdamW(fused=True)`` on CUDA; the limit.
- ``fsdp2``: ``fully_shard`` per decoder layer and on the root, ``MixedPrecisionPolicy(bf16, reduce fp32)``.
- ``deepspeed``: DeepSpeed ZeRO-3 with its defaults, ``bf16`` on, torch's AdamW handed in (DeepSpeed's own
  FusedAdam would first compile a CUDA extension); skipped with the reason when DeepSpeed does not import.
- ``zeropp_s3`` / ``zeropp_qwz``: zeropp stage 3, without and with qwZ (at world 1 every gather still
  quantizes and dequantizes; qgZ has nothing to reduce).
- suffix ``_compile``: ``torch.compile`` per decoder layer (FSDP2: ``layer.compile()``, as torchtitan does;
  zeropp: ``engine.compile()``); suffix ``_ckpt``: activation checkpointing through transformers'
  ``gradient_checkpointing_enable(use_reentrant=False)``.
- ``--offload``: ``zeropp_offload`` and ``deepspeed_offload``, the optimizer on the host
  (``offload_optimizer: cpu``, pinned; DeepSpeed's CPU Adam, zeropp's CpuAdam); host RSS reported.
  ``zeropp_offload_dpu`` (by ``--rows`` only): the same with the delayed parameter update
  (``delayed_update: true``, ZeRO-Offload's DPU: the host step of one batch overlaps the next batch's forward and
  backward, which then use weights one step old).

Timing: ``--warmup`` steps, then ``--steps`` steps between CUDA events (a host clock on the CPU), loss read
after the last. MFU counts FLOPs per token as torchtitan does, ``6 * N + 12 * layers * heads * head_dim *
seq``, N the parameters in matmuls (all but the input embedding; the LM head counted even when tied), over
the device's dense bf16 peak (named in the output). Ratios are to ``plain`` in the same call. ``--profile``
writes each row's ``torch.profiler`` table (two more steps, ops by host time) beside ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

ROWS = ("plain", "fsdp2", "zeropp_s3", "zeropp_qwz", "deepspeed", "plain_ckpt", "zeropp_s3_ckpt",
        "zeropp_qwz_ckpt", "fsdp2_compile", "zeropp_s3_compile", "zeropp_qwz_compile",
        "zeropp_s3_compile_ckpt", "zeropp_qwz_compile_ckpt")
OFFLOAD_ROWS = ("zeropp_offload", "deepspeed_offload")
MORE_OFFLOAD_ROWS = ("zeropp_offload_dpu",)  # on request (--rows): not in --offload's default set

# transformers LlamaConfig fields; "1b" is Llama 3.2 1B's shape, "6b" Llama 2 7B's with 28 layers of 32
MODELS: dict[str, dict[str, Any]] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "6b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=28, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
}
# dense bf16 peak per device, from the vendors' datasheets (SXM parts)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}
LR = 1e-5


# ---------------------------------------------------------------------------------------------- the model
def llama_config(name: str, seq: int) -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(**MODELS[name], max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")


def build_model(name: str, seq: int, device: str) -> Any:
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(llama_config(name, seq))


def flops_per_token(name: str, seq: int) -> float:
    """torchtitan's count: 6 x matmul parameters + 12 x layers x heads x head_dim x seq (attention)."""
    m = MODELS[name]
    h, inter, layers, vocab = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["vocab_size"]
    heads, kv = m["num_attention_heads"], m["num_key_value_heads"]
    head_dim = h // heads
    per_layer = h * h * 2 + h * kv * head_dim * 2 + 3 * h * inter  # q, o; k, v; gate, up, down
    matmul_params = layers * per_layer + vocab * h                  # + the LM head
    return 6.0 * matmul_params + 12.0 * layers * heads * head_dim * seq


def param_count(name: str) -> int:
    m = MODELS[name]
    h, inter, layers, vocab = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["vocab_size"]
    kv_dim = m["num_key_value_heads"] * (h // m["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * inter + 2 * h  # + two RMSNorm weights
    return layers * per_layer + vocab * h * (1 if m["tie_word_embeddings"] else 2) + h


# ---------------------------------------------------------------------------------------------- the rows
def _checkpointing(model: Any, row: str) -> None:
    if row.endswith("_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _adamw(params: Any, device: str) -> Any:
    import torch
    return torch.optim.AdamW(params, lr=LR, fused=device == "cuda")


def _torch_step(model: Any, opt: Any, autocast: Optional[str] = None) -> Callable[[Any], Any]:
    """One training step of a model torch trains itself (plain, FSDP2); ``autocast``: a device to autocast on."""
    import contextlib

    import torch

    def step(x: Any) -> Any:
        with torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _engine_step(engine: Any) -> Callable[[Any], Any]:
    """One training step through an engine (DeepSpeed's or zeropp's); ``step.engine`` is the engine."""
    def step(x: Any) -> Any:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()
    step.engine = engine  # type: ignore[attr-defined]
    return step


def _plain(args: argparse.Namespace, row: str) -> Callable[[Any], Any]:
    model = build_model(args.model, args.seq, args.device)
    _checkpointing(model, row)
    model.train()
    return _torch_step(model, _adamw(model.parameters(), args.device), autocast=args.device)


def _fsdp2(args: argparse.Namespace, row: str) -> Callable[[Any], Any]:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = build_model(args.model, args.seq, args.device)
    _checkpointing(model, row)
    model.train()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if "_compile" in row:
        for layer in model.model.layers:
            layer.compile()
    return _torch_step(model, _adamw(model.parameters(), args.device))


def _deepspeed(args: argparse.Namespace, row: str) -> Callable[[Any], Any]:
    import deepspeed
    model = build_model(args.model, args.seq, args.device)
    _checkpointing(model, row)
    zero: dict[str, Any] = {"stage": 3}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                              "bf16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": 10**9,
                              "zero_allow_untested_optimizer": True}
    if row == "deepspeed_offload":  # DeepSpeed's CPU Adam, its ZeRO-Offload as documented
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters(), args.device),
                                          config=config)
    return _engine_step(engine)


def _zeropp(args: argparse.Namespace, row: str) -> Callable[[Any], Any]:
    import zeropp
    model = build_model(args.model, args.seq, args.device)
    _checkpointing(model, row)
    zero: dict[str, Any] = {"stage": 3, "zero_quantized_weights": "_qwz" in row}
    if row.startswith("zeropp_offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if row.endswith("_dpu"):  # delayed from the second step on: the timed steps all overlap
            zero["offload_optimizer"].update(delayed_update=True, delayed_update_warmup_steps=1)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": zero}
    engine, *_ = zeropp.initialize(model=model, config=config)
    del model
    if "_compile" in row:
        engine.compile()
    return _engine_step(engine)


def make_step(args: argparse.Namespace, row: str) -> Callable[[Any], Any]:
    if row.startswith("plain"):
        return _plain(args, row)
    if row.startswith("fsdp2"):
        return _fsdp2(args, row)
    if row.startswith("deepspeed"):
        return _deepspeed(args, row)
    if row.startswith("zeropp"):
        return _zeropp(args, row)
    raise SystemExit(f"bench_device: unknown row {row!r}; rows: {', '.join(ROWS + OFFLOAD_ROWS)}")


# ---------------------------------------------------------------------------------------------- one row
def _batches(args: argparse.Namespace, n: int) -> list[Any]:
    import torch
    g = torch.Generator().manual_seed(1)
    vocab = MODELS[args.model]["vocab_size"]
    return [torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g).to(args.device) for _ in range(n)]


def _graphs() -> int:
    """Dynamo's count of distinct graphs so far (equal after warm-up and at the end: no recompiles timed)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _progress(line: str) -> None:
    """A line on stderr with the host RSS: the tail a timed-out row leaves says how far it got."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{line} (peak host RSS {rss:.1f} GiB)", file=sys.stderr, flush=True)


def run_row(args: argparse.Namespace, row: str) -> dict[str, Any]:
    """Build the row's system, run the warm-up and the timed steps; its numbers (in this process)."""
    import torch
    import torch.distributed as dist
    cuda = args.device == "cuda"
    if row.startswith("deepspeed"):
        import deepspeed
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    else:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", 0) if cuda else None)
    t0 = time.perf_counter()
    step = make_step(args, row)
    build_s = time.perf_counter() - t0
    _progress(f"{row}: built in {build_s:.1f} s")
    batches = _batches(args, args.warmup + args.steps)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = []
    for i, x in enumerate(batches[: args.warmup]):
        losses.append(step(x))
        _progress(f"{row}: warm-up step {i + 1} done at {time.perf_counter() - t0:.1f} s")
    if cuda:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    graphs_after_warmup = _graphs()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    engine = getattr(step, "engine", None)  # a zeropp or DeepSpeed engine, else None
    t0 = time.perf_counter()
    losses += [step(x) for x in batches[args.warmup:]]
    if hasattr(engine, "join_update"):  # a delayed update still running is step time
        engine.join_update()
    if cuda:
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        seconds = time.perf_counter() - t0
    step_s = seconds / args.steps
    tokens_s = args.micro_batch * args.seq / step_s
    out: dict[str, Any] = {"row": row, "step_s": step_s, "tokens_per_s": tokens_s, "build_s": build_s,
                           "warmup_s": warmup_s, "losses": [float(v) for v in losses],
                           "host_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                           "graphs_after_warmup": graphs_after_warmup, "graphs_at_end": _graphs()}
    if hasattr(engine, "time_report"):  # zeropp's own breakdown of the last timed step
        out["time_report"] = engine.time_report()
    if row.startswith("zeropp_offload"):
        from zeropp.offload.cpu_adam import kernel_info
        out["cpu_adam"] = kernel_info()._asdict()
        out["threads"] = torch.get_num_threads()
    if args.profile:
        out["profile"] = _profile(step, batches[-1], cuda)
    if cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)
        if peak is not None:
            out["mfu"] = flops_per_token(args.model, args.seq) * tokens_s / peak
    dist.destroy_process_group()
    return out


def _profile(step: Callable[[Any], Any], x: Any, cuda: bool) -> str:
    """``torch.profiler`` over two more steps: the ops with the most host (CPU) time, as a table."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step(x)
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    # by self time (the ops themselves), then by total time (the engine's labelled parts, Note [host step passes])
    return "\n".join(averages.table(sort_by=key, row_limit=25, max_name_column_width=60)
                     for key in ("self_cpu_time_total", "cpu_time_total"))


def _child(args: argparse.Namespace) -> None:
    try:
        result = run_row(args, args.one)
    except BaseException as err:  # recorded, not raised: the parent reports the row and goes on
        result = {"row": args.one, "error": f"{type(err).__name__}: {err}"[:2000],
                  "traceback": traceback.format_exc()[-4000:]}
    with open(args.result, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------- the call
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace, row: str, argv: list[str]) -> dict[str, Any]:
    """Run one row in a fresh process under ``--row-timeout``; its result, or why there is none."""
    if row.startswith("deepspeed"):
        try:
            import importlib.util
            if importlib.util.find_spec("deepspeed") is None:
                return {"row": row, "skipped": "deepspeed is not installed"}
        except ValueError:
            pass
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "row.json")
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--one", row, "--result", path]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.row_timeout)
        except subprocess.TimeoutExpired as err:
            tail = (err.stderr or b"")[-1500:]
            return {"row": row, "error": f"timed out after {args.row_timeout} s",
                    "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
        if not os.path.exists(path):
            return {"row": row, "error": f"the row's process exited with {proc.returncode} and no result",
                    "stderr_tail": proc.stderr[-3000:]}
        with open(path) as f:
            result: dict[str, Any] = json.load(f)
        result["wall_s"] = time.perf_counter() - t0
        if "error" in result:
            result["stderr_tail"] = proc.stderr[-1500:]
        return result


def _ratios(results: list[dict[str, Any]]) -> None:
    base = next((r for r in results if r["row"] == "plain" and "tokens_per_s" in r), None)
    for r in results:
        if base is not None and "tokens_per_s" in r:
            r["tokens_vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
            if "peak_mem_gib" in r and base.get("peak_mem_gib"):
                r["mem_vs_plain"] = r["peak_mem_gib"] / base["peak_mem_gib"]


def _table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'row':<26}{'tokens/s':>11}{'x plain':>9}{'MFU':>7}{'peak GiB':>10}{'host GiB':>10}{'step s':>9}"
             f"{'loss':>9}"]
    for r in results:
        if "tokens_per_s" not in r:
            lines.append(f"{r['row']:<26}  {r.get('skipped') or r.get('error')}")
            continue
        ratio = f"{r['tokens_vs_plain']:.3f}" if "tokens_vs_plain" in r else "-"
        mfu = f"{r['mfu']:.3f}" if "mfu" in r else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
        lines.append(f"{r['row']:<26}{r['tokens_per_s']:>11.0f}{ratio:>9}{mfu:>7}{mem:>10}"
                     f"{r['host_rss_peak_gib']:>10.1f}{r['step_s']:>9.3f}{r['losses'][-1]:>9.4f}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model", default=None, choices=sorted(MODELS), help="default 1b (6b with --offload)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=None, help="default 8 (4 with --offload)")
    p.add_argument("--rows", default=None, help="comma-separated rows, in the order run (default: all)")
    p.add_argument("--offload", action="store_true", help="ZeRO-Offload's rows instead")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--profile", action="store_true",
                   help="also profile two steps of each row (torch.profiler); tables beside --out")
    p.add_argument("--row-timeout", type=float, default=150.0, help="seconds one row may take, start-up included")
    p.add_argument("--out", default=None, help="default bench/results/device.json (device_offload.json)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model = args.model or ("6b" if args.offload else "1b")
    args.micro_batch = args.micro_batch or (4 if args.offload else 8)
    default_rows = OFFLOAD_ROWS if args.offload else ROWS
    args.row_list = args.rows.split(",") if args.rows else list(default_rows)
    known = ROWS + OFFLOAD_ROWS + MORE_OFFLOAD_ROWS
    unknown = [r for r in args.row_list if r not in known]
    if unknown:
        p.error(f"--rows: unknown {', '.join(unknown)}; rows: {', '.join(known)}")
    name = "device_offload.json" if args.offload else "device.json"
    args.out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.one:
        _child(args)
        return
    import torch
    from results_io import write_results
    # a time cap's SIGTERM ends the row in flight too (subprocess.run kills its child when interrupted)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__,
            "command": "python bench/bench_device.py " + " ".join(argv), "model": args.model,
            "params": param_count(args.model), "flops_per_token": flops_per_token(args.model, args.seq),
            "seq": args.seq, "micro_batch": args.micro_batch, "warmup": args.warmup, "steps": args.steps,
            "peak_bf16_flops": next((v for k, v in PEAK_BF16.items() if k in device), None)}
    print(f"{device}; torch {torch.__version__}; Llama {args.model} ({meta['params'] / 1e9:.2f}B), "
          f"micro-batch {args.micro_batch} x {args.seq}", flush=True)
    results: list[dict[str, Any]] = []
    for row in args.row_list:
        results.append(_launch(args, row, argv))
        _ratios(results)
        r = results[-1]
        print(f"{row}: " + (f"{r['tokens_per_s']:.0f} tokens/s, step {r['step_s']:.3f} s, wall {r['wall_s']:.0f} s"
                            if "tokens_per_s" in r else str(r.get("skipped") or r.get("error"))), flush=True)
        if "traceback" in r:
            print(r["traceback"][-1500:], flush=True)
        if "profile" in r:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(os.path.splitext(args.out)[0] + f"_{row}_profile.txt", "w") as f:
                f.write(r["profile"])
        write_results(args.out, {"meta": meta, "rows": results})
    print(_table(results))


if __name__ == "__main__":
    main()
