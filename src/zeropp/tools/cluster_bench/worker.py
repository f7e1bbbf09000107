"""One rank of one benchmarked system: ``python -m zeropp.tools.cluster_bench.worker SPEC.json SYSTEM``.

Started by the driver with torchrun's environment (inside a node's network namespace when the cluster has them).
The process trains through every bandwidth phase in order, so start-up is paid once per system:

    for each phase k:   rank 0 writes ready.k; the driver shapes the links and writes go.k; every rank waits
                        for go.k -> warm-up steps (memory sampled) -> link counters -> timed steps -> counters
                        -> rank 0 writes row.k.json

Training continues across phases, identically for every system, so the loss after phase k is comparable
across systems. Each timed step ends with a barrier: its time is the slowest rank's.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from zeropp.tools.cluster_bench import systems
from zeropp.tools.cluster_bench.cluster import read_link_counters
from zeropp.tools.demo.data import corpus_tokens, get_batch
from zeropp.tools.cluster_bench.models import build_model, num_parameters


def wait_for(path: str, timeout_s: float) -> None:
    """Poll for ``path`` (a driver's control file) until it exists or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {os.path.basename(path)} from the driver within {timeout_s:.0f} s")
        time.sleep(0.05)


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)  # the driver never reads half a file


def _merge_max(peak: dict[str, int], sample: dict[str, int]) -> dict[str, int]:
    """Keep the sample with the largest total (the peak), as a whole, so its parts add up."""
    return sample if sample.get("total", 0) > peak.get("total", -1) else peak


class Run:
    def __init__(self, spec: dict[str, Any], name: str) -> None:
        self.spec, self.name = spec, name
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        m = spec["model"]
        torch.manual_seed(spec["seed"])
        model = build_model(m)
        self.parameters = num_parameters(model)
        s = spec["train"]
        self.settings = systems.TrainSettings(lr=s["lr"], betas=tuple(s["betas"]), eps=s["eps"],
                                              weight_decay=s["weight_decay"], clip=s["clip"],
                                              micro_batch=s["micro_batch"], bucket_elements=s["bucket_elements"],
                                              ranks_per_node=spec["ranks_per_node"],
                                              precision=s.get("precision", "bf16"))
        self.system = systems.build(name, model, self.settings)
        self.tokens = corpus_tokens()
        self.step_index = 0
        self.peak: dict[str, int] = {}

    def train_step(self, sample_memory: bool) -> float:
        x, y = get_batch(self.tokens, self.step_index, self.settings.micro_batch * self.world,
                         self.spec["model"]["block_size"], self.spec["seed"], self.rank, self.world)
        self.step_index += 1
        loss = self.system.forward(x, y)
        if sample_memory:
            self.peak = _merge_max(self.peak, self.system.state_bytes())
        self.system.backward(loss)
        if sample_memory:
            self.peak = _merge_max(self.peak, self.system.state_bytes())
        self.system.step()
        if sample_memory:
            self.peak = _merge_max(self.peak, self.system.state_bytes())
        return float(loss.detach().float())

    def phase(self, k: int, label: str, control: str) -> None:
        spec = self.spec
        if self.rank == 0:
            _write_json(os.path.join(control, f"ready.{k}"), {"phase": label})
        wait_for(os.path.join(control, f"go.{k}"), spec["wait_timeout_s"])
        dist.barrier()
        # The very first step pays one-time costs (optimizer state allocation, DeepSpeed's trace); it is extra,
        # so that every phase's warm-up samples memory with the optimizer state present.
        for _ in range(spec["warmup"] + (1 if k == 0 else 0)):
            self.train_step(sample_memory=True)
        dist.barrier()
        before = read_link_counters() if spec["wire_counters"] and self.local_rank == 0 else None
        dist.barrier()
        times, losses, breakdowns = [], [], []
        for i in range(spec.get("steps_at", {}).get(label, spec["steps"])):
            t0 = time.perf_counter()
            losses.append(self.train_step(sample_memory=False))
            breakdowns.append(self.system.time_report())
            dist.barrier()
            times.append(time.perf_counter() - t0)
            if self.rank == 0:
                with open(os.path.join(control, "progress"), "a") as f:
                    f.write(f"{k} {i + 1} {times[-1]:.3f}\n")
        dist.barrier()
        after = read_link_counters() if spec["wire_counters"] and self.local_rank == 0 else None
        mine = {"rank": self.rank, "local_rank": self.local_rank, "times": times, "losses": losses,
                "counters": [before, after], "peak": self.peak, "comm": self.system.comm_report(),
                "time": _median_breakdown(breakdowns)}
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine)
        if self.rank == 0:
            _write_json(os.path.join(control, f"row.{k}.json"), self.row(label, everyone))

    def row(self, label: str, everyone: list[dict[str, Any]]) -> dict[str, Any]:
        steps = len(everyone[0]["times"])
        step_times = [max(r["times"][i] for r in everyone) for i in range(steps)]
        losses = [sum(r["losses"][i] for r in everyone) / self.world for i in range(steps)]
        wire = None
        per_node = []
        for r in everyone:
            before, after = r["counters"]
            if before and after:
                per_node.append({"node": r["rank"] // self.spec["ranks_per_node"],
                                 "tx_bytes_per_step": (after["tx"] - before["tx"]) / steps,
                                 "rx_bytes_per_step": (after["rx"] - before["rx"]) / steps})
        if per_node:
            wire = {"inter_node_bytes_per_step": sum(n["tx_bytes_per_step"] for n in per_node), "nodes": per_node}
        ledger = None
        if everyone[0]["comm"] is not None:
            ledger = {"rank0": everyone[0]["comm"], "all_ranks": {}}
            for phase in everyone[0]["comm"]:
                ledger["all_ranks"][phase] = {link: sum(r["comm"][phase][link] for r in everyone)
                                              for link in everyone[0]["comm"][phase]}
        peak = max((r["peak"] for r in everyone), key=lambda p: p.get("total", 0))
        breakdown = None
        if everyone[0]["time"] is not None:  # the rank whose steps took longest sets the pace
            breakdown = max((r["time"] for r in everyone), key=lambda t: t["step_s"])
        return {"system": self.name, "label": systems.SYSTEMS[self.name][1], "bandwidth": label,
                "parameters": self.parameters, "steps": steps, "warmup": self.spec["warmup"],
                "step_times_s": step_times, "median_step_s": statistics.median(step_times),
                "losses": losses, "loss": losses[-1], "step_index": self.step_index,
                "wire": wire, "ledger": ledger, "model_state_bytes_peak": peak, "time_breakdown_s": breakdown}


def _median_breakdown(reports: list[Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """Per-key medians over the timed steps of ``engine.time_report()`` (flattened), or None (not zeropp)."""
    if not reports or reports[0] is None:
        return None
    flat = [{"step_s": r["step_s"], "exposed_comm_fraction": r["exposed_comm_fraction"], **r["phases_s"],
             **{f"grad_reduce_wait_{k}": v for k, v in r["grad_reduce_wait_by_link_s"].items()},
             **{f"busy_{k}": v for k, v in r["collective_busy_s"].items()}} for r in reports if r]
    return {key: statistics.median(f[key] for f in flat) for key in flat[0]}


def main(argv: list[str]) -> int:
    spec_path, name = argv
    with open(spec_path) as f:
        spec = json.load(f)
    import zeropp

    print(f"zeropp imported from {os.path.dirname(zeropp.__file__)}", flush=True)
    torch.set_num_threads(1)  # several ranks share two cores
    systems.init_process_group(name)
    control = os.path.join(spec["control_dir"], name)
    run = Run(spec, name)
    for k, label in enumerate(spec["phases"]):
        run.phase(k, label, control)
    dist.barrier()
    # Every row is written. Leave without running gloo's and the systems' destructors: FSDP2 and DeepSpeed
    # runs sometimes abort in process-group teardown ("terminate called without an active exception"),
    # which would turn a finished run into a failure. An error above still exits non-zero with a traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
