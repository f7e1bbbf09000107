"""``zeropp plan --calibrate``: measure this machine's compute, quantizer, host work and links into a profile.

Three ways to run it:

* ``--cluster`` (root): the emulated cluster of ``zeropp bench`` (network namespaces, ``tc tbf`` links), N nodes x
  R ranks, once per bandwidth in ``--bandwidths``: the link fits of each setting, plus the unshaped one.
* under ``torchrun`` on a real cluster: every rank runs the probes; rank 0 writes the profile (one inter-node
  setting, labelled by ``--inter-node-gbps`` when given).
* otherwise: two local processes over loopback gloo, as two one-rank "nodes".

Each rank is ``python -m zeropp.tools.plan.calibrate SPEC.json`` (emulated cluster, loopback) and walks the phases:
rank 0 writes ``ready.k``, the driver shapes the links and writes ``go.k``, every rank measures, rank 0 writes
``result.k.json``.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from typing import Any, Callable, Optional

from zeropp.tools.plan.profile import Fit, InterLink, PlanError, Profile

#: tc rate -> nominal Gbit/s, the ``zeropp bench`` settings.
RATES = {"unlimited": None, "1gbit": 1.0, "200mbit": 0.2, "100mbit": 0.1}


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)




# ---- inside a rank ------------------------------------------------------------------------------------------
def host_probes(device_name: str, sync: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Compute, quantizer and host-work rates of this rank, every rank running each probe at the same time.

    Each probe runs twice and the second round counts, with ``sync`` (a barrier) before each round. Timed on
    its first use, a probe met the other ranks' first-use work (imports, the C kernel's build and self-test,
    fresh allocations), and ranks sharing cores drifted into different probes: with 4 ranks on 2 cores the
    first int8 quantizer probe came out 5-6x slower on some ranks than the next five tries, and calibrations
    of one machine disagreed 2-5x on host rates (docs/benchmarks.md, issue 16)."""
    import torch

    from zeropp.tools.plan import probes

    device = torch.device(device_name)

    def in_lockstep(fn: Callable[..., Any], *args: Any) -> Any:
        sync()
        fn(device, *args)  # a whole untimed round first: imports, kernel builds, first allocations
        sync()
        return fn(device, *args)

    q8, d8 = in_lockstep(probes.quantizer_rates, 8)
    q4, d4 = in_lockstep(probes.quantizer_rates, 4)
    s8, m8 = in_lockstep(probes.qgz_fused_rates, 8)
    s4, m4 = in_lockstep(probes.qgz_fused_rates, 4)
    return {"matmul_flops": in_lockstep(probes.matmul_flops), "step_flops": in_lockstep(probes.step_flops),
            "quantize_per_s": {"8": q8, "4": q4}, "dequantize_per_s": {"8": d8, "4": d4},
            "qgz_sum_requantize_per_s": {"8": s8, "4": s4}, "qgz_sum_per_s": {"8": m8, "4": m4},
            "optimizer_per_s": in_lockstep(probes.optimizer_rate),
            "reduce_sum_per_s": in_lockstep(probes.reduce_sum_rate), "copy_bytes_per_s": in_lockstep(probes.copy_rate)}


def link_probes(comm: Any, intra: bool, device_name: str = "cpu") -> dict[str, Any]:
    """Points of each collective the engine issues: over the world, among one rank per node, and (``intra``)
    inside a node."""
    import torch

    from zeropp.tools.plan import probes

    topo, dev = comm.topo, torch.device(device_name)
    out: dict[str, Any] = {"inter": {}, "intra": {}}
    if topo.num_nodes > 1:
        for key, pattern, group in (("all_gather", "all_gather", topo.world), ("all_to_all", "all_to_all", topo.world),
                                    ("all_to_all_inter", "all_to_all", topo.inter_node),
                                    ("all_gather_inter", "all_gather", topo.inter_node),
                                    ("all_reduce", "all_reduce", topo.world)):
            out["inter"][key] = probes.collective_points(comm, pattern, group, device=dev)
    if intra and topo.ranks_per_node > 1:
        for pattern in ("all_gather", "all_to_all"):
            out["intra"][pattern] = probes.collective_points(comm, pattern, topo.intra_node, device=dev)
    return out


def run_rank(phases: list[str], control: Optional[str], device_name: str, timeout_s: float = 600,
             single_thread: bool = True) -> list[dict]:
    """Every phase on this rank; returns the per-phase results (rank 0's are the ones written).
    ``single_thread``: one torch thread per rank, as ``zeropp bench`` runs several ranks on one host."""
    import torch

    from zeropp import topology
    from zeropp.tools.cluster_bench.worker import wait_for
    from zeropp.tools.plan import probes

    if single_thread:
        torch.set_num_threads(1)
    if device_name == "cuda":  # one GPU per local rank; NCCL for device tensors, gloo for the host's
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    topology.ensure_process_group(None if device_name == "cuda" else "gloo",
                                  timeout=datetime.timedelta(seconds=timeout_s))
    topo = topology.build(timeout=datetime.timedelta(seconds=timeout_s))
    comm = probes.new_comm(topo)
    results = []
    for k, label in enumerate(phases):
        if control and topo.rank == 0:
            _write_json(os.path.join(control, f"ready.{k}"), {"phase": label})
        if control:
            wait_for(os.path.join(control, f"go.{k}"), timeout_s)
        comm.barrier()
        result: dict[str, Any] = {"label": label}
        if k == 0:
            result["host"] = host_probes(device_name, comm.barrier)
            comm.barrier()
        result["links"] = link_probes(comm, intra=k == 0, device_name=device_name)
        if k == 0:  # the slowest rank's compute: steps end when the slowest rank is done
            for key in ("matmul_flops", "step_flops", "optimizer_per_s", "reduce_sum_per_s", "copy_bytes_per_s"):
                result["host"][key] = 1.0 / probes.slowest(comm, 1.0 / result["host"][key])
        results.append(result)
        if control and topo.rank == 0:
            _write_json(os.path.join(control, f"result.{k}.json"), result)
    comm.barrier()
    return results


def worker_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    run_rank(spec["phases"], spec["control_dir"], spec.get("device", "cpu"), spec.get("timeout_s", 600))
    sys.stdout.flush()
    os._exit(0)  # leave without gloo's teardown (see tools/cluster_bench/worker.py)


# ---- assembling the profile -------------------------------------------------------------------------------
def _fits(points: dict[str, Any], gbps: Optional[float], layout: tuple[int, int]) -> dict[str, Fit]:
    from zeropp.tools.plan import collectives, probes

    out = {}
    for pattern, pts in points.items():
        alpha, per_s = probes.fit_points([tuple(p) for p in pts])
        eff = None
        if gbps:
            big_bytes, big_s = pts[-1]
            wire = collectives.wire_bytes_per_node(pattern, big_bytes, layout[0], layout[1])
            eff = wire / max(big_s - alpha, 1e-9) / (gbps * 1e9 / 8) if wire else None
        out[pattern] = Fit(alpha, per_s, eff)
    return out


def build_profile(results: list[dict], source: str, machine: str, nodes: int, ranks_per_node: int,
                  gbps_of: dict[str, Optional[float]], device: str) -> Profile:
    host = results[0]["host"]
    layout = (nodes, ranks_per_node)
    inter = [InterLink(r["label"], gbps_of.get(r["label"]), _fits(r["links"]["inter"], gbps_of.get(r["label"]), layout))
             for r in results if r["links"]["inter"]]
    intra = _fits(results[0]["links"]["intra"], None, layout)
    return Profile(source=source, machine=machine, nodes=nodes, ranks_per_node=ranks_per_node, device=device,
                   comm_uses_compute=device == "cpu", matmul_flops=host["matmul_flops"],
                   step_flops=host["step_flops"], quantize_per_s=host["quantize_per_s"],
                   dequantize_per_s=host["dequantize_per_s"],
                   qgz_sum_requantize_per_s=host.get("qgz_sum_requantize_per_s", {}),
                   qgz_sum_per_s=host.get("qgz_sum_per_s", {}), optimizer_per_s=host["optimizer_per_s"],
                   reduce_sum_per_s=host["reduce_sum_per_s"], copy_bytes_per_s=host["copy_bytes_per_s"],
                   intra=intra, inter=inter, date=datetime.date.today().isoformat(),
                   notes="rates are per rank with every rank probing at once; link fits in received bytes per rank")


# ---- drivers ----------------------------------------------------------------------------------------------
def _machine() -> str:
    from zeropp.tools.cluster_bench.run import machine

    return machine()


def calibrate_cluster(nodes: int, ranks_per_node: int, bandwidths: list[str], out: str,
                      timeout_s: float = 900, namespaces: bool = True) -> Profile:
    """The emulated cluster: one launch, one phase per bandwidth (links re-shaped between phases)."""
    from zeropp.tools.cluster_bench.cluster import Cluster, ClusterError

    bad = [b for b in bandwidths if b not in RATES]
    if bad:
        raise PlanError(f"--bandwidths: unknown {', '.join(bad)}; known: {', '.join(RATES)}")
    if "unlimited" in bandwidths:  # the unshaped phase first: it also runs the host probes
        bandwidths = ["unlimited"] + [b for b in bandwidths if b != "unlimited"]
    cluster = Cluster(nodes, ranks_per_node, namespaces=namespaces)
    phases = bandwidths if cluster.namespaces else ["loopback"]
    if not cluster.namespaces:
        print(f"zeropp plan: {cluster.why_local}: calibrating over loopback only (no link shaping)", flush=True)
    with tempfile.TemporaryDirectory(prefix="zeropp-plan-") as work:
        control = os.path.join(work, "control")
        os.makedirs(control)
        spec_path = os.path.join(work, "spec.json")
        _write_json(spec_path, {"phases": phases, "control_dir": control, "timeout_s": timeout_s})
        results: dict[int, dict] = {}

        def poll() -> None:
            for k, label in enumerate(phases):
                if os.path.exists(os.path.join(control, f"ready.{k}")) and not os.path.exists(
                        os.path.join(control, f"go.{k}")):
                    cluster.shape(label if RATES.get(label) else None)
                    _write_json(os.path.join(control, f"go.{k}"), {"phase": label})
                    print(f"zeropp plan: calibrating at {label}", flush=True)
                path = os.path.join(control, f"result.{k}.json")
                if k not in results and os.path.exists(path):
                    with open(path) as f:
                        results[k] = json.load(f)

        with cluster:
            ranks = cluster.launch([sys.executable, "-m", "zeropp.tools.plan.calibrate", spec_path],
                                   os.path.join(work, "logs"), env={"PYTHONUNBUFFERED": "1"})
            try:
                codes = cluster.wait(ranks, timeout_s, poll)
            except ClusterError as err:
                raise PlanError(f"calibration did not finish: {err}; logs: {_tail(work)}") from None
            poll()
            if any(codes) or len(results) != len(phases):
                raise PlanError(f"calibration ranks failed (exit codes {codes}): {_tail(work)}")
    gbps_of = {label: RATES.get(label) for label in phases}
    profile = build_profile([results[k] for k in range(len(phases))],
                            "emulated-cluster" if cluster.namespaces else "loopback", _machine(), nodes,
                            ranks_per_node, gbps_of, "cpu")
    profile.save(out)
    return profile


def _tail(work: str) -> str:
    logs = os.path.join(work, "logs")
    lines = []
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), errors="replace") as f:
            text = f.read().strip().splitlines()
        if text:
            lines.append(f"{name}: {' | '.join(text[-6:])}")
    return "\n".join(lines) or "no log output"


def calibrate_loopback(out: str, timeout_s: float = 600) -> Profile:
    """Two local processes over loopback gloo, one rank per simulated node (no root needed)."""
    return calibrate_cluster(2, 1, ["unlimited"], out, timeout_s, namespaces=False)


def calibrate_torchrun(out: str, gbps: Optional[float]) -> Optional[Profile]:
    """Under torchrun: every rank probes; rank 0 writes and returns the profile (other ranks return None)."""
    import torch

    from zeropp.topology import default_ranks_per_node

    device = "cuda" if torch.cuda.is_available() else "cpu"
    label = f"{gbps:g}gbps" if gbps else "measured"
    results = run_rank([label], None, device, single_thread=False)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rpn = default_ranks_per_node(world)
    profile = build_profile(results, "torchrun", _machine(), world // rpn, rpn, {label: gbps}, device)
    profile.save(out)
    return profile


if __name__ == "__main__":  # one rank: python -m zeropp.tools.plan.calibrate SPEC.json
    sys.exit(worker_main(sys.argv[1]))
