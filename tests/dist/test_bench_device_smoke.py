"""Smoke tests of the speed benchmarks that a GPU session runs (``bench/bench_device.py``, through
``bench/run_device.sh``) and of the launch-bound host-cost benchmark, on this machine's CPU with tiny models:
the scripts must run as they will on the device, so the short device time is never spent on a broken script."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
TINY = ["--device", "cpu", "--model", "tiny", "--seq", "32", "--micro-batch", "2", "--warmup", "2", "--steps", "1"]


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**ENV, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def device_rows(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("device") / "device.json"
    rows = "plain,fsdp2,zeropp_s3,zeropp_qwz_compile_ckpt,deepspeed"
    proc = _run(["bench/bench_device.py", *TINY, "--rows", rows, "--profile", "--out", str(out)])
    return {"json": json.loads(out.read_text()), "stdout": proc.stdout, "dir": out.parent}


def test_every_row_trains_and_reports(device_rows: dict) -> None:
    rows = {r["row"]: r for r in device_rows["json"]["rows"]}
    assert list(rows) == ["plain", "fsdp2", "zeropp_s3", "zeropp_qwz_compile_ckpt", "deepspeed"]
    for name in ("plain", "fsdp2", "zeropp_s3", "zeropp_qwz_compile_ckpt"):
        r = rows[name]
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and len(r["losses"]) == 3
        assert all(math.isfinite(v) for v in r["losses"])
        # the same model, weights and first batch: bf16 compute everywhere, so the first losses agree closely
        assert r["losses"][0] == pytest.approx(rows["plain"]["losses"][0], rel=2e-2)
    assert rows["plain"]["tokens_vs_plain"] == 1.0
    assert rows["zeropp_s3"]["tokens_vs_plain"] == pytest.approx(
        rows["zeropp_s3"]["tokens_per_s"] / rows["plain"]["tokens_per_s"])
    # the compiled row compiled during warm-up and not again while timed
    compiled = rows["zeropp_qwz_compile_ckpt"]
    assert compiled["graphs_after_warmup"] > 0 and compiled["graphs_at_end"] == compiled["graphs_after_warmup"]
    # DeepSpeed is not installed next to the tests: said, not failed
    assert rows["deepspeed"] == {"row": "deepspeed", "skipped": "deepspeed is not installed"} or \
        "tokens_per_s" in rows["deepspeed"]
    table = device_rows["stdout"].splitlines()[-6:]  # the table is printed last
    assert table[0].split()[:3] == ["row", "tokens/s", "x"] and table[3].startswith("zeropp_s3 ")


def test_profiles_are_written_beside_the_results(device_rows: dict) -> None:
    table = (device_rows["dir"] / "device_zeropp_s3_profile.txt").read_text()
    assert "Self CPU" in table and "aten::" in table


def test_flops_and_parameter_counts_match_the_model() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_device
    for name in ("tiny", "1b"):
        model = bench_device.build_model(name, 64, "meta")
        assert bench_device.param_count(name) == sum(p.numel() for p in model.parameters())
    # Llama 3.2 1B's shape: 1.24B parameters, ~6 x 1.24e9 FLOPs a token and attention at 2048 tokens
    assert bench_device.param_count("1b") == pytest.approx(1.2358e9, rel=1e-3)
    assert bench_device.flops_per_token("1b", 2048) == pytest.approx(6 * 1.2358e9 + 12 * 16 * 2048 * 2048,
                                                                     rel=1e-3)


def test_offload_rows_report_host_memory(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    _run(["bench/bench_device.py", "--offload", *TINY, "--rows", "zeropp_offload,zeropp_offload_dpu",
          "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["zeropp_offload", "zeropp_offload_dpu"]
    for row in rows:
        assert "error" not in row, row
        assert row["host_rss_peak_gib"] > 0 and row["tokens_per_s"] > 0
        assert row["cpu_adam"]["available"] and set(row["time_report"]["phases_s"]) >= {"optimizer_step"}
    # the delayed update trains on weights one step old: its losses part from the plain run's after the first step
    assert rows[0]["losses"][:2] == rows[1]["losses"][:2] and rows[0]["losses"][2] != rows[1]["losses"][2]


def test_a_row_over_its_time_is_cut_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "slow.json"
    _run(["bench/bench_device.py", *TINY, "--rows", "plain", "--row-timeout", "0.5", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["error"] == "timed out after 0.5 s"


def test_host_cost_bench_runs_each_system(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    _run(["bench/bench_host_cost.py", "--layers", "2", "--rounds", "1", "--warmup", "1",
          "--systems", "ddp,zeropp,zeropp_ungrouped,fsdp2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert set(res["median_ms"]) == {"ddp", "zeropp", "zeropp_ungrouped", "fsdp2"}
    assert res["vs_ddp"]["ddp"] == 1.0 and all(v > 0 for v in res["median_ms"].values())
    assert res["losses"]["zeropp_ungrouped"] == res["losses"]["zeropp"]  # a gather only moves bytes
    losses = [res["losses"][s][0] for s in ("ddp", "zeropp", "fsdp2")]
    assert max(losses) - min(losses) < 2e-2 * max(losses)  # the same model and batch


def test_rlhf_bench_runs_a_grpo_step_per_system(tmp_path: Path) -> None:
    out = tmp_path / "rlhf.json"
    _run(["bench/bench_rlhf.py", "--ledger-only", "--bandwidths", "unlimited", "--systems", "zeropp_zero3,zeropp_plus",
          "--layers", "1", "--hidden", "64", "--steps", "1", "--warmup", "1", "--out", str(out)], timeout=400)
    res = json.loads(out.read_text())
    assert res["meta"]["mode"].startswith("ledger-only")
    rows = {r["system"]: r for r in res["rows"]}
    for name in ("zeropp_zero3", "zeropp_plus"):
        r = rows[name]
        assert "error" not in r, r
        assert 0 < r["generation_s"] < r["step_s"] and 0 < r["generation_share"] < 1
        assert r["generation_wire_bytes"] is None and r["training_wire_bytes"] is None  # no namespaces: no counters
        assert len(r["rewards"]) == 2
