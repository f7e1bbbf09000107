"""Activation memory per rank and step time: no checkpointing, activation checkpointing, cpu_checkpointing.

    python bench/bench_activation_memory.py [--layers 8] [--seq 1024] [--batch 4] [--rounds 5]
                                            [--device cpu|cuda] [--out bench/results/activation_memory.json]

The demo GPT (zeropp.tools.demo.model, bf16, ZeRO stage 3, one rank) at a sequence length where activations
dominate its memory. Three engines over the same weights: blocks run plainly, through
``zeropp.checkpointing.checkpoint``, and through it with ``cpu_checkpointing``, plus a fourth plain one with
the engine's activation meter switched off (what measuring costs); each round runs one step of each, in
turn (interleaved, so all see the same machine load), after one warm-up step each.

What is measured, per step, on this rank:

* ``saved_peak_device``: the most bytes of tensors autograd held for backward at once on the compute device,
  counted tensor by tensor by the engine's saved-tensor hooks (``engine.memory_report()``, Note [activation
  meter] in zeropp/zero/memory.py), each storage once. With ``cpu_checkpointing`` the checkpoint inputs are
  counted as ``saved_peak_host`` instead. Not counted: what lives only inside backward (one block's
  recomputed activations at a time).
* On CUDA: ``torch.cuda.max_memory_allocated`` during the step minus the memory allocated before it (every
  tensor, the rerun's included). cpu_checkpointing copies through CUDA streams into pinned memory.
* On the CPU there is no separate device: host and "device" are one memory, and cpu_checkpointing would
  copy nothing. So the run injects a ``ThreadedLink`` (offload/link.py: copies on a worker thread into
  separate host tensors) to play the device link: the meter then shows what would leave the device, and
  the step time includes real copies (not the bus of a real machine). ``rss_peak_growth`` is the process's
  peak resident memory during the step (VmHWM, reset through /proc/self/clear_refs before each step)
  minus its resident memory before it: all tensors, the rerun's included, and on this machine the host
  copies too, so cpu_checkpointing cannot lower it here. Large allocations are mmapped
  (MALLOC_MMAP_THRESHOLD_) so freed memory leaves the process and the next step's peak is its own.

Target (issue 18): with cpu_checkpointing, activation memory on the compute device <= 1/L of the run
without checkpointing (L layers), and the step time it costs.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from support.world import run_world  # noqa: E402
from results_io import RESULTS, write_results  # noqa: E402

MODES = ("plain", "checkpointed", "cpu_checkpointing", "plain_unmetered")
CHECKPOINTED = ("checkpointed", "cpu_checkpointing")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}


class Checkpointed(nn.Module):
    """A demo GPT block run through zeropp.checkpointing.checkpoint (the demo model has no switch for it)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zeropp import checkpointing
        return checkpointing.checkpoint(self.block, x)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(key + ":")) * 1024


def _engine(mode: str, args: Any, device: torch.device) -> Any:
    import zeropp
    from zeropp.tools.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    model = GPT(cfg).to(device)
    if mode in CHECKPOINTED:
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = Checkpointed(block)
    config = {"train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3}}
    engine = zeropp.initialize(model=model, config=config)[0]
    if mode == "plain_unmetered":  # what the activation meter itself costs a step
        engine.activations.watching = contextlib.nullcontext
    return engine


def _use(mode: str, link: Optional[Any]) -> None:
    """The checkpointing settings of ``mode`` (module-wide in DeepSpeed's API, so set before each step)."""
    from zeropp import checkpointing
    checkpointing.set_link(link if mode == "cpu_checkpointing" else None)
    checkpointing.configure(checkpoint_in_cpu=mode == "cpu_checkpointing")


def _step(engine: Any, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base_cuda = torch.cuda.memory_allocated(device)
    hwm_ok = _reset_hwm()
    rss_before = _status("VmRSS")
    start = time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out = {"step_s": seconds, "loss": loss.item(), **engine.memory_report()["activations"]}
    out["rss_peak_growth"] = _status("VmHWM") - rss_before if hwm_ok else None
    if cuda:
        out["cuda_peak_growth"] = torch.cuda.max_memory_allocated(device) - base_cuda
    return out


def worker(rank: int, world: int, args: Any) -> dict:
    from zeropp.offload.link import ThreadedLink

    device = torch.device(args.device)
    # CUDA: the default link (streams into pinned memory); CPU: a link that plays a separate device
    link = ThreadedLink(delay=0.0) if device.type == "cpu" else None
    engines = {m: _engine(m, args, device) for m in MODES}
    g = torch.Generator().manual_seed(rank)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds + 1):  # round 0 warms up
        x = torch.randint(0, 256, (args.batch, args.seq), generator=g).to(device)
        y = torch.roll(x, -1, 1)
        for mode in MODES:
            _use(mode, link)
            result = _step(engines[mode], x, y, device)
            if r:
                runs[mode].append(result)
    _use("plain", None)
    states = engines["plain"].model_state_bytes()["total"]
    return {"runs": runs, "model_state_bytes": states, "copies": link.copies if link is not None else None}


def summarize(res: dict, layers: int) -> dict:
    runs = res["runs"]
    med = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    out: dict[str, Any] = {"model_state_bytes": res["model_state_bytes"], "link_copies": res["copies"]}
    for mode in MODES:
        out[mode] = {k: med(mode, k) for k in runs[mode][0] if isinstance(runs[mode][0][k], (int, float))
                     and k not in ("saved_now_device", "saved_now_host", "measured")}
    plain = out["plain"]["saved_peak_device"]
    for mode in MODES[1:]:
        if mode in CHECKPOINTED:
            out[mode]["device_over_plain"] = out[mode]["saved_peak_device"] / plain
        out[mode]["step_time_over_plain"] = statistics.median(
            a["step_s"] / b["step_s"] for a, b in zip(runs[mode], runs["plain"]))
    out["cpu_over_checkpointed_step_time"] = statistics.median(
        a["step_s"] / b["step_s"] for a, b in zip(runs["cpu_checkpointing"], runs["checkpointed"]))
    out["target_one_over_L"] = 1 / layers
    out["target_met"] = out["cpu_checkpointing"]["device_over_plain"] <= 1 / layers
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.path.join(RESULTS, "activation_memory.json"))
    args = ap.parse_args()
    if args.device == "cpu":  # a fresh process: the malloc setting must be in place before it starts
        res = run_world(worker, 1, args, env=MALLOC_ENV)[0]
    else:  # zeropp.initialize forms a world of one over NCCL
        res = worker(0, 1, args)
    summary = summarize(res, args.layers)
    mb = 2**20
    print(f"demo GPT: {args.layers} layers, n_embd {args.embd}, seq {args.seq}, batch {args.batch}, bf16, stage 3, "
          f"{args.device}; model states {summary['model_state_bytes'] / mb:.1f} MiB")
    print(f"{'mode':18s} {'saved device':>13s} {'saved host':>11s} {'x plain':>8s} {'rss growth':>11s} "
          f"{'step':>8s} {'x plain':>8s}")
    for mode in MODES:
        s = summary[mode]
        rss = f"{s['rss_peak_growth'] / mb:9.1f}MB" if s.get("rss_peak_growth") is not None else "n/a"
        if mode not in ("plain",) + CHECKPOINTED:
            continue
        print(f"{mode:18s} {s['saved_peak_device'] / mb:11.1f}MB {s['saved_peak_host'] / mb:9.1f}MB "
              f"{s.get('device_over_plain', 1.0):8.3f} {rss:>11s} {s['step_s'] * 1e3:6.0f}ms "
              f"{s.get('step_time_over_plain', 1.0):8.3f}")
    print(f"the activation meter's cost: plain / plain_unmetered step time "
          f"{1 / summary['plain_unmetered']['step_time_over_plain']:.3f}")
    print(f"cpu_checkpointing device bytes / plain = {summary['cpu_checkpointing']['device_over_plain']:.4f} "
          f"(target <= 1/L = {1 / args.layers:.4f}: {'met' if summary['target_met'] else 'NOT met'}); "
          f"step time vs checkpointing {summary['cpu_over_checkpointed_step_time']:.3f}x")
    write_results(args.out, {"args": vars(args), "summary": summary, "raw": res,
                             "command": "python bench/bench_activation_memory.py " + " ".join(sys.argv[1:])})


if __name__ == "__main__":
    main()
