"""Checkpoints: exact resume in new processes (ZeRO-3, and ZeRO-3 + qwZ + hpZ + qgZ in bf16, with WarmupLR),
elastic resume 4 -> 2 and 4 -> 3, a real SIGKILL in the middle of a save, consolidation without
torch.distributed, the 16-bit export and the errors that name the file or parameter at fault.

Each world of processes starts once for the module (lru_cache), as in test_stage3.py, and independent
worlds run side by side (see ``worlds``); tests/support/ckpt_worlds.py has what runs on the ranks.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from support.ckpt_crash import run_crashing_world
from support.ckpt_worlds import GB, MICRO_STEPS, N, VARIANTS, crash_run, elastic, first_run, resume
from support.models import TiedNet, tied_batch
from support.world import run_world
from zeropp.tools import cli
from zeropp.checkpoint import (
    FORMAT_VERSION, CheckpointError, CheckpointWarning, consolidate, list_tags, load_full_checkpoint,
)
from zeropp.checkpoint.format import MANIFEST, shard_name
from zeropp.checkpoint.manifest import manifest_digest


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ckpt"))


def _corrupt_copy(root: str) -> None:
    """``root/corrupt``: the zero3 checkpoint with the end of rank 1's shard zeroed, its size unchanged."""
    dst = os.path.join(root, "corrupt")
    shutil.copytree(os.path.join(root, "zero3"), dst)
    path = os.path.join(dst, f"global_step{N}", shard_name(1))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 256)
        f.write(bytes(256))


@functools.lru_cache(maxsize=None)
def worlds(root: str) -> dict[str, Future]:
    """Start every world once, each as soon as what it loads exists.

    Process start-up dominates (it is most of each world's time on two cores), so independent worlds
    overlap: the crash world runs beside the first run, and the three loading worlds beside each other.
    """
    pool = ThreadPoolExecutor(max_workers=6)
    crash_dir, expected = os.path.join(root, "crash"), os.path.join(root, "crash_expected.pt")
    first = pool.submit(run_world, first_run, 4, root, ranks_per_node=2)
    crash = pool.submit(run_crashing_world, crash_run, 2, crash_dir, expected, "shard_write:1")
    late = os.path.join(root, "crash_late")  # killed after the tag's rename, before `latest` moves
    crash_late = pool.submit(run_crashing_world, crash_run, 1, late, os.path.join(root, "late_expected.pt"),
                             "before_latest:0")

    def resumed() -> list:
        first.result()
        _corrupt_copy(root)
        return run_world(resume, 4, root, ranks_per_node=2)

    def elastic_on(world: int) -> dict:
        first.result()
        if world == 2:
            crash.result()
        return run_world(elastic, world, root, crash_dir if world == 2 else None)[0]

    out = {"first": first, "crash": crash, "crash_late": crash_late, "resumed": pool.submit(resumed),
           "elastic2": pool.submit(elastic_on, 2), "elastic3": pool.submit(elastic_on, 3)}
    pool.shutdown(wait=False)
    return out


def first(root: str) -> list:
    return worlds(root)["first"].result()


def resumed(root: str) -> list:
    return worlds(root)["resumed"].result()


def crashed(root: str) -> tuple[list[int], str, str]:
    codes = worlds(root)["crash"].result()
    return codes, os.path.join(root, "crash"), os.path.join(root, "crash_expected.pt")


def elastic_on(root: str, world: int) -> dict:
    return worlds(root)[f"elastic{world}"].result()


def _assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


# ---- exact resume ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exact_resume_is_bit_for_bit(root, variant):
    before, _ = MICRO_STEPS[variant]
    for rank, (full, part) in enumerate(zip(first(root), resumed(root))):
        uninterrupted = full[variant]["losses"][before:]
        assert part[variant]["losses"] == uninterrupted, f"rank {rank}"
        assert part[variant]["scale"] == full[variant]["scale"]  # the fp16 loss scaler resumes too
        assert part[variant]["client_state"] == {"rank": rank, "next": before}
        assert part[variant]["path"] == full[variant]["path"]
    assert first(root)[0]["zero3"]["path"].endswith(f"global_step{N}")


def test_fp16_scale_was_lowered_before_the_save(root):
    """Otherwise the scaler's resume above would be checked on its initial value only."""
    assert first(root)[0]["fp16"]["scale"] < 2**22


def test_reload_into_a_trained_zeropp_engine_drops_its_hpz_slices(root):
    before, _ = MICRO_STEPS["zeropp"]
    for full, part in zip(first(root), resumed(root)):
        assert part["zeropp"]["reloaded_losses"] == full["zeropp"]["losses"][before:]


def test_module_only_load_takes_the_weights_alone(root):
    got = resumed(root)[0]["module_only"]
    _assert_same_state(got["state"], first(root)[0]["zero3"]["saved_state"])
    assert got["optimizer_state"] == 0 and got["global_steps"] == 0


# ---- elastic resume --------------------------------------------------------------------------------------
def _reference_step(root: str, lr: float) -> dict:
    """One AdamW step in one process from the checkpoint's full parameters and moments."""
    full = load_full_checkpoint(os.path.join(root, "zero3"), tag=f"global_step{N}", with_optimizer=True)
    model = TiedNet()
    model.load_state_dict(full.state_dict)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for name, p in model.named_parameters():
        opt.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in full.optimizer[name].items()}
    idx, tgt = tied_batch(N, GB)
    model(idx, tgt).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 3])
def test_elastic_resume_from_four_ranks(root, world):
    got = elastic_on(root, world)
    saved = first(root)[0]["zero3"]["saved_state"]
    _assert_same_state(got["loaded"], saved)  # consolidated parameters after load == before save, exactly
    full = load_full_checkpoint(os.path.join(root, "zero3"), tag=f"global_step{N}", with_optimizer=True)
    for key in ("exp_avg", "exp_avg_sq"):
        for name, t in got["moments"][key].items():
            assert torch.equal(t, full.optimizer[name][key]), (key, name)
            assert t.abs().sum() > 0
    assert got["steps"] == {float(N)}
    assert got["counters"] == (N, N, N)
    assert got["client_state"] == {"rank": 0, "next": N}  # rank 0's on a different world size
    ref = _reference_step(root, got["lr"])
    for k, want in ref.items():
        assert (got["stepped"][k] - want).abs().max().item() <= 1e-5, k
        assert not torch.equal(got["stepped"][k], saved[k]), f"{k} did not move"


@pytest.mark.parametrize("world", [2, 3])
def test_stage0_checkpoints_load_into_stage3_and_back(root, world):
    """Note [stage 0 checkpoints]: a stage-0 tag (every rank's file whole) re-shards into stage 3 on another
    world size, and a stage-3 tag loads whole into stage 0, each bit for bit."""
    got = elastic_on(root, world)["across_stages"]
    _assert_same_state(got["into_stage3"], first(root)[0]["stage0"]["saved_state"])
    _assert_same_state(got["into_stage0"], first(root)[0]["zero3"]["saved_state"])
    assert got["stage0_steps"] == N
    full = load_full_checkpoint(os.path.join(root, "zero3"), tag=f"global_step{N}", with_optimizer=True)
    for name, t in got["stage0_moments"].items():
        assert torch.equal(t, full.optimizer[name]["exp_avg"].flatten()), name


def test_a_stage0_checkpoint_holds_the_whole_state_in_every_file(root):
    first(root)
    with open(os.path.join(root, "stage0", f"global_step{N}", MANIFEST)) as f:
        m = json.load(f)
    assert m["engine"]["stage"] == 0 and len(m["shards"]) == 4
    embed = next(p for p in m["params"] if p["name"] == "embed.weight")
    assert embed["chunk"] >= embed["numel"] == 91
    consolidated = load_full_checkpoint(os.path.join(root, "stage0"), tag=f"global_step{N}")
    _assert_same_state({k: consolidated.state_dict[k] for k in first(root)[0]["stage0"]["saved_state"]},
                       first(root)[0]["stage0"]["saved_state"])


# ---- crash safety ----------------------------------------------------------------------------------------
def test_sigkill_in_the_middle_of_a_save_keeps_the_previous_tag(root):
    codes, save_dir, expected = crashed(root)
    assert codes[1] == -9, f"rank 1 was meant to die by SIGKILL: exit codes {codes}"
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read() == "good"
    entries = os.listdir(save_dir)
    assert "bad" not in entries and "good" in entries
    torn = [e for e in entries if e.startswith(".bad.tmp-")]
    assert torn, entries  # the interrupted save is left hidden, never under its tag
    assert any(n.startswith(shard_name(1) + ".tmp-") for n in os.listdir(os.path.join(save_dir, torn[0])))
    want = torch.load(expected)
    out = consolidate(save_dir, os.path.join(root, "crash_consolidated.pt"))  # tag from `latest`
    _assert_same_state(torch.load(out), want)
    got = elastic_on(root, 2)  # and a new world of engines loads it
    assert got["crash_path"].endswith(os.sep + "good")
    _assert_same_state(got["crash_state"], want)


def test_sigkill_before_latest_moves_leaves_latest_on_the_previous_tag(root):
    codes = worlds(root)["crash_late"].result()
    assert codes == [-9]
    save_dir = os.path.join(root, "crash_late")
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read() == "good"
    assert list_tags(save_dir) == ["bad", "good"]  # the new tag is complete, just not yet `latest`
    want = torch.load(os.path.join(root, "late_expected.pt"))
    _assert_same_state(load_full_checkpoint(save_dir).state_dict, want)
    later = load_full_checkpoint(save_dir, "bad").state_dict  # one step later
    assert not all(torch.equal(later[k], want[k]) for k in want)


def test_resaving_a_tag_replaces_it_and_leaves_nothing_behind(root):
    first(root)
    resave = os.path.join(root, "resave")
    assert sorted(os.listdir(resave)) == ["latest", "t"]
    assert sorted(os.listdir(os.path.join(resave, "t"))) == [MANIFEST] + [shard_name(r) for r in range(4)]
    assert load_full_checkpoint(resave).client_state == "second"


# ---- consolidation and export ----------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".pt", ".bin", ".safetensors"])
def test_consolidated_file_loads_into_the_plain_model(root, suffix):
    if suffix == ".safetensors":
        load_file = pytest.importorskip("safetensors.torch").load_file
    saved = first(root)[0]["zero3"]["saved_state"]
    out = os.path.join(root, "out", "model" + suffix)
    assert cli.main(["consolidate", os.path.join(root, "zero3"), out, "--tag", f"global_step{N}"]) == 0
    state = load_file(out) if suffix == ".safetensors" else torch.load(out)
    assert set(state) == set(TiedNet().state_dict())  # tied weight under both of its names
    plain, from_engine = TiedNet(), TiedNet()
    plain.load_state_dict(state)
    from_engine.load_state_dict(saved)
    idx, tgt = tied_batch(99, GB)
    with torch.no_grad():
        assert torch.equal(plain(idx, tgt), from_engine(idx, tgt))
    _assert_same_state({k: state[k] for k in saved}, saved)


def test_16bit_model_holds_the_compute_dtype_weights(root):
    """stage3_gather_16bit_weights_on_model_save: one file, the consolidated weights cast to 16 bits."""
    saved = first(root)[0]["zeropp"]["saved_state"]
    assert os.listdir(os.path.join(root, "16bit")) == ["pytorch_model.bin"]
    state = torch.load(os.path.join(root, "16bit", "pytorch_model.bin"))
    assert set(state) == set(saved)
    for k, v in saved.items():
        assert state[k].dtype == torch.bfloat16
        assert torch.equal(state[k], v.to(torch.bfloat16)), k
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()  # tied stays tied


def test_manifest_records_layout_and_topology(root):
    first(root)
    with open(os.path.join(root, "zeropp", f"global_step{N}", MANIFEST)) as f:
        m = json.load(f)
    assert m["format_version"] == 3 and m["zeropp_version"]
    assert m["topology"] == {"world_size": 4, "ranks_per_node": 2, "num_nodes": 2, "hpz_partition_size": 2}
    assert m["engine"]["compute_dtype"] == "bfloat16" and m["engine"]["scheduler"] == "WarmupLR"
    embed = next(p for p in m["params"] if p["name"] == "embed.weight")
    assert embed["shape"] == [13, 7] and embed["numel"] == 91 and embed["world"] == 4 and embed["chunk"] == 24
    assert embed["aliases"] == ["embed.weight", "head.weight"]
    assert [s["file"] for s in m["shards"]] == [shard_name(r) for r in range(4)]
    tag_dir = os.path.join(root, "zeropp", f"global_step{N}")
    for s in m["shards"]:  # hashed while written, equal to the file's digest
        with open(os.path.join(tag_dir, s["file"]), "rb") as f:
            data = f.read()
        assert s["bytes"] == len(data) and s["sha256"] == hashlib.sha256(data).hexdigest()
        with safe_open(os.path.join(tag_dir, s["file"]), "pt") as shard:  # any safetensors reader opens it
            tree = json.loads(shard.metadata()["zeropp"])
            assert tree["nonce"] == m["nonce"] and tree["rank"] == s["rank"]
            assert shard.get_tensor(tree["params"]["embed.weight"]["__tensor__"]).dtype == torch.float32
    assert m["manifest_sha256"] == manifest_digest(m)


# ---- clear errors ----------------------------------------------------------------------------------------
def _copy(root: str, name: str) -> str:
    first(root)
    dst = os.path.join(root, "errors", name)
    shutil.copytree(os.path.join(root, "zero3"), dst)
    return dst


def test_missing_shard_names_the_file(root):
    d = _copy(root, "missing")
    os.unlink(os.path.join(d, f"global_step{N}", shard_name(2)))
    with pytest.raises(CheckpointError, match=f"shard file missing: .*{shard_name(2)}"):
        load_full_checkpoint(d)


def test_truncated_shard_names_the_file(root):
    d = _copy(root, "truncated")
    path = os.path.join(d, f"global_step{N}", shard_name(3))
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=f"truncated.*{shard_name(3)}"):
        load_full_checkpoint(d)


def test_torn_shard_of_the_recorded_size_names_the_file(root):
    resumed(root)  # builds root/corrupt: same size, so only the checksum tells
    with pytest.raises(CheckpointError, match=f"shard file corrupted: .*{shard_name(1)} has SHA-256"):
        load_full_checkpoint(os.path.join(root, "corrupt"), tag=f"global_step{N}")


def test_newer_format_version_says_so(root):
    d = _copy(root, "newer")
    path = os.path.join(d, f"global_step{N}", MANIFEST)
    with open(path) as f:
        m = json.load(f)
    m["format_version"] = FORMAT_VERSION + 1
    with open(path, "w") as f:
        json.dump(m, f)
    with pytest.raises(CheckpointError, match=f"format version {FORMAT_VERSION + 1}, newer than this zeropp reads"):
        load_full_checkpoint(d)


def test_missing_tag_or_latest_says_what_was_looked_for(root):
    d = _copy(root, "nolatest")
    with pytest.raises(CheckpointError, match=f"tag 'nope' not found: looked for directory .*nope.*global_step{N}"):
        load_full_checkpoint(d, tag="nope")
    os.unlink(os.path.join(d, "latest"))
    with pytest.warns(CheckpointWarning, match="no 'latest' file found: looked for .*latest"):
        load_full_checkpoint(d)  # the newest complete tag, with a warning
    shutil.rmtree(os.path.join(d, f"global_step{N}"))
    with pytest.raises(CheckpointError, match="no checkpoint to load: .* holds no complete tag .*no 'latest'"):
        load_full_checkpoint(d)
    assert cli.main(["consolidate", d, os.path.join(root, "x.pt")]) == 1


def test_engine_errors_name_the_cause_on_every_rank(root):
    for rank, res in enumerate(resumed(root)):
        err = res["errors"]
        assert "first mismatching parameter is up.weight with shape [12, 7] in the model" in err["mismatch"]
        assert "up.weight with shape [11, 7] in the checkpoint" in err["mismatch"]
        assert "tag 'nope' not found" in err["missing_tag"]
        # only rank 1 reads the damaged file; every rank names it (Note [one outcome for all ranks])
        assert shard_name(1) in err["one_rank_corrupt"]
        if rank == 1:
            assert "IntegrityError" in err["one_rank_corrupt"] and "shard file corrupted" in err["one_rank_corrupt"]
        else:
            assert "failed on rank(s) [1]; rank 1: " in err["one_rank_corrupt"]
            assert "checksum mismatch" in err["one_rank_corrupt"]
        assert err["unchanged"]  # a failed load leaves the engine as it was


def test_a_crash_between_the_renames_of_a_resave_still_loads(root):
    d = _copy(root, "aside")  # as left by a kill after the old tag went aside, before the new one came in
    os.rename(os.path.join(d, f"global_step{N}"), os.path.join(d, f".global_step{N}.old-0123"))
    _assert_same_state(load_full_checkpoint(d).state_dict, first(root)[0]["zero3"]["saved_state"])
