"""DeepSpeed ZeRO checkpoints made by DeepSpeed 0.19.8 itself (tests/data/deepspeed, with the references DeepSpeed
computed) imported by ``engine.load_checkpoint`` on 2 and on 4 ranks, without DeepSpeed: the fp32 weights equal
zero_to_fp32's and Adam's moments and steps DeepSpeed's own, bit for bit, and the next 5 steps' losses DeepSpeed's
continued run; a zeropp checkpoint exported back has exactly the files, keys, dtypes and shapes DeepSpeed writes,
and importing the export gives back every piece of state the format holds, bit for bit."""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile

import pytest
import torch
from safetensors.torch import load_file

import zeropp
from support.ckpt_handmade import read_raw, write_raw
from support.ds_reference import ds_batch, ds_loss, make_model
from support.world import run_world
from zeropp.tools import cli
from zeropp.checkpoint import CheckpointError, load_full_checkpoint
from zeropp.deepspeed import checkpoint_format as fmt
from zeropp.deepspeed.checkpoint_io import export_deepspeed

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "deepspeed")
CASES = ("stage2_fp32", "stage2_bf16", "stage3_fp32", "stage3_bf16")
CONTINUED = 5


def reference(case: str) -> dict:
    ref = os.path.join(DATA, case, "reference")
    with open(os.path.join(ref, "continued_losses.json")) as f:
        losses = json.load(f)
    return {"weights": load_file(os.path.join(ref, "fp32_weights.safetensors")),
            "moments": load_file(os.path.join(ref, "optimizer_state.safetensors")), "losses": losses}


def config_of(case: str, world: int) -> dict:
    cfg = dict(reference(case)["losses"]["config"])
    cfg["train_micro_batch_size_per_gpu"] = 4 // world  # DeepSpeed's 2 ranks x 2 samples, on `world` ranks
    return cfg


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples DeepSpeed's rank ``rank // (world // 2)`` took at ``step``, this rank's share of them."""
    per = world // 2
    x, y = ds_batch(step, rank // per)
    i = rank % per
    m = 2 // per
    return x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]


def moments_of(engine) -> dict:
    """This rank's chunk of every parameter's Adam state, by name."""
    out = {}
    for u in engine.units:
        for slot, view in zip(u.slots, u.master_views()):
            st = engine.optimizer.state.get(view, {})
            out[slot.name] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    return out


def as_fp16(src: str, dst: str, scale: float) -> None:
    """A stage-3 checkpoint as DeepSpeed writes it in fp16 (a dynamic loss scaler, half weights in the model
    states); DeepSpeed cannot train fp16 on CPU, so this one is made from its fp32 files."""
    shutil.copytree(src, dst)
    tag_dir = os.path.join(dst, "global_step3")
    for name in os.listdir(tag_dir):
        path = os.path.join(tag_dir, name)
        tree = fmt.load_file(path)
        if "optimizer_state_dict" in tree:
            scaler = fmt.DynamicLossScaler(scale)
            scaler.__dict__.update(dynamic=True, cur_iter=3, last_overflow_iter=-1, scale_factor=2.0,
                                   scale_window=1000, min_scale=1.0, delayed_shift=2, cur_hysteresis=2,
                                   consecutive_hysteresis=False, raise_error_at_min_scale=True)
            tree["optimizer_state_dict"].update(loss_scaler=scaler, dynamic_loss_scale=True)
        else:
            tree["module"] = {k: (v.half() if v.numel() == 0 else v) for k, v in tree["module"].items()}
        fmt.save_file(tree, path)


def fp16_import(rank: int, world: int, root: str) -> dict:
    src = os.path.join(root, "fp16")
    if rank == 0:
        as_fp16(os.path.join(DATA, "stage3_fp32"), src, 1024.0)
    torch.distributed.barrier()
    cfg = config_of("stage3_fp32", world)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    engine, *_ = zeropp.initialize(model=make_model(1234), config=cfg)
    engine.load_checkpoint(src)
    out = {"scale": engine.loss_scaler.scale, "weights": engine.consolidated_state_dict()}
    engine.close()
    return out


def scenario(rank: int, world: int, root: str) -> dict:
    out = {"fp16": fp16_import(rank, world, root)}
    for case in CASES:
        cfg = config_of(case, world)
        engine, *_ = zeropp.initialize(model=make_model(1234), config=cfg)
        path, client = engine.load_checkpoint(os.path.join(DATA, case))
        got = {"path": path, "client": client, "weights": engine.consolidated_state_dict(),
               "moments": moments_of(engine), "lr": engine.get_lr(), "global_steps": engine.global_steps}
        saved = os.path.join(root, f"{case}_w{world}")
        engine.save_checkpoint(saved, tag="imported", client_state=client)
        dtype = torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32
        losses = []
        for step in range(3, 3 + CONTINUED):
            loss = ds_loss(engine, *batch(step, rank, world), dtype=dtype)
            engine.backward(loss)
            engine.step()
            value = loss.detach().reshape(1).clone()
            torch.distributed.all_reduce(value)
            losses.append(value.item() / world)
        got["losses"] = losses
        out[case] = got
        engine.close()
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> tuple[list, str]:
    root = tempfile.mkdtemp(prefix=f"zeropp-ds-import-{world}-")
    return run_world(scenario, world, root), root


def _full(chunks: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat([c.reshape(-1) for c in chunks])[: like.numel()].view(like.shape)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_import_gives_deepspeeds_weights_moments_and_losses(case, world):
    ranks, _ = results(world)
    ref = reference(case)
    for res in ranks:
        got = res[case]
        assert got["client"] == {"epoch": 1, "note": "hello"} and got["global_steps"] == 3
        assert got["lr"] == [ref["losses"]["load_checkpoint"]["lr"]]
        for name, want in ref["weights"].items():  # zero_to_fp32's weights, and the buffer
            assert torch.equal(got["weights"][name].float(), want), name
    for name, want in ref["weights"].items():
        if name == "out_shift":
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            full = _full([r[case]["moments"][name][key] for r in ranks], want)
            assert torch.equal(full, ref["moments"][f"{name}.{key}"]), (name, key)
        assert all(float(r[case]["moments"][name]["step"]) == 3.0 for r in ranks)
    theirs = [(a["loss"] + b["loss"]) / 2 for a, b in zip(*ref["losses"]["continued"].values())]
    tolerance = 1e-2 if "bf16" in case else 1e-5
    for ours, want in zip(ranks[0][case]["losses"], theirs):
        assert math.isclose(ours, want, rel_tol=tolerance), (ranks[0][case]["losses"], theirs)


def test_an_fp16_checkpoints_loss_scale_comes_with_it():
    want = reference("stage3_fp32")["weights"]
    for res in results(2)[0]:
        assert res["fp16"]["scale"] == 1024.0
        assert all(torch.equal(res["fp16"]["weights"][k].float(), v) for k, v in want.items())


def _structure(value, path: str = "") -> dict:
    """Key path -> (type, dtype, shape) of a DeepSpeed file's tree, values left out (``ds_config`` as a dict)."""
    out = {path: type(value).__name__}
    if isinstance(value, dict) and not path.endswith("['ds_config']"):
        for k, v in value.items():
            out.update(_structure(v, f"{path}[{k!r}]"))
    elif isinstance(value, (list, tuple)) and path.endswith("['params']") is False:
        for i, v in enumerate(value):
            out.update(_structure(v, f"{path}[{i}]"))
    elif isinstance(value, torch.Tensor):
        out[path] = ("Tensor", str(value.dtype), tuple(value.shape))
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        out[path] = (type(value).__name__, sorted(vars(value)))
    return out


@pytest.mark.parametrize("case", ["stage3_fp32", "stage3_bf16"])
def test_export_writes_deepspeeds_own_files(case, tmp_path):
    _, root = results(2)
    out = export_deepspeed(os.path.join(root, f"{case}_w2"), str(tmp_path), 2)
    shipped = fmt.list_files(fmt.deepspeed_tag_dir(os.path.join(DATA, case), None))
    ours = fmt.list_files(out)
    assert [os.path.basename(p) for p in ours.model_states + ours.optim_states] == \
        [os.path.basename(p) for p in shipped.model_states + shipped.optim_states]
    assert open(tmp_path / "latest").read() == "global_step3"
    for a, b in zip(ours.model_states + ours.optim_states, shipped.model_states + shipped.optim_states):
        assert _structure(fmt.load_file(a)) == _structure(fmt.load_file(b)), os.path.basename(a)
    back, theirs = fmt.read(out), fmt.read(fmt.deepspeed_tag_dir(os.path.join(DATA, case), None))
    for name in theirs.params:  # the state DeepSpeed made, through zeropp and back
        assert torch.equal(back.params[name], theirs.params[name])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.moments[name][key], theirs.moments[name][key])
    assert back.steps == theirs.steps and back.scheduler == theirs.scheduler and back.counters == theirs.counters
    assert back.hyper == theirs.hyper and back.client_state == theirs.client_state
    assert torch.equal(back.buffers["out_shift"], theirs.buffers["out_shift"])


@pytest.mark.parametrize("world", [1, 3, 4])
def test_import_of_an_export_is_the_checkpoint_bit_for_bit(world, tmp_path):
    _, root = results(4)
    src = os.path.join(root, "stage3_bf16_w4")
    want = load_full_checkpoint(src, with_optimizer=True)
    back = fmt.read(export_deepspeed(src, str(tmp_path), world))
    assert back.world == world and back.stage == 3 and back.bf16
    for name, value in back.params.items():
        assert torch.equal(value, want.state_dict[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.moments[name][key], want.optimizer[name][key]), (name, key)
        assert back.steps[name] == float(want.optimizer[name]["step"])
    assert back.scheduler == want.rank0["scheduler"] == {"last_batch_iteration": back.counters["global_steps"] - 1}
    assert back.counters["global_steps"] == want.manifest.raw["engine"]["global_steps"]
    assert back.client_state == want.client_state
    assert torch.equal(back.buffers["out_shift"], want.state_dict["out_shift"].float())
    group = {k: v for k, v in want.rank0["optimizer_param_groups"][0].items() if k not in ("params", "initial_lr")}
    assert back.hyper == [group]


def _edited(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    tag_dir = os.path.join(dst, "imported")
    raw = read_raw(tag_dir)
    edit(raw)
    write_raw(tag_dir, raw, reseal=True)
    return dst


def test_what_deepspeeds_format_cannot_hold_is_refused_by_name(tmp_path):
    _, root = results(2)
    src = os.path.join(root, "stage3_fp32_w2")
    assert cli.main(["export-deepspeed", src, str(tmp_path / "ok"), "--world-size", "2"]) == 0
    with pytest.raises(ValueError, match="world size"):
        export_deepspeed(src, str(tmp_path / "x"), 0)
    hpz = _edited(src, str(tmp_path / "hpz"), lambda raw: raw["topology"].update(hpz_partition_size=2))
    with pytest.raises(CheckpointError, match=r"hpZ \(zero_hpz_partition_size 2\).*--drop-unsupported"):
        export_deepspeed(hpz, str(tmp_path / "out"), 2)
    assert cli.main(["export-deepspeed", hpz, str(tmp_path / "out"), "--world-size", "2"]) == 1
    with pytest.warns(UserWarning, match="dropped hpZ"):
        export_deepspeed(hpz, str(tmp_path / "out"), 2, drop_unsupported=True)
    sgd = _edited(src, str(tmp_path / "sgd"), lambda raw: raw["engine"].update(optimizer="SGD"))
    with pytest.raises(CheckpointError, match="optimizer is SGD"):
        export_deepspeed(sgd, str(tmp_path / "out2"), 2)
    bad = tmp_path / "bad.pt"
    torch.save({"x": print}, bad)
    with pytest.raises(CheckpointError, match="bad.pt: not loaded, it holds objects beyond"):
        fmt.load_file(str(bad))
