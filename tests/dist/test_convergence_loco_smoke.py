"""Smoke test of ``bench/convergence_loco.py`` (3 steps, the int2 run with LoCo): the script runs end to end,
writes its JSON (the plot needs matplotlib, which is in the bench extra, not the test install), and the bytes
it reports are the plain qgZ formula at 2 bits with blocks of 64 (LoCo adds none)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from zeropp import accounting
from zeropp.tools.demo.model import GPT, GPTConfig
from zeropp.topology import Layout

BENCH = Path(__file__).resolve().parents[2] / "bench" / "convergence_loco.py"


def test_int2_runs_write_results_with_formula_bytes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, str(BENCH), "--steps", "3", "--only", "int2_loco", "--out", str(tmp_path),
           "--tag", "_smoke", "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "convergence_loco_smoke.json").read_text())
    assert not (tmp_path / "convergence_loco_smoke.png").exists()
    summary = result["summary"]
    assert set(summary["final_loss"]) == {"int2_loco"} and summary["int2_block"] == 64
    assert all(len(v) == 3 for v in result["losses"].values())
    model = GPT(GPTConfig(block_size=64))
    numels = [p.numel() for p in model.parameters()]
    want = accounting.qgz_volume(numels, Layout(4, 2), 0, 2, 64)
    got = summary["grad_reduce_bytes_per_step"]["int2_loco"]  # LoCo adds no byte to plain qgZ's
    assert got == {"inter_node": want.inter_node_bytes, "intra_node": want.intra_node_bytes}
