"""The largest model this machine trains: a Llama-shaped transformers model built on the meta device, stage 3 on
one rank, parameters and optimizer states on NVMe (ZeRO-Infinity).

Records: parameters, init time, each step's time, the peak RSS over a bare process (kernel VmHWM; torch and
zeropp imported, process group up), the offload files' size on disk, and the bytes the engine's NVMe pools
read and wrote per step. The model states on disk are about 16 bytes per parameter; pick ``--layers`` so that
they fit the free disk (printed first) with room to spare.

    .venv/bin/python bench/bench_largest_model.py --nvme-dir /var/tmp [--layers 34 --hidden 3072
        --intermediate 8192 --heads 24] [--steps 2] [--seq 32] [--precision fp32|bf16] [--optimizer-buffers 2]
        [--out bench/results/largest_model.json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from results_io import RESULTS, write_results  # noqa: E402

GB = 1e9


def disk_bytes(path: str) -> int:
    """Bytes allocated on disk under ``path`` (sparse files count what they hold)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def config(nvme_dir: str, bf16: bool, buffer_size: int, optimizer_buffers: int = 2) -> dict:
    """``buffer_size``: elements of one parameter buffer, at least the largest unit (a decoder layer).
    ``optimizer_buffers``: units whose optimizer records (master, gradient row, moments: 16 bytes per element)
    may be in memory at once; each is a decoder layer's, so this sets most of the peak."""
    nvme = {"device": "nvme", "nvme_path": nvme_dir}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": bf16}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_param": {**nvme, "buffer_count": 4, "buffer_size": buffer_size},
                                  "offload_optimizer": {**nvme, "buffer_count": optimizer_buffers}}}


def largest_unit(model) -> int:
    """Elements of the largest gather unit: a decoder layer, or the embedding or head."""
    parts = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    parts += [model.model.embed_tokens.weight.numel(), model.lm_head.weight.numel()]
    return max(parts)


def worker(rank: int, world: int, args: dict, nvme_dir: str) -> dict:
    import torch

    import zeropp
    from bench_nvme import nvme_bytes
    from support.rss import current_rss, peak_rss, reset_peak_rss
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # a bare training process has Dynamo imported
    bare = current_rss()
    reset = reset_peak_rss()
    cfg = LlamaConfig(vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=args["intermediate"],
                      num_hidden_layers=args["layers"], num_attention_heads=args["heads"],
                      num_key_value_heads=args["heads"], max_position_embeddings=args["seq"],
                      tie_word_embeddings=False)
    start = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e9:.2f}B parameters; initializing onto {nvme_dir}", flush=True)
    buffer_size = -(-largest_unit(model) // 1_000_000) * 1_000_000
    engine, *_ = zeropp.initialize(model=model, config=config(nvme_dir, args["precision"] == "bf16", buffer_size,
                                                              args["optimizer_buffers"]))
    init_s = time.perf_counter() - start
    on_disk = disk_bytes(nvme_dir)
    init_peak = peak_rss(reset) - bare
    print(f"init {init_s:.1f} s, {on_disk / GB:.1f} GB on disk, peak RSS {init_peak / GB:.2f} GB", flush=True)
    g = torch.Generator().manual_seed(0)
    steps = []
    for step in range(args["steps"]):
        ids = torch.randint(0, args["vocab"], (1, args["seq"]), generator=g)
        read0, written0 = nvme_bytes(engine)
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - t0
        read1, written1 = nvme_bytes(engine)
        steps.append({"seconds": elapsed, "loss": float(loss.detach()), "read_bytes": read1 - read0,
                      "written_bytes": written1 - written0, "peak_rss": peak_rss(reset) - bare})
        s = steps[-1]
        print(f"step {step}: {elapsed:.1f} s, loss {s['loss']:.4f}, read {s['read_bytes'] / GB:.1f} GB, "
              f"written {s['written_bytes'] / GB:.1f} GB, peak RSS {s['peak_rss'] / GB:.2f} GB", flush=True)
    report = engine.memory_report()
    out = {"parameters": params, "init_s": init_s, "disk_bytes": on_disk, "init_peak_rss": init_peak,
           "peak_rss": peak_rss(reset) - bare, "bare_rss": bare, "rss_reset": reset, "steps": steps,
           "report_peak": report["peak_bytes"], "buffer_bytes": report["buffer_bytes"],
           "resident_peak": report["nvme_swap"]["resident_peak_bytes"]}
    engine.close()
    return out


def main() -> None:
    from support.rss import MALLOC_ENV
    from support.world import run_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="where the offload files go")
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--optimizer-buffers", type=int, default=2,
                    help="offload_optimizer.buffer_count: optimizer records in memory at once (default 2)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="fp32 (the default) or bf16; bf16 compute is slow on a CPU without a bf16 unit")
    ap.add_argument("--out", default=os.path.join(RESULTS, "largest_model.json"))
    args = ap.parse_args()
    free = shutil.disk_usage(args.nvme_dir).free
    print(f"free disk at {args.nvme_dir}: {free / GB:.1f} GB", flush=True)
    nvme_dir = tempfile.mkdtemp(prefix="zeropp-largest-", dir=args.nvme_dir)
    try:
        [result] = run_world(worker, 1, vars(args), nvme_dir, env=MALLOC_ENV, timeout=7200)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    result.update(command=" ".join(sys.argv), free_disk_bytes=free, shape=vars(args))
    write_results(args.out, result)


if __name__ == "__main__":
    main()
