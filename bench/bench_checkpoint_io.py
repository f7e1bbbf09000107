"""A shard's save and load in the safe format (safetensors + JSON, Note [data, not code]) against the pickled
format it replaced (``torch.save`` / ``torch.load``), on the same payload of a model of at least 100M
parameters.

The payload is what ``save_checkpoint`` writes for one rank: GPT-2 small's shape (124M parameters, fp32), one
rank, stage 3, after one AdamW step (fp32 masters + both moments: about 1.5 GB). Each format writes it through
the same atomic writer (hashing as it writes, fsync, rename) and reads it back; the two alternate, and the
median of ``--repeats`` rounds is reported with the ratio safe/pickled (below 1.1 is the target).

    .venv/bin/python bench/bench_checkpoint_io.py [--repeats 3] [--out bench/results/checkpoint_io.json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import RESULTS, write_results  # noqa: E402


def payload_of_gpt2() -> tuple[dict, int]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import zeropp
    from zeropp.checkpoint.engine_io import _shard_payload
    from zeropp.checkpoint.engine_state import engine_params as _params
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    params = sum(p.numel() for p in model.parameters())
    engine, *_ = zeropp.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    x = torch.randint(0, 50257, (1, 16))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    return _shard_payload(engine, _params(engine, writing=False), {"epoch": 1}, "0123456789ab"), params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS, "checkpoint_io.json"))
    args = ap.parse_args()
    import torch

    from zeropp.checkpoint.format import atomic_write
    from zeropp.checkpoint.safe_io import read_tree, write_tree
    payload, params = payload_of_gpt2()
    root = tempfile.mkdtemp(prefix="zeropp-ckpt-io-")
    formats = {
        "pickled": (lambda f: torch.save(payload, f),
                    lambda p: torch.load(p, map_location="cpu", weights_only=False)),
        "safe": (lambda f: write_tree(f, payload, "shard"), lambda p: read_tree(p)),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in formats}
    sizes = {}
    try:
        for _ in range(args.repeats):
            for name, (write, read) in formats.items():
                path = os.path.join(root, f"shard.{name}")
                start = time.perf_counter()
                sizes[name] = atomic_write(path, write).size
                times[name]["save"].append(time.perf_counter() - start)
                start = time.perf_counter()
                loaded = read(path)
                times[name]["load"].append(time.perf_counter() - start)
                del loaded
                os.unlink(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: {op: statistics.median(v) for op, v in ops.items()} for k, ops in times.items()}
    ratio = {op: med["safe"][op] / med["pickled"][op] for op in ("save", "load")}
    for name in formats:
        print(f"{name}: {sizes[name] / 2**20:.0f} MiB, save {med[name]['save']:.2f} s, load {med[name]['load']:.2f} s")
    print(f"safe / pickled: save {ratio['save']:.3f}x, load {ratio['load']:.3f}x")
    write_results(args.out, {"parameters": params, "bytes": sizes, "seconds": times, "median": med, "ratio": ratio,
                             "repeats": args.repeats})


if __name__ == "__main__":
    main()
