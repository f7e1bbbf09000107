"""Convergence: the demo GPT trained with plain ZeRO-3 and with ZeRO++ (qwZ + hpZ + qgZ), same seed and data.

    python bench/convergence.py [--steps 300] [--out bench/results]

Writes ``convergence.json`` (both loss curves, the final-loss comparison and the per-step bytes) and
``convergence.png``. Final loss = mean of the last 20 steps; the target is ZeRO++ within 2% of ZeRO-3.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(mode: str, steps: int, seed: int, workdir: str) -> dict:
    out = os.path.join(workdir, f"{mode}.json")
    cmd = [sys.executable, "-m", "zeropp.tools.cli", "train", "--steps", str(steps), "--seed", str(seed),
           "--log-every", "50", "--out", out, f"--{'no-' if mode == 'zero3' else ''}zeropp"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    with open(out) as f:
        return json.load(f)


def final_loss(losses: list[float], last: int = 20) -> float:
    return sum(losses[-last:]) / len(losses[-last:])


def label_loss_axes(ax, title: str) -> None:  # noqa: ANN001 - a matplotlib Axes
    """The labels, title and grid of a training-loss plot over steps."""
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)


def plot(curves: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    label_loss_axes(ax, "Demo GPT on the shipped corpus, 2 nodes x 2 ranks, bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        runs = {mode: run(mode, args.steps, args.seed, work) for mode in ("zero3", "zeropp")}
    f3, fpp = final_loss(runs["zero3"]["losses"]), final_loss(runs["zeropp"]["losses"])
    inter = {m: sum(v["inter_node_bytes"] for v in r["comm"].values()) for m, r in runs.items()}
    summary = {
        "steps": args.steps, "seed": args.seed, "parameters": runs["zero3"]["parameters"],
        "final_loss_zero3": f3, "final_loss_zeropp": fpp, "relative_difference": (fpp - f3) / f3,
        "inter_node_bytes_per_step": inter, "inter_node_ratio": inter["zeropp"] / inter["zero3"],
        "seconds": {m: r["seconds"] for m, r in runs.items()},
    }
    result = {"summary": summary, "losses": {m: r["losses"] for m, r in runs.items()},
              "comm": {m: r["comm"] for m, r in runs.items()}}
    with open(os.path.join(args.out, "convergence.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot({"ZeRO-3": runs["zero3"]["losses"], "ZeRO++ (qwZ+hpZ+qgZ)": runs["zeropp"]["losses"]},
         os.path.join(args.out, "convergence.png"))
    print(json.dumps(summary, indent=1))
    ok = abs(summary["relative_difference"]) <= 0.02
    print(f"final loss ZeRO++ vs ZeRO-3: {summary['relative_difference']:+.2%} ({'within' if ok else 'OUTSIDE'} 2%)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
