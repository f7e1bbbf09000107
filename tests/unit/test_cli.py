"""``zeropp train``'s argument handling (in process, nothing launched), the job's config resolution, and the
errors ``zeropp.initialize`` gives for bad configs (in a subprocess: a world of one initializes a global
process group, which must not leak into the pytest process)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zeropp.tools import cli, job
from zeropp.config import load_config

ZEROPP_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail instead of starting processes if an argument check lets a bad command through."""
    import torch.distributed.run as tdr

    def refuse(*_a, **_k):
        raise AssertionError("the launcher was called")

    monkeypatch.setattr(tdr, "run", refuse)


def _train_subparser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeropp")
    sub = parser.add_subparsers(dest="command", required=True)
    cli._train_parser(sub)
    return sub.choices["train"]


# ---------------------------------------------------------------------------------------------- cli
def test_train_help_documents_every_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: zeropp train")
    options = [a for a in _train_subparser()._actions if a.option_strings]
    assert len(options) >= 12  # --help plus the eleven flags
    for action in options:
        for opt in action.option_strings:
            assert opt in text, f"{opt} missing from `zeropp train --help`"
        assert action.help and len(action.help) > 10, f"{action.option_strings} has no real help text"
    # the defaults users most need are stated
    for phrase in ("default: 4", "2 nodes x 2 ranks", "--no-zeropp"):
        assert phrase in " ".join(text.split())


def test_top_level_help_lists_train(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    assert "train" in capsys.readouterr().out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("nproc,rpn", [(3, 2), (4, 3), (2, 4)])
def test_bad_ranks_per_node(capsys: pytest.CaptureFixture, nproc: int, rpn: int) -> None:
    rc = cli.main(["train", "--nproc", str(nproc), "--ranks-per-node", str(rpn)])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"--ranks-per-node {rpn}" in err and f"--nproc {nproc}" in err


@pytest.mark.parametrize("flag", ["--nproc", "--ranks-per-node", "--steps", "--block-size", "--n-embd"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_non_positive_sizes_are_usage_errors(capsys: pytest.CaptureFixture, flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "positive integer" in err


def test_missing_config_file(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    missing = tmp_path / "no_such_config.json"
    rc = cli.main(["train", "--config", str(missing)])
    assert rc == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "not found" in err


@pytest.mark.parametrize("zero, named", [
    ({"stage": 3, "zero_hpz_partition_size": 3}, "TopologyError: zero_optimization.zero_hpz_partition_size=3 must "
                                                 "divide the world size 4"),
    ({"stage": 3, "stag": 3}, "zero_optimization.stag: unknown key; did you mean 'stage'?"),
])
def test_errors_every_rank_would_meet_are_printed_once(tmp_path: Path, zero: dict, named: str) -> None:
    """The real command, as a user runs it: one line on stderr naming the key, exit status 2, nothing started."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}))
    proc = subprocess.run([sys.executable, "-m", "zeropp.tools.cli", "train", "--config", str(cfg), "--steps", "1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("zeropp train: ") and named in lines[0], lines


def test_job_args_forward_every_setting(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    args = _train_subparser().parse_args(["--steps", "3", "--seed", "9", "--block-size", "16", "--n-layer", "2",
                                          "--n-embd", "24", "--log-every", "5", "--ranks-per-node", "1",
                                          "--config", str(cfg), "--no-zeropp", "--out", "r.json",
                                          "--checkpoint-dir", "ck", "--save-every", "4"])
    forwarded = job.job_parser().parse_args(cli._job_args(args))
    assert os.path.isabs(forwarded.checkpoint_dir) and forwarded.save_every == 4
    assert (forwarded.steps, forwarded.seed, forwarded.block_size, forwarded.n_layer, forwarded.n_embd,
            forwarded.log_every, forwarded.ranks_per_node) == (3, 9, 16, 2, 24, 5, 1)
    assert forwarded.zeropp is False
    assert forwarded.config == str(cfg) and os.path.isabs(forwarded.out)
    default = job.job_parser().parse_args(cli._job_args(_train_subparser().parse_args([])))
    assert default.zeropp is None and default.config is None and default.out is None


# ---------------------------------------------------------------------------------------------- job.resolve_config
def _resolve(argv: list[str], world: int = 4) -> dict:
    return job.resolve_config(job.job_parser().parse_args(argv), world)


def test_resolve_default_is_zeropp_and_valid() -> None:
    cfg = _resolve([])
    zero = cfg["zero_optimization"]
    assert zero["zero_quantized_weights"] is True and zero["zero_quantized_gradients"] is True
    assert zero["zero_hpz_partition_size"] == 2 and cfg["topology"]["ranks_per_node"] == 2
    load_config(cfg)
    assert job.DEFAULT_CONFIG["zero_optimization"]["zero_quantized_weights"] is True  # not mutated by a resolve
    _resolve(["--no-zeropp"])
    assert job.DEFAULT_CONFIG["zero_optimization"]["zero_quantized_weights"] is True


def test_resolve_no_zeropp_switches_all_three_off() -> None:
    cfg = _resolve(["--no-zeropp"])
    zero = cfg["zero_optimization"]
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"], zero["zero_hpz_partition_size"]) == \
        (False, False, 1)
    assert zero["stage"] == 3
    load_config(cfg)


def test_resolve_zeropp_hpz_follows_ranks_per_node() -> None:
    cfg = _resolve(["--zeropp", "--ranks-per-node", "4"])
    assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 4
    assert cfg["topology"]["ranks_per_node"] == 4
    cfg = _resolve(["--ranks-per-node", "1"])  # no switch: the config's ZeRO++ settings stay
    assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 2 and cfg["topology"]["ranks_per_node"] == 1


def _write(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


PLAIN = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
         "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}


def test_resolve_config_file_zeropp_on(tmp_path: Path) -> None:
    path = _write(tmp_path, PLAIN)
    cfg = _resolve(["--config", path, "--zeropp"], world=4)
    zero = cfg["zero_optimization"]
    assert zero["zero_quantized_weights"] is True and zero["zero_quantized_gradients"] is True
    assert zero["zero_hpz_partition_size"] == 4  # no topology in the file, no flag: one node of the world
    assert zero["reduce_bucket_size"] == 1000 and cfg["optimizer"]["params"]["lr"] == 1e-3  # file kept
    load_config(cfg)
    cfg = _resolve(["--config", path, "--zeropp", "--ranks-per-node", "2"], world=4)
    assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 2 and cfg["topology"]["ranks_per_node"] == 2
    with_topology = _write(tmp_path, {**PLAIN, "topology": {"ranks_per_node": 1}})
    assert _resolve(["--config", with_topology, "--zeropp"], world=4)["zero_optimization"][
        "zero_hpz_partition_size"] == 1


def test_resolve_config_file_zeropp_off(tmp_path: Path) -> None:
    on = {**PLAIN, "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                         "zero_quantized_gradients": True, "zero_hpz_partition_size": 2},
          "topology": {"ranks_per_node": 2}}
    path = _write(tmp_path, on)
    assert _resolve(["--config", path])["zero_optimization"] == on["zero_optimization"]  # untouched
    zero = _resolve(["--config", path, "--no-zeropp"])["zero_optimization"]
    assert [zero[k] for k in ZEROPP_KEYS] == [False, False, 1]


def test_resolve_config_file_is_validated(tmp_path: Path) -> None:
    from zeropp.config import ConfigError

    path = _write(tmp_path, {**PLAIN, "zero_optimization": {"stage": 3, "reduce_bucket_sise": 5}})
    with pytest.raises(ConfigError) as err:
        _resolve(["--config", path, "--zeropp"])
    assert "zero_optimization.reduce_bucket_sise" in str(err.value) and path in str(err.value)


# ---------------------------------------------------------------------------------------------- initialize errors
INIT_SCRIPT = textwrap.dedent("""
    import json, sys
    from torch import nn
    import zeropp
    from zeropp.config import ConfigError
    from zeropp.topology import TopologyError
    out = {}
    for name, cfg in json.loads(sys.argv[1]):
        try:
            zeropp.initialize(model=nn.Linear(3, 2), config=cfg)
            out[name] = {"type": None, "message": ""}
        except Exception as e:  # report every error, expected or not
            out[name] = {"type": type(e).__name__, "message": str(e),
                         "config_error": isinstance(e, ConfigError), "topology_error": isinstance(e, TopologyError)}
    print("RESULT " + json.dumps(out))
""")

BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.fixture(scope="module")
def init_errors(tmp_path_factory: pytest.TempPathFactory) -> dict:
    bad_file = tmp_path_factory.mktemp("cfg") / "bad.json"
    bad_file.write_text(json.dumps({**BASE, "zero_optimization": {"stage": 3}, "trian_batch_size": 4}))
    cases = [  # the topology case initializes the world of one; keep the valid case last
        ("unknown_key", {**BASE, "zero_optimization": {"stage": 3, "zero_quantised_weights": True}}),
        ("unknown_key_file", str(bad_file)),
        ("stage7", {**BASE, "zero_optimization": {"stage": 7}}),
        ("wrong_type", {**BASE, "zero_optimization": {"stage": 3, "overlap_comm": "yes please"}}),
        ("ranks_per_node", {**BASE, "zero_optimization": {"stage": 3}, "topology": {"ranks_per_node": 2}}),
        ("hpz", {**BASE, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}),
        ("valid", {**BASE, "zero_optimization": {"stage": 3}}),
    ]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", INIT_SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr[-3000:]
    out = json.loads(line[-1][len("RESULT "):])
    out["_bad_file"] = str(bad_file)
    return out


def test_initialize_unknown_key(init_errors: dict) -> None:
    r = init_errors["unknown_key"]
    assert r["config_error"], r
    assert "zero_optimization.zero_quantised_weights" in r["message"]
    assert "zero_quantized_weights" in r["message"].split("zero_quantised_weights", 1)[1]  # lists what is accepted


def test_initialize_unknown_key_in_file(init_errors: dict) -> None:
    r = init_errors["unknown_key_file"]
    assert r["config_error"], r
    assert "trian_batch_size" in r["message"] and init_errors["_bad_file"] in r["message"]


def test_initialize_stage_7(init_errors: dict) -> None:
    r = init_errors["stage7"]
    assert r["config_error"], r
    assert "zero_optimization.stage" in r["message"] and "7" in r["message"]


def test_initialize_wrong_type(init_errors: dict) -> None:
    r = init_errors["wrong_type"]
    assert r["config_error"], r
    assert "zero_optimization.overlap_comm" in r["message"]


def test_initialize_ranks_per_node_not_dividing_world(init_errors: dict) -> None:
    r = init_errors["ranks_per_node"]
    assert r["topology_error"], r
    assert "topology.ranks_per_node" in r["message"] and "world size 1" in r["message"]


def test_initialize_hpz_not_dividing_world(init_errors: dict) -> None:
    r = init_errors["hpz"]
    assert r["topology_error"] or r["config_error"], r
    assert "zero_optimization.zero_hpz_partition_size" in r["message"]


def test_initialize_valid_config_in_a_world_of_one(init_errors: dict) -> None:
    assert init_errors["valid"]["type"] is None, init_errors["valid"]


def test_config_topology_is_kept_without_ranks_per_node(tmp_path: Path) -> None:
    """Without --ranks-per-node the job keeps the config file's topology.ranks_per_node."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                                "topology": {"ranks_per_node": 4}}))
    parsed = argparse.ArgumentParser()
    sub = parsed.add_subparsers(dest="command")
    cli._train_parser(sub)
    args = parsed.parse_args(["train", "--config", str(path)])
    forwarded = cli._job_args(args)
    assert "--ranks-per-node" not in forwarded
    cfg = job.resolve_config(job.job_parser().parse_args(forwarded), 4)
    assert cfg["topology"]["ranks_per_node"] == 4


def test_offload_flag_sets_the_optimizer_device() -> None:
    cfg = job.resolve_config(job.job_parser().parse_args(["--offload", "cpu"]), 4)
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_offload_nvme_moves_parameters_too_unless_hpz_is_on(tmp_path) -> None:
    cfg = job.resolve_config(job.job_parser().parse_args(["--offload", "nvme", "--nvme-path", str(tmp_path)]), 4)
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": str(tmp_path)}
    assert "offload_param" not in zero  # the built-in config has hpZ on
    cfg = job.resolve_config(job.job_parser().parse_args(["--offload", "nvme", "--no-zeropp"]), 4)
    zero = cfg["zero_optimization"]
    assert zero["offload_param"]["device"] == "nvme"
    assert zero["offload_param"]["nvme_path"] == zero["offload_optimizer"]["nvme_path"]




# ---------------------------------------------------------------------------------------------- --precision
def test_precision_is_forwarded_and_applied() -> None:
    args = _train_subparser().parse_args(["--precision", "fp32"])
    forwarded = job.job_parser().parse_args(cli._job_args(args))
    assert forwarded.precision == "fp32"
    cfg = job.resolve_config(forwarded, 4)
    assert cfg["bf16"]["enabled"] is False and job.precision_name(cfg) == "fp32"
    assert job.precision_name(_resolve(["--precision", "bf16"])) == "bf16"
    assert job.precision_name(_resolve([])) == "bf16"  # the built-in config, as written


def test_precision_overrides_a_configs_fp16(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}}))
    assert job.precision_name(_resolve(["--config", str(path)])) == "fp16"
    cfg = _resolve(["--config", str(path), "--precision", "bf16"])
    assert job.precision_name(cfg) == "bf16" and cfg["fp16"]["enabled"] is False


@pytest.mark.parametrize("fast", [True, False])
def test_auto_precision_follows_the_cpu_and_says_so_first(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture, fast: bool) -> None:
    from zeropp.tools.demo import cpu
    monkeypatch.setattr(cpu, "bf16_speed", lambda: cpu.Bf16Speed(fast, "because the test says so"))
    args = _train_subparser().parse_args([])
    cli._choose_precision(args)
    out = capsys.readouterr().out.splitlines()
    assert args.precision == ("bf16" if fast else "fp32")
    if fast:
        assert out == []
    else:
        assert len(out) == 1 and "training in fp32" in out[0] and "because the test says so" in out[0]
    # a user's config keeps its precision: auto decides nothing there
    args = _train_subparser().parse_args(["--config", "c.json"])
    cli._choose_precision(args)
    assert args.precision == "auto"


def test_bf16_speed_reads_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeropp.tools.demo import cpu
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx2", "fma"})
    assert cpu.bf16_speed().fast is False
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    speed = cpu.bf16_speed()
    assert speed.fast and "AVX512_BF16" in speed.why
    # no flags to read (another architecture): measured, and an answer either way
    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu, "_measured_ratio", lambda: 30.0)
    assert cpu.bf16_speed().fast is False
    monkeypatch.setattr(cpu, "_measured_ratio", lambda: 1.2)
    assert cpu.bf16_speed().fast is True


def test_formula_report_follows_the_precision() -> None:
    from zeropp.topology import Layout
    bf16 = job.formula_report([1000, 24], Layout(4, 2), 0, 2)
    fp32 = job.formula_report([1000, 24], Layout(4, 2), 0, 4)
    for phase in bf16:
        for link, value in bf16[phase].items():
            assert fp32[phase][link] == 2 * value
