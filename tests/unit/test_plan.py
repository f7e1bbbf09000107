"""`zeropp plan`'s cost model in one process: its bytes are accounting.py's, its ranking follows the link, its
memory check flips where the bytes say, and the command line prints a table and a config that loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeropp import accounting
from zeropp.tools import cli
from zeropp.config import load_config
from zeropp.tools.plan import (Choice, PlanError, Workload, demo_gpt, evaluate, gpt_of_size, gpu_cluster, load_profile,
                         rank, step_time)
from zeropp.tools.plan import collectives as coll
from zeropp.tools.plan.memory import activation_bytes, model_states
from zeropp.tools.plan.profile import FORMAT, Fit, InterLink, Profile
from zeropp.topology import Layout

MODEL = demo_gpt(2, 64, 4, 32)
ONE_BUCKET = Workload(micro_batch=2, seq_len=32, bucket=10**9)


def fast_cluster(nodes: int = 2, per_node: int = 2, inter_gbps: float = 100.0, memory_gib: float = 80.0):
    return gpu_cluster(nodes, per_node, 100.0, inter_gbps, 2400.0, memory_gib)


def expected_volumes(choice: Choice, layout: Layout) -> dict[str, accounting.Volume]:
    """The ledger's step for one bucket, assembled straight from accounting.py's formulas."""
    fwd = bwd = accounting.Volume()
    for u in MODEL.units:
        if choice.qwz_bits:
            fwd += accounting.quantized_gather_volume(u.numels, layout, 0, choice.qwz_bits, 2048)
        else:
            fwd += accounting.gather_volume(u.numels, layout, 0, 2)
        if choice.hpz > 1:
            bwd += accounting.hpz_gather_volume(u.numels, layout, 0, choice.hpz, 2)
        else:
            bwd += accounting.gather_volume(u.numels, layout, 0, 2)
    grads = (accounting.qgz_volume(MODEL.numels, layout, 0, choice.qgz_bits, 2048) if choice.qgz_bits
             else accounting.reduce_scatter_volume(MODEL.numels, layout, 0, 2))
    return {"forward_gather": fwd, "backward_gather": bwd, "grad_reduce": grads,
            "other": accounting.grad_norm_volume(layout, 0)}


@pytest.mark.parametrize("choice", [Choice(3), Choice(3, qwz_bits=8), Choice(3, hpz=2), Choice(3, qgz_bits=4),
                                    Choice(3, 8, 2, 4), Choice(3, 4, 4, 8)])
def test_step_bytes_are_accountings_formulas(choice: Choice) -> None:
    hw = fast_cluster()
    got = step_time(MODEL, choice, hw, ONE_BUCKET).volumes
    want = expected_volumes(choice, Layout(4, 2))
    assert got == {phase: v.as_dict() for phase, v in want.items()}
    if choice.hpz > 1 and choice.hpz <= 2:
        assert got["backward_gather"]["inter_node_bytes"] == 0


def test_gradient_accumulation_gathers_forward_from_the_hpz_slices_after_the_first_micro_step() -> None:
    hw = fast_cluster()
    one = step_time(MODEL, Choice(3, hpz=2), hw, ONE_BUCKET).volumes
    four = step_time(MODEL, Choice(3, hpz=2), hw, Workload(2, 32, grad_accum=4, bucket=10**9)).volumes
    assert four["forward_gather"]["inter_node_bytes"] == one["forward_gather"]["inter_node_bytes"]
    assert four["backward_gather"]["intra_node_bytes"] == 4 * one["backward_gather"]["intra_node_bytes"]


def test_all_to_all_reduce_scatter_puts_d_times_a_ring_on_the_node_link() -> None:
    layout = Layout(64, 16)
    [a2a] = coll.reduce(MODEL.numels, Choice(3), layout, True, 2048)
    [ring] = coll.reduce(MODEL.numels, Choice(3), layout, True, 2048, ring=True)
    assert a2a.volume == ring.volume  # the ledger cannot tell them apart ...
    assert coll.inter_wire(a2a) / coll.inter_wire(ring) == pytest.approx(16 * 48 / 63)  # ... the link can


def test_world_gathers_take_two_hops_on_several_nodes_of_several_ranks() -> None:
    numels = MODEL.units[1].numels
    row = sum(accounting._chunks(numels, 8)) * 2  # one rank's bf16 row on 8 ranks
    first, second = coll.forward_gather(numels, Choice(3), Layout(8, 4), True, 2048, False)
    assert (first.pattern, second.pattern) == ("all_gather_inter", "intra_all_gather")
    assert first.volume == accounting.Volume(0, row) and second.volume == accounting.Volume(3 * 2 * row, 0)
    # the node's link carries one row per local index (4), not a world ring's 7 rows
    assert coll.inter_wire(first) == 4 * row and coll.inter_wire(second) == 0
    [one] = coll.backward_gather(numels, Choice(3), Layout(8, 8), True)  # one node: one all-gather
    assert one.pattern == "all_gather" and one.volume == accounting.Volume(7 * row, 0)


def test_ranking_picks_zeropp_on_a_slow_link_and_plain_zero_on_a_fast_one() -> None:
    model, work = gpt_of_size(2e9), Workload(micro_batch=4, seq_len=2048)
    slow = rank(model, gpu_cluster(2, 8, 100.0, 25.0, 2400.0, 80.0), work)
    assert slow[0].fits and slow[0].choice.is_zeropp, [r.choice.label for r in slow[:3]]
    fast = rank(model, gpu_cluster(2, 8, 100.0, 3200.0, 2400.0, 80.0), work)
    assert fast[0].fits and not fast[0].choice.is_zeropp and fast[0].choice.stage in (2, 3), \
        [r.choice.label for r in fast[:3]]
    zero3 = next(r for r in slow if r.choice == Choice(3))
    assert slow[0].time.step_s < zero3.time.step_s


def test_fits_flips_where_the_bytes_say() -> None:
    model, work = gpt_of_size(1e9), Workload(micro_batch=1, seq_len=1024)
    hw = fast_cluster(2, 4)
    numels = model.numels
    states = accounting.model_state_bytes(numels, 8)  # ZeRO-3, bf16, Adam: (2 + 2 + 12) M / P
    row = evaluate(model, Choice(3), hw, work)
    assert row.memory.states["total"] == states
    # two buckets of half reduce_bucket_size (filling, reducing), each with its received rows, in bf16
    working = 2 * min(max(work.bucket // 2, max(numels)), model.params) * 2 * 2
    working += (model.units[0].numel + 2 * model.units[1].numel) * 2
    need = states + working + activation_bytes(model, 1, 1024, False)
    assert row.memory.need == need
    assert evaluate(model, Choice(3), hw.with_memory(need), work).fits
    assert not evaluate(model, Choice(3), hw.with_memory(need - 1), work).fits
    stage0 = evaluate(model, Choice(0), hw.with_memory(need), work)  # 16 bytes per parameter on every rank
    assert stage0.memory.states["total"] == accounting.stage_model_state_bytes(numels, 8, 0, True)
    assert not stage0.fits


def test_model_states_follow_the_stage_formulas() -> None:
    numels = MODEL.numels
    for stage in (0, 1, 2):
        got = model_states(numels, Choice(stage), 4, separate_device=False)
        assert got["total"] == accounting.stage_model_state_bytes(numels, 4, stage, grads_pending=True)
    got = model_states(numels, Choice(3, hpz=2), 4, separate_device=False)
    assert got["total"] == accounting.model_state_bytes(numels, 4, hpz_group=2)
    offload = model_states(numels, Choice(3, offload=True), 4, separate_device=True)
    assert offload["shard_16bit"] == 2 * model_states(numels, Choice(3), 4)["shard_16bit"]  # + the staged row


# ---- the command line ------------------------------------------------------------------------------------
OPTIONS = {"--nodes": "4", "--gpus-per-node": "16", "--inter-node-gbps": "100", "--intra-node-gbps": "2400",
           "--gpu-tflops": "50", "--memory-gib": "32", "--seq-len": "512", "--micro-batch": "1"}
TUTORIAL = Path(__file__).parents[1] / "data" / "configs" / "deepspeed-zeropp-tutorial.json"


def plan_argv(model: str, **changes: str) -> list[str]:
    """``zeropp plan`` arguments; ``changes`` replace options (``nodes="0"``) or drop them (``value=""``)."""
    opts = dict(OPTIONS)
    for key, value in changes.items():
        opts["--" + key.replace("_", "-")] = value
    return ["plan", "--model", model] + [x for k, v in opts.items() if v for x in (k, v)]


def config_from_output(text: str) -> dict:
    return json.loads(text.split("config JSON:", 1)[1])


def test_cli_prints_a_ranked_table_and_a_config_that_loads(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    assert cli.main(plan_argv("18B") + ["--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) >= 10 and "ZeRO-3 + qwZ8 + hpZ16 + qgZ4" in text
    cfg = config_from_output(text)
    loaded = load_config(cfg)
    assert loaded.zero_optimization.stage == 3 and loaded.topology.ranks_per_node == 16
    saved = json.loads(out_json.read_text())
    assert saved["best_config"] == cfg and saved["rows"][0]["fits"]


def test_cli_reads_hf_and_deepspeed_configs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22,
                              "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 5632,
                              "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False}))
    assert cli.main(plan_argv(str(hf))) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "llama" in head and "1.1B parameters, 23 units" in head, head  # TinyLlama's shapes
    assert cli.main(plan_argv(str(TUTORIAL)) + ["--params", "18B"]) == 0
    cfg = config_from_output(capsys.readouterr().out)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 10_000_000  # the user's setting is kept
    assert cfg["zero_optimization"]["contiguous_gradients"] is True
    load_config(cfg)


@pytest.mark.parametrize("argv, named", [
    (plan_argv("/no/such/file.json"), "--model /no/such/file.json"),
    (plan_argv("18B", nodes="0"), "--nodes"),
    (plan_argv("18B", micro_batch="0"), "--micro-batch"),
    (plan_argv("18B") + ["--profile", "/no/profile.json"], "--profile /no/profile.json"),
    (plan_argv(str(TUTORIAL)), "--params"),
    (plan_argv("18B", gpu_tflops=""), "--gpu-tflops: required"),
    (plan_argv("18B", inter_node_gbps="-1"), "--inter-node-gbps"),
])
def test_bad_input_names_the_option(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeropp plan: ") and named in err, err


def test_bad_profile_names_the_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match=r"p\.json: invalid JSON at line 1"):
        load_profile(str(bad))
    good = sample_profile().to_json()
    del good["optimizer_per_s"]
    bad.write_text(json.dumps(good))
    with pytest.raises(PlanError, match=r"p\.json\.optimizer_per_s: missing"):
        load_profile(str(bad))


def sample_profile() -> Profile:
    fit = Fit(1e-3, 1e9)
    return Profile("loopback", "test", 2, 2, "cpu", True, 1e10, 1e10, {"8": 1e9, "4": 1e9}, {"8": 1e9, "4": 1e9},
                   1e8, 1e9, 1e10, {"all_gather": fit, "all_to_all": fit},
                   [InterLink("unlimited", None, {"all_gather": fit, "all_to_all": fit, "all_to_all_inter": fit,
                                                  "all_reduce": fit}),
                    InterLink("200mbit", 0.2, {k: Fit(1e-3, 2e7, 0.9) for k in ("all_gather", "all_to_all",
                                                                                 "all_to_all_inter", "all_reduce")})])


def test_profile_round_trips_and_a_shaped_link_slows_the_step(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    sample_profile().save(str(path))
    loaded = load_profile(str(path))
    assert loaded == sample_profile() and json.loads(path.read_text())["format"] == FORMAT
    from zeropp.tools.plan import from_profile

    fast = step_time(MODEL, Choice(3), from_profile(loaded, 2, 2, 1.0, link_label="unlimited"), ONE_BUCKET)
    slow = step_time(MODEL, Choice(3), from_profile(loaded, 2, 2, 1.0, link_label="200mbit"), ONE_BUCKET)
    assert slow.step_s > fast.step_s > 0
    assert fast.step_s == pytest.approx(max(fast.replayed_s, fast.cpu_bound_s))


def test_calibration_turns_timings_into_alpha_beta_and_wire_efficiency() -> None:
    from zeropp.tools.plan.calibrate import build_profile

    # 2 x 2 ranks, a 4 MiB row per rank: a ring all-gather receives 3 rows and puts 3 rows on each node's link;
    # at 0.2 Gbit/s (25 MB/s) that is 0.503 s of wire, measured as 0.6 s + 1 ms of alpha: efficiency 0.839
    row = 4 * 2**20
    per_byte = 0.6 / (3 * row)
    points = {"all_gather": [(3 * 65536, 0.001 + 3 * 65536 * per_byte), (3 * row, 0.601)]}
    result = {"label": "200mbit", "links": {"inter": points, "intra": {}},
              "host": {"matmul_flops": 1e9, "step_flops": 1e9, "quantize_per_s": {"8": 1e9},
                       "dequantize_per_s": {"8": 1e9}, "optimizer_per_s": 1e8, "reduce_sum_per_s": 1e8,
                       "copy_bytes_per_s": 1e9}}
    fit = build_profile([result], "emulated-cluster", "test", 2, 2, {"200mbit": 0.2}, "cpu").inter[0].fits["all_gather"]
    assert fit.alpha_s == pytest.approx(0.001, rel=1e-6)
    assert fit.wire_efficiency == pytest.approx(3 * row / 0.6 / 25e6, rel=1e-6)
    assert fit.seconds(3 * row) == pytest.approx(0.601)


def test_a_shaped_link_times_every_pattern_at_the_streaming_efficiency() -> None:
    """Note [streaming link efficiency]: the world all-gather's efficiency for every pattern, the per-pattern
    values kept in the profile; a profile without the all-gather keeps each pattern's own."""
    from dataclasses import replace

    from zeropp.tools.plan import from_profile

    base = sample_profile()

    def shaped(effs: dict[str, float]):  # the hardware of base with a 200 Mbit/s link measured at effs
        link = InterLink("200mbit", 0.2, {k: Fit(1e-3, 2e7, e) for k, e in effs.items()})
        return from_profile(replace(base, inter=[base.inter[0], link]), 2, 2, 1.0, link_label="200mbit")

    effs = {"all_gather": 0.93, "all_to_all": 0.8, "all_to_all_inter": 0.55, "all_reduce": 0.9}
    hw = shaped(effs)
    assert {k: hw.efficiency(k) for k in effs} == {k: 0.93 for k in effs}
    assert hw.shaped_fits["all_to_all_inter"].wire_efficiency == 0.55  # the measurement itself is kept
    hw = shaped({k: e for k, e in effs.items() if k != "all_gather"})
    assert hw.efficiency("all_to_all_inter") == 0.55 and hw.efficiency("all_to_all") == 0.8
    # the all-gather's efficiency alone moves a qgZ step (whose second hop is an all_to_all_inter)
    times = [step_time(MODEL, Choice(3, qgz_bits=4), shaped(e), ONE_BUCKET).step_s
             for e in (effs, {**effs, "all_gather": 0.5})]
    assert times[1] > times[0]


# ---- presets: --gpu and --fabric -------------------------------------------------------------------------
def plan_hardware(*argv: str):
    """The Hardware ``zeropp plan`` would time, from its command line (the same parser and resolution)."""
    import argparse

    from zeropp.tools.plan.cli import _hardware, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return _hardware(parser.parse_args(list(argv)))


def test_a_gpu_and_a_fabric_preset_fill_the_hardware() -> None:
    from zeropp.tools.plan import GPU_DEFAULTS

    hw = plan_hardware("--nodes", "4", "--gpus-per-node", "8", "--gpu", "h100", "--fabric", "ib-ndr")
    assert hw.flops == pytest.approx(0.45 * 989.4e12)  # 45% of the dense bf16 peak
    assert hw.memory_bytes == 80 * 2**30
    assert hw.intra_bytes_per_s == pytest.approx(3600e9 / 8)  # NVLink 4: 450 GB/s one direction
    assert hw.inter_bytes_per_s == pytest.approx(8 * 400e9 / 8)  # one NDR port per GPU, 8 GPUs
    assert hw.host_link_bytes_per_s == pytest.approx(400e9 / 8)  # PCIe gen5
    assert hw.quantize_per_s[8] == pytest.approx(GPU_DEFAULTS["quantize_per_s"] * 3350 / 900)  # HBM3 vs a V100
    assert hw.optimizer_per_s == pytest.approx(GPU_DEFAULTS["optimizer_per_s"] * 3350 / 900)
    assert hw.offload_optimizer_per_s == GPU_DEFAULTS["offload_optimizer_per_s"]  # host Adam: not HBM-bound
    assert "preset h100" in hw.source
    pcie = plan_hardware("--nodes", "2", "--gpus-per-node", "4", "--gpu", "L40S", "--fabric", "eth-25g")
    assert pcie.intra_bytes_per_s == pytest.approx(256e9 / 8) and pcie.inter_bytes_per_s == pytest.approx(25e9 / 8)
    assert pcie.memory_bytes == 48 * 2**30 and pcie.flops == pytest.approx(0.45 * 362.05e12)


def test_explicit_options_win_over_the_presets() -> None:
    hw = plan_hardware("--nodes", "4", "--gpus-per-node", "8", "--gpu", "a100-80gb", "--fabric", "ib-hdr",
                       "--gpu-tflops", "120", "--memory-gib", "76", "--intra-node-gbps", "1000",
                       "--inter-node-gbps", "50")
    assert hw.flops == 120e12 and hw.memory_bytes == 76 * 2**30
    assert hw.intra_bytes_per_s == 1000e9 / 8 and hw.inter_bytes_per_s == 50e9 / 8
    assert hw.quantize_per_s[4] == pytest.approx(250e9 * 2039 / 900)  # what was not given stays the preset's
    assert hw.host_link_bytes_per_s == pytest.approx(200e9 / 8)


def test_the_docs_preset_table_is_the_codes() -> None:
    from zeropp.tools.plan import GPUS

    doc = (Path(__file__).parents[2] / "docs" / "plan.md").read_text()
    rows = {cells[0].strip("` "): cells for line in doc.splitlines() if line.startswith("| `")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    for name, p in GPUS.items():
        cells = rows[name]  # | name | part | peak | used | memory | GB/s | intra | host | source |
        assert float(cells[3]) == pytest.approx(p.tflops, abs=0.05), name
        assert float(cells[4]) == p.memory_gib and float(cells[6].split()[0]) == p.intra_gbps, name
        assert float(cells[7].split()[0]) == p.host_link_gbps, name


def test_gpu_with_a_measured_profile_keeps_the_measured_rates(tmp_path: Path) -> None:
    from dataclasses import replace

    gpu_profile, cpu_profile = tmp_path / "gpu.json", tmp_path / "cpu.json"
    replace(sample_profile(), device="cuda", comm_uses_compute=False).save(str(gpu_profile))
    sample_profile().save(str(cpu_profile))
    hw = plan_hardware("--nodes", "2", "--gpus-per-node", "2", "--gpu", "h200", "--profile", str(gpu_profile))
    assert hw.flops == sample_profile().step_flops and hw.optimizer_per_s == sample_profile().optimizer_per_s
    assert hw.memory_bytes == 141 * 2**30 and hw.intra_bytes_per_s == pytest.approx(3600e9 / 8)
    assert hw.host_link_bytes_per_s == pytest.approx(400e9 / 8) and "preset h200" in hw.source
    with pytest.raises(PlanError, match="--gpu h200: the profile .*cpu.json measured CPU ranks"):
        plan_hardware("--nodes", "2", "--gpus-per-node", "2", "--gpu", "h200", "--profile", str(cpu_profile))


@pytest.mark.parametrize("argv, named", [
    (["--gpu", "h1000"], "--gpu h1000: unknown accelerator; known: v100-16gb, v100-32gb, a100-40gb, a100-80gb, h100"),
    (["--gpu", "h100", "--fabric", "ib-xdr"], "--fabric ib-xdr: unknown fabric; known: ib-ndr, ib-ndr-x1, ib-hdr"),
    (["--gpu", "h100"], "--inter-node-gbps: required without --profile (or --fabric NAME)"),
    (["--gpu", "v100-32gb", "--fabric", "eth-10g", "--fp32"], "--fp32: --gpu v100-32gb's rate is for bf16/fp16"),
])
def test_bad_presets_name_the_option(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = plan_argv("18B", gpu_tflops="", memory_gib="", inter_node_gbps="", intra_node_gbps="")
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeropp plan: ") and named in err, err


def test_cli_with_gpu_and_fabric_prints_a_ranking_that_follows_the_fabric(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "7B", "--nodes", "4", "--gpus-per-node", "8", "--gpu", "h100"]
    assert cli.main(argv + ["--fabric", "eth-100g"]) == 0
    text = capsys.readouterr().out
    head = text.splitlines()[0]
    assert "inter-node 100 Gbit/s" in head and "445 TFLOP/s and 80 GiB per rank" in head, head
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) >= 10 and rows[0][1].startswith("ZeRO-3 + ") and "qgZ" in rows[0][1], rows[:3]
    assert rows[0][6] == "yes"  # fits in 80 GiB
    slow = {r[1]: float(r[2]) for r in rows}
    assert cli.main(argv + ["--fabric", "ib-ndr"]) == 0  # 8 x 400 Gbit/s per node: ZeRO++ gains much less
    fast = {r[1]: float(r[2]) for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit() for r in [line.split(" | ")]}
    assert fast["ZeRO-3"] < slow["ZeRO-3"] / 5
    assert slow["ZeRO-3"] / slow[rows[0][1]] > 3 > fast["ZeRO-3"] / fast[rows[0][1]]
