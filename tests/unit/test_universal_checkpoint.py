"""Universal checkpoints without a process group: the universal checkpoints DeepSpeed 0.19.8's own ``ds_to_universal``
wrote (tests/data/deepspeed_universal) read back as DeepSpeed's references say, bit for bit; zeropp's converter,
given the DeepSpeed ZeRO checkpoints those came from, writes the same tensors in the files DeepSpeed's loaders read;
zeropp's own universal files round-trip; and bad input is an error that names the file and what is wrong."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from zeropp.checkpoint import CheckpointError, IntegrityError
from zeropp.checkpoint.universal_format import UNIVERSAL_FILE, read_universal, write_universal
from zeropp.deepspeed import checkpoint_format as fmt
from zeropp.deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO, constants, ds_to_universal
from zeropp.deepspeed.checkpoint.universal_io import (
    LATEST_UNIVERSAL, MODEL_STATES_3, from_deepspeed_zero, open_universal, read_ds_universal,
    universal_folder,
)
from zeropp.tools import cli

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
ZERO = os.path.join(DATA, "deepspeed")
UNIVERSAL = os.path.join(DATA, "deepspeed_universal")
CASES = ("stage2_fp32", "stage3_bf16")  # DeepSpeed-made universal checkpoints of these ZeRO checkpoints
NAMES = ["out_scale", "fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias", "head.weight",
         "head.bias"]


def references(case: str) -> tuple[dict, dict]:
    ref = os.path.join(ZERO, case, "reference")
    return load_file(os.path.join(ref, "fp32_weights.safetensors")), load_file(os.path.join(ref,
                                                                                       "optimizer_state.safetensors"))


def assert_matches_deepspeed(uc, case: str) -> None:
    """Every parameter's fp32 value, moments and step are DeepSpeed's, bit for bit; the rest as DeepSpeed saved it."""
    weights, moments = references(case)
    assert [p.name for p in uc.params] == NAMES
    for p in uc.params:
        values = uc.read(p, True)
        assert values.fp32.dtype == torch.float32 and torch.equal(values.fp32, weights[p.name]), p.name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(values.state[key], moments[f"{p.name}.{key}"]), (p.name, key)
        assert float(values.state["step"]) == 3.0
    assert uc.global_steps == 3 and uc.scheduler_steps == 3 and uc.world_size == 2
    assert uc.groups[0]["lr"] == 0.007 and uc.groups[0]["betas"] == (0.9, 0.999)
    assert uc.groups[0]["weight_decay"] == 0.01
    assert torch.equal(uc.buffers["out_shift"], weights["out_shift"])
    assert {k: v for k, v in uc.client_state.items() if k != UNIVERSAL_CHECKPOINT_INFO} == {"epoch": 1, "note": "hello"}


@pytest.mark.parametrize("case", CASES)
def test_deepspeeds_own_universal_checkpoints_read_as_deepspeed_wrote_them(case):
    folder = universal_folder(os.path.join(UNIVERSAL, case), None)
    assert os.path.basename(folder) == "global_step3_universal"
    uc = open_universal(folder)
    assert_matches_deepspeed(uc, case)
    assert uc.compute_dtype == ("bfloat16" if "bf16" in case else "float32")


@pytest.mark.parametrize("case", CASES)
def test_zeropps_converter_writes_the_tensors_deepspeeds_converter_writes(case, tmp_path):
    out = ds_to_universal.main(ds_to_universal.parse_arguments(
        ["--input_folder", os.path.join(ZERO, case, "global_step3"), "--output_folder",
         str(tmp_path / "global_step3_universal")]))
    assert open(tmp_path / LATEST_UNIVERSAL).read() == "global_step3_universal"
    theirs = os.path.join(UNIVERSAL, case, "global_step3_universal")
    for name in NAMES:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            a, b = fmt.load_file(os.path.join(out, "zero", name, f"{key}.pt")), \
                fmt.load_file(os.path.join(theirs, "zero", name, f"{key}.pt"))
            a, b = a["param"], (b["param"] if isinstance(b, dict) else b)  # a stage-3 source: the bare flat tensor
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a.reshape(-1), b.reshape(-1)), (name, key)
        assert float(fmt.load_file(os.path.join(out, "zero", name, "step.pt"))) == 3.0
    # what DeepSpeed's loaders read: stage 1-2 the model states' mp_rank_00 and optimizer_state's param_groups,
    # clip_grad, ds_version; stage 3 zero_pp_rank_0 and optimizer_state_dict's state[0]['step'] and param_groups[0]
    opt = fmt.load_file(os.path.join(out, "zero", "optimizer_state.pt"))
    assert opt[constants.PARAM_GROUPS][0]["lr"] == 0.007 and opt[constants.CLIP_GRAD] == 1.0
    assert opt[constants.DS_VERSION] == "0.19.8" and opt[constants.LOSS_SCALER].cur_scale == 1.0
    assert float(opt["optimizer_state_dict"]["state"][0]["step"]) == 3.0
    assert opt["optimizer_state_dict"]["param_groups"][0]["betas"] == (0.9, 0.999)
    source = "mp_rank_00_model_states.pt" if "stage2" in case else MODEL_STATES_3
    their_module = fmt.load_file(os.path.join(theirs, source))["module"]
    for file in ("mp_rank_00_model_states.pt", MODEL_STATES_3):  # both: DeepSpeed loads it at any stage
        ms = fmt.load_file(os.path.join(out, file))
        assert ms["lr_scheduler"] == {"last_batch_iteration": 2} and ms["global_steps"] == 3
        assert ms["epoch"] == 1 and ms["note"] == "hello" and ms["dp_world_size"] == 2
        assert ms[UNIVERSAL_CHECKPOINT_INFO][constants.UNIVERSAL_CHECKPOINT_VERSION_KEY] == 0.4
        assert list(ms["module"]) == list(their_module)
        assert torch.equal(ms["module"]["out_shift"], their_module["out_shift"])
    assert_matches_deepspeed(read_ds_universal(out), case)


def test_zeropps_own_files_round_trip_and_load_as_universal(tmp_path):
    uc = from_deepspeed_zero(os.path.join(ZERO, "stage2_fp32", "global_step3"))
    out = write_universal(uc, str(tmp_path / "uc"))
    assert sorted(os.listdir(os.path.join(out, "params"))) == sorted(f"{n}.safetensors" for n in NAMES)
    back = read_universal(out)
    assert_matches_deepspeed(back, "stage2_fp32")
    assert back.state_dict_keys == uc.state_dict_keys and back.config == uc.config
    # any safetensors reader opens a parameter's file
    assert torch.equal(load_file(os.path.join(out, "params", "fc1.weight.safetensors"))["fp32"],
                       references("stage2_fp32")[0]["fc1.weight"])
    # the CLI writes zeropp's files too, and names them in latest_universal
    assert cli.main(["to-universal", os.path.join(ZERO, "stage3_bf16"), str(tmp_path / "s3" / "u"),
                     "--format", "zeropp"]) == 0
    assert_matches_deepspeed(open_universal(universal_folder(str(tmp_path / "s3"), None)), "stage3_bf16")


def test_the_cli_converts_a_deepspeed_save_directory(tmp_path, capsys):
    assert cli.main(["to-universal", os.path.join(ZERO, "stage2_fp32"), str(tmp_path / "u")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "u")
    assert_matches_deepspeed(open_universal(str(tmp_path / "u")), "stage2_fp32")
    assert cli.main(["to-universal", str(tmp_path / "nothing"), str(tmp_path / "v")]) == 1
    assert "zeropp to-universal:" in capsys.readouterr().err
    assert ds_to_universal.run(["--input_folder", str(tmp_path / "nothing"), "--output_folder",
                                str(tmp_path / "w")]) == 1


# ---- bad input: each a named error ------------------------------------------------------------------------------------
@pytest.fixture()
def ds_copy(tmp_path):
    dst = tmp_path / "stage2_fp32"
    shutil.copytree(os.path.join(UNIVERSAL, "stage2_fp32"), dst, ignore=shutil.ignore_patterns("reference"))
    return str(dst / "global_step3_universal")


def read_all(folder: str) -> None:
    uc = open_universal(folder)
    for p in uc.params:
        uc.read(p, True)


def test_a_missing_file_is_named(ds_copy):
    os.remove(os.path.join(ds_copy, "zero", "fc2.weight", "exp_avg_sq.pt"))
    with pytest.raises(CheckpointError, match=r"fc2\.weight/exp_avg_sq\.pt: no such file: parameter fc2\.weight"):
        read_all(ds_copy)
    os.remove(os.path.join(ds_copy, "zero", "optimizer_state.pt"))
    with pytest.raises(CheckpointError, match=r"zero/optimizer_state\.pt: no such file"):
        open_universal(ds_copy)


def test_a_missing_latest_or_folder_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"latest_universal: no such file: checkpoint\.load_universal is set"):
        universal_folder(str(tmp_path), None)
    with pytest.raises(CheckpointError, match="no such universal checkpoint folder"):
        universal_folder(str(tmp_path), "global_step9_universal")
    with pytest.raises(CheckpointError, match="it is a regular checkpoint"):
        open_universal(os.path.join(ZERO, "stage2_fp32", "global_step3"))


def test_a_wrong_shape_is_named(ds_copy):
    fmt.save_file({"param": torch.zeros(15, 8), "cat_dim": 0}, os.path.join(ds_copy, "zero", "fc1.weight", "fp32.pt"))
    with pytest.raises(CheckpointError, match=r"fc1\.weight/fp32\.pt: holds 120 elements of shape \[15, 8\]; "
                                              r"parameter fc1\.weight has shape \[16, 8\] \(128\)"):
        read_all(ds_copy)


def test_a_corrupted_file_is_named(ds_copy):
    path = os.path.join(ds_copy, "zero", "head.bias", "exp_avg.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=r"cannot read .*head\.bias/exp_avg\.pt"):
        read_all(ds_copy)


def test_a_pickle_beyond_deepspeeds_format_is_refused(ds_copy):
    path = os.path.join(ds_copy, "zero", "fc1.bias", "fp32.pt")
    torch.save({"param": torch.zeros(16), "evil": shutil.rmtree}, path)  # a global no checkpoint holds
    with pytest.raises(CheckpointError, match=r"fc1\.bias/fp32\.pt: not loaded, it holds objects beyond"):
        read_all(ds_copy)


def test_model_parallel_files_are_refused(ds_copy):
    shutil.copy(os.path.join(ds_copy, "mp_rank_00_model_states.pt"), os.path.join(ds_copy, "mp_rank_01_model_states.pt"))
    with pytest.raises(CheckpointError, match="mp_rank_01_model_states.pt: a model-parallel rank's file"):
        open_universal(ds_copy)


def test_zeropps_files_are_verified_before_they_are_read(tmp_path):
    out = write_universal(from_deepspeed_zero(os.path.join(ZERO, "stage2_fp32", "global_step3")), str(tmp_path / "u"))
    path = os.path.join(out, "params", "norm.bias.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    uc = read_universal(out)
    with pytest.raises(IntegrityError, match=r"norm\.bias\.safetensors has SHA-256"):
        uc.read(uc.param("norm.bias"), True)
    os.remove(path)
    with pytest.raises(IntegrityError, match=r"universal checkpoint file missing: .*norm\.bias\.safetensors"):
        uc.read(uc.param("norm.bias"), False)
    meta = os.path.join(out, UNIVERSAL_FILE)
    raw = json.load(open(meta))
    raw["params"][1]["shape"] = [8, 16]
    json.dump(raw, open(meta, "w"))
    with pytest.raises(IntegrityError, match="universal_sha256 does not match"):
        read_universal(out)


def test_deepspeeds_names_for_universal_checkpoints():
    import zeropp.deepspeed.checkpoint as ds_checkpoint
    from zeropp.deepspeed.missing import DeepSpeedAPIError
    assert ds_checkpoint.UNIVERSAL_CHECKPOINT_INFO == "universal_checkpoint_info"
    assert ds_checkpoint.UNIVERSAL_CHECKPOINT_VERSION_VALUE == 0.4 and ds_checkpoint.PARAM == "param"
    with pytest.raises(DeepSpeedAPIError, match="deepspeed.checkpoint.DeepSpeedCheckpoint is not implemented"):
        ds_checkpoint.DeepSpeedCheckpoint
    with pytest.raises(AttributeError):
        ds_checkpoint.no_such_name


def test_a_vocabulary_tensor_cut_to_its_rows_loads_padded_with_zeros(ds_copy):
    """DeepSpeed's converter cuts a vocabulary tensor's padding rows (``original_vocab_size``): the model's larger
    first dimension takes it padded with zeros, as DeepSpeed's loader pads it."""
    from zeropp.checkpoint.engine_state import Param
    from zeropp.checkpoint.universal import _chunk, _fits
    head = os.path.join(ds_copy, "mp_rank_00_model_states.pt")
    states = fmt.load_file(head)
    states[UNIVERSAL_CHECKPOINT_INFO] = {constants.VOCABULARY_PARAMETER_PATTERNS: [r"head\.weight"],
                                         constants.ORIGINAL_VOCAB_SIZE: 4}
    fmt.save_file(states, head)
    weights = references("stage2_fp32")[0]
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        path = os.path.join(ds_copy, "zero", "head.weight", f"{key}.pt")
        tree = fmt.load_file(path)
        fmt.save_file({"param": tree["param"][:4].clone(), "cat_dim": 0, "vocab_tensor": True}, path)
    uc = open_universal(ds_copy)
    entry = uc.param("head.weight")
    assert entry.rows_trimmed and entry.shape == (4, 16) and _fits(entry, (5, 16)) and not _fits(entry, (5, 8))
    values = uc.read(entry, True)
    assert torch.equal(values.fp32, weights["head.weight"][:4])
    p = Param("head.weight", ["head.weight"], (5, 16), 80, 0, 48, torch.zeros(48), torch.zeros(48), 0)
    chunk = _chunk(values.fp32, p, entry, 48, ds_copy, "the fp32 value")  # rank 1 of 2: elements 48..95
    assert torch.equal(chunk[:16], weights["head.weight"][3]) and not chunk[16:].any()
    with pytest.raises(CheckpointError, match=r"has shape \[5, 16\], the checkpoint records \[4, 16\]"):
        _chunk(weights["head.weight"], p, entry, 0, ds_copy, "the fp32 value")


def test_which_parameters_must_match():
    """Every trainable parameter of the model must be in the checkpoint; a frozen one it lacks keeps the model's value
    only non-strict (load_module_strict=False), which also ignores parameters the model lacks; shapes must agree."""
    from zeropp.checkpoint.engine_state import Param
    from zeropp.checkpoint.universal import Universal, UniversalParam, _match

    def param(name: str, shape: tuple, trains: bool, aliases: tuple = ()) -> Param:
        n = int(torch.Size(shape).numel())
        return Param(name, [name, *aliases], shape, n, 0, n, torch.zeros(n), torch.zeros(n), 0 if trains else None)

    uc = Universal("ckpt", [UniversalParam("w", (2, 3), 0, ("exp_avg", "exp_avg_sq")), UniversalParam("f", (4,), None),
                            UniversalParam("old", (1,), None)], read=None, aliases={"tied.w": "w"})
    model = [param("w", (2, 3), True), param("f", (4,), False), param("g", (2,), False)]
    with pytest.raises(CheckpointError, match=r"lacks the model's parameters \['g'\]; load it non-strict"):
        _match(model, uc, strict=True)
    loading, entries = _match(model, uc, strict=False)
    assert [p.name for p in loading] == ["w", "f"] and entries["w"].name == "w"
    with pytest.raises(CheckpointError, match=r"lacks the model's parameters \['h'\]$"):
        _match([*model, param("h", (3,), True)], uc, strict=False)
    with pytest.raises(CheckpointError, match=r"holds parameters the model lacks \['old'\]"):
        _match(model[:2], uc, strict=True)
    with pytest.raises(CheckpointError, match=r"parameter w has shape \[2, 3\] in the universal checkpoint, \[3, 2\]"):
        _match([param("w", (3, 2), True)], uc, strict=False)
    loading, entries = _match([param("tied.w", (2, 3), True)], uc, strict=False)  # found through its alias
    assert entries["tied.w"].name == "w"
