"""Smoke test of the real ``zeropp train`` command: 4 local gloo processes as 2 simulated nodes x 2 ranks, a tiny
GPT for 3 steps, with ZeRO++ (the default) and with ``--no-zeropp``. Each run starts once per module."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PHASES = ("forward_gather", "backward_gather", "grad_reduce", "other")
FORMULA_PHASES = ("forward_gather", "backward_gather", "grad_reduce")
TINY = ["--steps", "3", "--n-layer", "1", "--n-embd", "32", "--block-size", "32"]
ROW = re.compile(r"^(forward_gather|backward_gather|grad_reduce|total)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s*$",
                 re.M)


def _run_cli(tmp: Path, extra: list[str]) -> dict:
    out = tmp / "run.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "zeropp.tools.cli", "train", *TINY, *extra, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp, env=env)
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert out.is_file(), proc.stdout[-3000:]
    return {"json": json.loads(out.read_text()), "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.fixture(scope="module")
def zeropp_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run_cli(tmp_path_factory.mktemp("zeropp"), [])


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run_cli(tmp_path_factory.mktemp("zero3"), ["--no-zeropp"])


def _table(stdout: str) -> dict[str, list[int]]:
    return {m.group(1): [int(m.group(i).replace(",", "")) for i in range(2, 6)] for m in ROW.finditer(stdout)}


def _check_common(run: dict) -> None:
    res = run["json"]
    losses = res["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert all(3.0 < x < 7.0 for x in losses), losses  # ~ln(vocab) at the start of byte-level training
    assert list(res["comm"]) == list(PHASES)
    for phase in PHASES:
        assert set(res["comm"][phase]) == {"intra_node_bytes", "inter_node_bytes"}
    assert set(res["zero3_formula"]) == set(FORMULA_PHASES)
    out = run["stdout"]
    assert re.search(r"step 1/3\s+loss \d+\.\d{4}\s+[\d,]+ tok/s", out), out
    assert re.search(r"step 3/3\s+loss \d+\.\d{4}\s+[\d,]+ tok/s", out), out
    assert "2 nodes x 2" in out
    assert "Communication per optimizer step" in out
    # the printed table is the JSON's numbers (rank 0), with a correct total row
    table = _table(out)
    assert set(table) == {*FORMULA_PHASES, "total"}, out
    for phase in FORMULA_PHASES:
        m, z = res["comm"][phase], res["zero3_formula"][phase]
        assert table[phase] == [m["intra_node_bytes"], m["inter_node_bytes"], z["intra_node_bytes"],
                                z["inter_node_bytes"]]
    assert table["total"] == [sum(table[p][i] for p in FORMULA_PHASES) for i in range(4)]


def test_zeropp_run(zeropp_run: dict) -> None:
    _check_common(zeropp_run)
    res = zeropp_run["json"]
    zero = res["config"]["zero_optimization"]
    assert zero["zero_quantized_weights"] and zero["zero_quantized_gradients"] and zero["zero_hpz_partition_size"] == 2
    assert "qwZ" in zeropp_run["stdout"] and "hpZ" in zeropp_run["stdout"] and "qgZ" in zeropp_run["stdout"]
    measured_inter = sum(res["comm"][p]["inter_node_bytes"] for p in PHASES)  # "other" included
    formula_inter = sum(res["zero3_formula"][p]["inter_node_bytes"] for p in FORMULA_PHASES)
    assert formula_inter > 0
    assert measured_inter < 0.3 * formula_inter, (measured_inter, formula_inter)
    assert res["comm"]["backward_gather"]["inter_node_bytes"] == 0  # hpZ: the backward gather stays in the node
    assert "inter-node bytes vs ZeRO-3:" in zeropp_run["stdout"]


def test_no_zeropp_run_matches_formula(zero3_run: dict) -> None:
    _check_common(zero3_run)
    res = zero3_run["json"]
    zero = res["config"]["zero_optimization"]
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"], zero["zero_hpz_partition_size"]) == \
        (False, False, 1)
    for phase in FORMULA_PHASES:
        assert res["comm"][phase] == res["zero3_formula"][phase], phase
    assert "qwZ" not in zero3_run["stdout"]


def test_zeropp_and_zero3_same_model(zeropp_run: dict, zero3_run: dict) -> None:
    a, b = zeropp_run["json"], zero3_run["json"]
    assert a["parameters"] == b["parameters"]
    assert a["zero3_formula"] == b["zero3_formula"]
    # same seed, same data: the first loss is the same model on the same batch, up to the quantized weights
    assert abs(a["losses"][0] - b["losses"][0]) < 0.05


def test_offload_nvme_trains_the_same_losses_and_leaves_no_files(tmp_path: Path, zero3_run: dict) -> None:
    nvme = tmp_path / "nvme"
    run = _run_cli(tmp_path, ["--no-zeropp", "--offload", "nvme", "--nvme-path", str(nvme)])
    assert "optimizer state on NVMe, parameters on NVMe (" in run["stdout"]
    assert str(nvme / "zeropp-param-rank0-") in run["stdout"]
    assert run["json"]["losses"] == zero3_run["json"]["losses"]  # bit for bit: where states wait is not what is computed
    assert list(nvme.iterdir()) == []  # every rank deleted its files
