"""Smoke test of ``zeropp bench``: ledger-only mode (no root, no namespaces), a tiny GPT, 1 warm-up + 2 timed steps,
four systems (DDP, zeropp ZeRO-3, zeropp ZeRO++, ZeRO++ with 4-bit qwZ). Keeps the benchmark from rotting; DeepSpeed
is not needed."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMS = ("ddp", "zeropp_zero3", "zeropp_all", "zeropp_all_w4")
BUCKET = 3_000_000
PHASES = ("forward_gather", "backward_gather", "grad_reduce", "other")
ROW_FIELDS = {"system", "label", "bandwidth", "parameters", "steps", "warmup", "step_times_s", "median_step_s",
              "losses", "loss", "step_index", "wire", "ledger", "model_state_bytes_peak",
              "time_breakdown_s"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "zeropp.tools.cli", "bench", "--ledger-only", "--tiny", "--steps", "1",
           "--steps-per-bandwidth", "loopback=2", "--warmup", "1",
           "--systems", ",".join(SYSTEMS), "--bucket-elements", str(BUCKET), "--out", str(out), "--timeout", "100"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=out, env=env)
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return {"json": json.loads((out / "cluster_bench.json").read_text()), "stdout": proc.stdout, "out": out}


def _row(result: dict, system: str) -> dict:
    rows = [r for r in result["json"]["rows"] if r["system"] == system]
    assert len(rows) == 1, rows
    assert "error" not in rows[0], rows[0]
    return rows[0]


def test_rows_have_fields_and_sane_values(bench: dict) -> None:
    result = bench["json"]
    assert result["meta"]["mode"].startswith("ledger-only")
    assert result["meta"]["bandwidths"] == ["loopback"]
    assert result["meta"]["steps_at"] == {"loopback": 2}  # --steps-per-bandwidth over --steps 1
    assert [r["system"] for r in result["rows"]] == list(SYSTEMS)
    assert result["meta"]["bucket_elements"] == BUCKET == result["meta"]["train"]["bucket_elements"]
    params = {r["parameters"] for r in result["rows"]}
    assert len(params) == 1 and params.pop() > 0  # same model everywhere
    for system in SYSTEMS:
        row = _row(bench, system)
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
        assert row["bandwidth"] == "loopback" and row["steps"] == 2 and len(row["step_times_s"]) == 2
        assert 0 < row["median_step_s"] < 30
        assert all(math.isfinite(x) and 3.0 < x < 7.0 for x in row["losses"]), row["losses"]
        assert row["step_index"] == 4  # 1 first step + 1 warm-up + 2 timed: same batches for every system
        assert row["wire"] is None  # no namespaces, no wire counters
        assert row["model_state_bytes_peak"]["total"] > 0


def test_ledger_rows(bench: dict) -> None:
    assert _row(bench, "ddp")["ledger"] is None
    z3, zpp = _row(bench, "zeropp_zero3")["ledger"], _row(bench, "zeropp_all")["ledger"]
    for ledger in (z3, zpp):
        assert set(ledger) == {"rank0", "all_ranks"}
        assert set(ledger["all_ranks"]) == set(PHASES)
    inter = {name: sum(v["inter_node_bytes"] for v in led["all_ranks"].values()) for name, led in
             (("z3", z3), ("zpp", zpp))}
    assert inter["z3"] > 0 and inter["zpp"] < 0.3 * inter["z3"], inter
    assert zpp["all_ranks"]["backward_gather"]["inter_node_bytes"] == 0  # hpZ
    z3_mem = _row(bench, "zeropp_zero3")["model_state_bytes_peak"]["total"]
    zpp_mem = _row(bench, "zeropp_all")["model_state_bytes_peak"]
    assert zpp_mem["hpz_secondary"] > 0 and zpp_mem["total"] > z3_mem


def test_time_breakdown_rows(bench: dict) -> None:
    """zeropp rows carry engine.time_report()'s per-phase medians; other systems have none."""
    assert _row(bench, "ddp")["time_breakdown_s"] is None
    for system in ("zeropp_zero3", "zeropp_all"):
        t = _row(bench, system)["time_breakdown_s"]
        assert t["step_s"] > 0 and t["forward_compute"] > 0 and t["busy_forward_gather"] > 0
        assert 0 <= t["exposed_comm_fraction"] < 1


def test_losses_agree(bench: dict) -> None:
    ddp, z3, zpp, w4 = (_row(bench, s)["loss"] for s in SYSTEMS)
    assert abs(z3 / ddp - 1) < 0.01, (ddp, z3)
    assert abs(zpp / z3 - 1) < 0.02 and abs(w4 / z3 - 1) < 0.02, (z3, zpp, w4)
    assert w4 != zpp  # other weights in the forward


def test_four_bit_weights_halve_the_forward_gather(bench: dict) -> None:
    """``zeropp_all_w4`` is ZeRO++ with 4-bit weight gathers in blocks of 256 (a 4-byte scale per 128 payload bytes,
    against one per 2048 at 8 bits): the forward's inter-node gather carries about half the bytes; qgZ's blocks
    shrink too, so its reduction carries a few more scales."""
    zpp, w4 = (_row(bench, s)["ledger"]["all_ranks"] for s in ("zeropp_all", "zeropp_all_w4"))
    ratio = w4["forward_gather"]["inter_node_bytes"] / zpp["forward_gather"]["inter_node_bytes"]
    assert 0.51 <= ratio < 0.55, ratio  # (0.5 + 4/256) / (1 + 4/2048) = 0.515 on whole blocks
    reduce = w4["grad_reduce"]["inter_node_bytes"] / zpp["grad_reduce"]["inter_node_bytes"]
    assert 1.0 < reduce < 1.05, reduce  # (0.5 + 4/256) / (0.5 + 4/2048) = 1.027
    assert w4["backward_gather"]["inter_node_bytes"] == 0
    assert "3,000,000-element gradient buckets" in (bench["out"] / "cluster_bench.md").read_text()


def test_slow_link_ratios_of_each_zeropp_variant() -> None:
    """Issue 17's ratios (slow link over unlimited) are reported for ZeRO++ and, when it ran, its 4-bit variant."""
    from zeropp.tools.cluster_bench.report import targets

    steps = {("zeropp_all", "unlimited"): 0.8, ("zeropp_all", "200mbit"): 1.2, ("zeropp_all", "100mbit"): 1.8,
             ("zeropp_all_w4", "unlimited"): 0.9, ("zeropp_all_w4", "200mbit"): 0.99,
             ("zeropp_all_w4", "100mbit"): 1.26}
    rows = [{"system": sy, "bandwidth": bw, "median_step_s": t, "loss": 3.0} for (sy, bw), t in steps.items()]
    got = {t["name"]: (round(t["value"], 4), t["met"]) for t in targets(rows, ["unlimited", "200mbit", "100mbit"])
           if "step at" in t["name"]}
    assert got == {"ZeRO++ step at 200mbit / ZeRO++ step at unlimited": (1.5, False),
                   "ZeRO++ step at 100mbit / ZeRO++ step at unlimited": (2.25, False),
                   "ZeRO++ 4-bit qwZ step at 200mbit / ZeRO++ 4-bit qwZ step at unlimited": (1.1, True),
                   "ZeRO++ 4-bit qwZ step at 100mbit / ZeRO++ 4-bit qwZ step at unlimited": (1.4, True)}
    without = [r for r in rows if r["system"] == "zeropp_all"]
    assert not [t for t in targets(without, ["unlimited", "200mbit", "100mbit"]) if "4-bit" in t["name"]]


def test_report_files(bench: dict) -> None:
    out: Path = bench["out"]
    md = (out / "cluster_bench.md").read_text()
    assert "## Median step time (s)" in md and "## Targets" in md and "zeropp ZeRO++" in md
    assert "ledger inter-node bytes ZeRO++ / zeropp ZeRO-3" in md
    assert "ledger-only mode" in bench["stdout"]
    assert json.loads((out / "cluster_bench.json").read_text())["targets"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for name in ("cluster_bench_step_time.png", "cluster_bench_bytes.png"):
        assert (out / name).stat().st_size > 0
    assert not (out / "tmp").exists() or not any((out / "tmp").glob("zpb*"))  # the run's work folder is removed


@pytest.mark.parametrize("text, named", [("fast=3", "unknown bandwidth 'fast'"), ("unlimited=0", "'unlimited=0'"),
                                         ("1gbit=x", "'1gbit=x'")])
def test_steps_per_bandwidth_refuses_bad_items_by_name(text: str, named: str) -> None:
    from zeropp.tools.cluster_bench.run import parser, steps_per_phase

    args = parser().parse_args(["--steps-per-bandwidth", text])
    with pytest.raises(SystemExit, match="--steps-per-bandwidth") as err:
        steps_per_phase(args, ["unlimited", "1gbit"])
    assert named in str(err.value)
    good = parser().parse_args(["--steps", "8", "--steps-per-bandwidth", "unlimited=32, 1gbit=24"])
    assert steps_per_phase(good, ["unlimited", "1gbit", "100mbit"]) == {"unlimited": 32, "1gbit": 24, "100mbit": 8}
