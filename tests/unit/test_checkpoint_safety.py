"""Loading a checkpoint never runs code from it (Note [data, not code] in checkpoint/safe_io.py): a crafted
pickle put in place of each kind of file zeropp reads (its own, and DeepSpeed's), with the manifest's digests recomputed as a careful
attacker would, never runs its payload; the shard format round-trips what a shard holds; older pickled
checkpoints load through ``weights_only`` or are refused with the command that converts them."""
from __future__ import annotations

import json
import math
import os
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from support.ckpt_handmade import full_state, make_checkpoint, read_raw, write_raw
from zeropp.tools import cli
from zeropp.checkpoint import CheckpointError, load_full_checkpoint, verify_report
from zeropp.deepspeed import checkpoint_format as deepspeed_format
from zeropp.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zeropp.checkpoint.format import LATEST, MANIFEST, LegacyPickleError, sha256_file, shard_name
from zeropp.checkpoint.safe_io import UnstorableError, decode, encode, read_tree, write_tree


class Payload:
    """Unpickled, it creates the file ``path``: the stand-in for an attacker's code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def craft(path: str, marker: str) -> None:
    torch.save({"params": Payload(marker), "nonce": "x"}, path)


def forge(tag_dir: str, rank: int, marker: str, name: str) -> None:
    """Replace rank ``rank``'s shard by a crafted pickle and record its size and SHA-256, resealing the manifest."""
    path = os.path.join(tag_dir, name)
    craft(path, marker)
    raw = read_raw(tag_dir)
    raw["shards"][rank].update(bytes=os.path.getsize(path), sha256=sha256_file(path))
    write_raw(tag_dir, raw, reseal=True)


@pytest.fixture
def marker(tmp_path) -> str:
    return str(tmp_path / "pwned")


@pytest.mark.parametrize("version", [3, 2])
def test_a_crafted_shard_never_runs(tmp_path, marker, version):
    save = str(tmp_path / "ckpt")
    tag_dir = make_checkpoint(save, "t", seed=1, version=version)
    forge(tag_dir, 1, marker, shard_name(1, version))
    with pytest.raises(CheckpointError) as info:
        load_full_checkpoint(save, tag="t")
    assert shard_name(1, version) in str(info.value)
    if version == 2:  # weights_only refused the global: the error says how to convert a trusted checkpoint
        assert isinstance(info.value, LegacyPickleError) and "convert-checkpoint --trust-pickle" in str(info.value)
    assert cli.main(["consolidate", save, str(tmp_path / "out.safetensors"), "--tag", "t"]) == 1
    assert verify_report(save, "t").ok  # sizes and digests match: only reading the bytes could tell
    assert not os.path.exists(marker)


def test_crafted_manifest_and_latest_never_run(tmp_path, marker):
    save = str(tmp_path / "ckpt")
    make_checkpoint(save, "old", seed=1)
    tag_dir = make_checkpoint(save, "t", seed=2)
    craft(os.path.join(tag_dir, MANIFEST), marker)
    with pytest.raises(CheckpointError, match=MANIFEST):
        load_full_checkpoint(save, tag="t")
    craft(os.path.join(save, LATEST), marker)
    assert not verify_report(save).ok
    with pytest.warns(Warning):  # no tag from `latest`: the newest good tag is read instead
        assert load_full_checkpoint(save).manifest.raw["tag"] == "old"
    assert cli.main(["verify-checkpoint", save]) == 1
    assert not os.path.exists(marker)


def test_convert_runs_only_when_trusted_and_then_loads(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    tag_dir = make_checkpoint(save, "t", seed=3, version=2)
    for rank in range(2):  # an older zeropp's shard: NumPy's RNG state, which weights_only refuses
        path = os.path.join(tag_dir, shard_name(rank, 2))
        shard = torch.load(path, weights_only=False)
        shard["rng"] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate(),
                        "numpy": np.random.get_state()}
        torch.save(shard, path)
        raw = read_raw(tag_dir)
        raw["shards"][rank].update(bytes=os.path.getsize(path), sha256=sha256_file(path))
        write_raw(tag_dir, raw, reseal=True)
    with pytest.raises(LegacyPickleError, match=f"{shard_name(0, 2)}.*zeropp convert-checkpoint --trust-pickle"):
        load_full_checkpoint(save, tag="t")
    assert cli.main(["convert-checkpoint", save]) == 1
    assert "--trust-pickle" in capsys.readouterr().err
    assert cli.main(["convert-checkpoint", save, "--trust-pickle"]) == 0
    assert sorted(os.listdir(tag_dir)) == [MANIFEST, shard_name(0), shard_name(1)]
    got = load_full_checkpoint(save, tag="t")
    assert got.manifest.version == 3 and verify_report(save, "t").ok
    assert all(torch.equal(got.state_dict[k], v) for k, v in full_state(3).items())
    rng = read_tree(os.path.join(tag_dir, shard_name(1)))["rng"]
    assert rng["numpy"]["keys"].dtype == torch.int64 and rng["python"]["state"].numel() == 625


def test_the_tree_round_trips_and_any_reader_opens_it(tmp_path):
    row = torch.arange(10, dtype=torch.float32)
    tree = {"params": {"a": row[:4], "b": row[4:]}, "state": {0: {"step": torch.tensor(3.0)}, 7: {}},
            "groups": [{"lr": 0.1, "betas": (0.9, 0.95), "eps": float("inf"), "nan": math.nan, "flag": None}],
            "bf16": torch.ones(3, dtype=torch.bfloat16), "ints": torch.arange(5), "np": np.arange(4, dtype=np.uint32),
            "mixed_keys": {None: 1, True: 2, 1.5: 3}, "looks_tagged": {"__tensor__": "not a tensor"}}
    path = str(tmp_path / "x.safetensors")
    with open(path, "wb") as f:
        write_tree(f, tree)
    for mmap in (False, True):
        got = read_tree(path, use_mmap=mmap)
        assert torch.equal(got["params"]["a"], row[:4]) and torch.equal(got["params"]["b"], row[4:])
        assert set(got["state"]) == {0, 7} and got["state"][0]["step"].item() == 3.0
        group = got["groups"][0]
        assert group["betas"] == (0.9, 0.95) and group["eps"] == math.inf and math.isnan(group["nan"])
        assert got["bf16"].dtype == torch.bfloat16 and torch.equal(got["ints"], torch.arange(5))
        assert isinstance(got["np"], np.ndarray) and got["np"].tolist() == [0, 1, 2, 3]
        assert got["mixed_keys"] == {None: 1, True: 2, 1.5: 3} and got["looks_tagged"] == tree["looks_tagged"]
    with safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["zeropp"])["groups"][0]["lr"] == 0.1
        assert torch.equal(f.get_tensor("params/a"), row[:4])
    data, tensors = encode(tree)
    assert decode(json.loads(json.dumps(data)), tensors)["groups"][0]["betas"] == (0.9, 0.95)


def test_what_is_neither_data_nor_a_tensor_is_refused_by_where_it_sits():
    with pytest.raises(UnstorableError, match=r"client_state\['model'\]\['cls'\] is a .*Payload"):
        encode({"model": {"cls": Payload("x")}}, "client_state")
    with pytest.raises(UnstorableError, match=r"client_state\['steps'\]\[1\] is a builtins.set"):
        encode({"steps": [1, {2}]}, "client_state")
    with pytest.raises(UnstorableError, match="key of type object"):
        encode({object(): 1}, "client_state")


def test_a_non_shard_file_is_an_error_that_names_it(tmp_path):
    path = tmp_path / "shard_rank00000.safetensors"
    for content in (b"", b"\x00" * 7, (2**40).to_bytes(8, "little") + b"{}", (2).to_bytes(8, "little") + b"{}"):
        path.write_bytes(content)
        with pytest.raises(ValueError):
            read_tree(str(path))
    shutil.rmtree(tmp_path)


DS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "deepspeed")


def test_a_crafted_deepspeed_file_never_runs(tmp_path, marker):
    case = tmp_path / "stage2_fp32"
    shutil.copytree(os.path.join(DS, "stage2_fp32"), case)
    target = case / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    craft(str(target), marker)
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: not loaded"):
        deepspeed_format.read(deepspeed_format.deepspeed_tag_dir(str(case), None))
    with pytest.raises(CheckpointError, match="not loaded"):
        get_fp32_state_dict_from_zero_checkpoint(str(case))
    assert not os.path.exists(marker)


@pytest.mark.parametrize("case", ["stage2_fp32", "stage2_bf16", "stage3_fp32", "stage3_bf16"])
def test_deepspeed_fp32_weights_equal_zero_to_fp32s(case):
    want = load_file(os.path.join(DS, case, "reference", "fp32_weights.safetensors"))
    got = get_fp32_state_dict_from_zero_checkpoint(os.path.join(DS, case))
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
