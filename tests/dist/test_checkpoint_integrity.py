"""Verifiable checkpoints through real engines (issue 19, point 3) and the checkpoint fuzz (point 4).

Two worlds start once for the module: ``verify_world`` on 2 ranks (the resume idiom, a full disk at each
write of a save, every corruption case, the ``latest`` fall back, version 1, fuzz mutations through the
engine) and then ``reshard_world`` on 3 ranks, which loads the 2-rank checkpoints; what runs on the ranks
is in tests/support/ckpt_verify_worlds.py. The fuzz itself runs here, in one process, on the checkpoint the
first world saved: ``load_full_checkpoint`` and ``verify_checkpoint`` need no process group, so hundreds
of mutated checkpoints cost no process starts.
"""
from __future__ import annotations

import collections
import functools
import os
import random
import re
import shutil
import signal
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from support.ckpt_fuzz import ALWAYS_INVALID, FORGED, plan, mutate
from support.ckpt_verify_worlds import CORRUPTIONS, FAULTS, FUZZ_SEED, reshard_world, verify_world
from support.world import run_world
from zeropp.checkpoint import CheckpointError, CheckpointWarning, load_full_checkpoint, verify_checkpoint
from zeropp.checkpoint.format import LATEST, MANIFEST, shard_name

FUZZ_CASES = 264  # 24 of each of the 11 kinds
NAMES_A_FILE = re.compile(r"manifest\.json|shard_rank\d{5}\.(pt|safetensors)|latest|checkpoint directory|tag '")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("verify"))


@functools.lru_cache(maxsize=None)
def worlds(root: str) -> dict[str, Future]:
    """The 2-rank world, then the 3-rank one that loads what it saved (running while the fuzz does)."""
    pool = ThreadPoolExecutor(max_workers=2)
    first = pool.submit(run_world, verify_world, 2, root)

    def then_reshard() -> list:
        first.result()
        return run_world(reshard_world, 3, root)

    out = {"verify": first, "reshard": pool.submit(then_reshard)}
    pool.shutdown(wait=False)
    return out


def verified(root: str) -> list[dict]:
    return worlds(root)["verify"].result()


def resharded(root: str) -> list[dict]:
    return worlds(root)["reshard"].result()


# ---- the resume idiom ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,reason", [("missing", "does not exist"), ("empty", "holds no complete tag")])
def test_resume_on_nothing_returns_none_with_one_warning(root, case, reason):
    for rank, res in enumerate(verified(root)):
        got = res["fresh"][case]
        assert got["error"] is None and got["result"] == (None, None), (rank, got)
        assert len(got["warnings"]) == 1 and reason in got["warnings"][0], (rank, got["warnings"])
        assert "returns (None, None)" in got["warnings"][0]


# ---- a full disk -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("point", FAULTS)
def test_full_disk_fails_the_save_on_every_rank_and_keeps_latest(root, point):
    what, _, fault_rank = point.partition(":")
    name = {"shard": shard_name(int(fault_rank)), "manifest": MANIFEST, "latest": LATEST}[what]
    for rank, res in enumerate(verified(root)):
        got = res["enospc"][point]
        assert got["error"] is not None and got["error"].startswith("CheckpointError: "), (rank, got)
        assert "no space left on device" in got["error"] and name in got["error"], (rank, got["error"])
        assert got["latest"] == "good"  # `latest` never moved
        # no temporary directory is left; only a failed `latest` leaves the (complete) new tag beside it
        assert got["listing"] == (["good", "latest", "next"] if what == "latest" else ["good", "latest"])


def test_a_failed_rename_of_a_resave_fails_everywhere_and_keeps_the_old_tag(root):
    """The new tag's rename fails after the old one went aside: every rank raises a CheckpointError (rank 0
    its OSError, wrapped), the old tag is back under its name and nothing else is left (the load below
    still reads it through `latest`)."""
    for rank, res in enumerate(verified(root)):
        got = res["enospc"]["rename"]
        err = got["error"]
        assert err is not None and err.startswith("CheckpointError: publishing the checkpoint failed on rank"), err
        assert "no space left on device" in err.lower(), (rank, err)
        assert ("OSError" in err) == (rank == 0), (rank, err)  # the rank that failed names the exception
        assert got["listing"] == ["good", "latest"], got["listing"]


def test_a_16bit_export_that_cannot_make_its_directory_fails_on_every_rank(root):
    for rank, res in enumerate(verified(root)):
        err = res["export_blocked"]["error"]
        assert err is not None and err.startswith("CheckpointError: saving the 16-bit model failed on rank"), err
        assert "not a directory" in err.lower(), (rank, err)


def test_after_a_failed_save_latest_still_loads(root):
    for res in verified(root):
        got = res["enospc"]["load_after"]
        assert got["error"] is None and got["result"][0].endswith(os.sep + "good")
        assert got["same_as_good"] and got["warnings"] == []


# ---- every corruption, through the engine ----------------------------------------------------------------
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_each_corruption_fails_on_every_rank_naming_the_file(root, case):
    _, name, problem = CORRUPTIONS[case]
    for rank, res in enumerate(verified(root)):
        got = res["corruptions"][case]
        err = got["error"]
        assert err is not None and err.startswith("IntegrityError: "), (rank, err)
        assert name in err and re.search(problem, err), (rank, err)
        assert got["unchanged"], rank  # a failed load leaves the engine as it was


def test_a_file_only_one_rank_reads_is_named_by_every_rank(root):
    own, other = (res["corruptions"]["bitflip_rank1"]["error"] for res in verified(root)[::-1])
    assert "shard file corrupted" in own  # rank 1 hashed its file
    assert "failed on rank(s) [1]; rank 1: " in other and f"{shard_name(1)}: checksum mismatch" in other


# ---- latest and the fall back ----------------------------------------------------------------------------
def test_damaged_latest_falls_back_to_the_previous_tag_on_every_rank(root):
    for rank, res in enumerate(verified(root)):
        got = res["fallback"]["corrupt_latest"]
        assert got["error"] is None and got["result"][0].endswith(os.sep + "s1"), (rank, got)
        assert got["same_as_s1"] and not got["same_as_s2"]
        assert got["result"][1] == {"tag": "s1"}  # its client state too
        [warning] = got["warnings"]
        assert "fell back to tag 's1'" in warning and "skipped 's2'" in warning and shard_name(1) in warning
        assert shard_name(1) in got["explicit"]  # asked for by name, the damaged tag is an error


def test_latest_naming_a_deleted_tag_falls_back(root):
    for res in verified(root):
        got = res["fallback"]["deleted_latest"]
        assert got["error"] is None and got["same_as_s1"]
        assert any("'latest' names 's2', which is not there" in w for w in got["warnings"])
        assert "tag 's2' not found" in got["explicit"]


def test_no_valid_tag_is_an_error_naming_each(root):
    for res in verified(root):
        got = res["fallback"]["all_damaged"]
        assert got["error"].startswith("IntegrityError: no loadable checkpoint"), got["error"]
        assert "skipped 's2'" in got["error"] and "skipped 's1'" in got["error"]
        assert got["unchanged"]


def test_an_older_pickled_tag_is_refused_until_converted(root):
    for res in verified(root):
        got = res["fallback"]["version_1"]  # NumPy's RNG state: weights_only refuses it; no fall back either
        for error in (got["error"], got["explicit"]):
            assert "convert-checkpoint --trust-pickle" in error and re.search(r"shard_rank\d{5}\.pt", error), error
        assert got["unchanged"]
        converted = res["fallback"]["version_1_converted"]
        assert converted["error"] is None and converted["same_as_s2"] and converted["explicit"] is None


# ---- checkpoints that do not fit, and what a load stats --------------------------------------------------
def _assert_misfits(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        groups, buffer = res["misfits"]["groups"], res["misfits"]["buffer"]
        assert groups["error"] and groups["error"].startswith("CheckpointError: "), (rank, groups["error"])
        assert "optimizer parameter groups differ" in groups["error"] and "1 group(s) of [8]" in groups["error"], \
            groups["error"]
        assert "the engine's optimizer 2 of [2, 6]" in groups["error"] and groups["unchanged"], rank
        assert buffer["error"] and buffer["error"].startswith("CheckpointError: "), (rank, buffer["error"])
        assert "buffer counts in shard file" in buffer["error"] and "shape [5]" in buffer["error"], buffer["error"]
        assert buffer["unchanged"], rank
        assert res["misfits"]["groups_weights_only"]["error"] is None  # the grouping matters to the optimizer only


def test_other_parameter_groups_or_buffer_shapes_fail_before_the_engine_changes(root):
    """Checked inside the agreed read, on the same world size and when re-sharding: before, the parameter
    groups failed in ``optimizer.load_state_dict`` after the masters were loaded, and a re-sharded load
    copied buffers without checking their shapes."""
    _assert_misfits(verified(root))
    _assert_misfits(resharded(root))


def test_a_load_stats_only_the_files_each_rank_needs(root):
    """Rank 0 checks the listing and every size once; another rank stats only the file it opens, so a
    world of W ranks makes O(W) stats, not W² (a round trip each on a shared file system)."""
    stats = [res["stats"] for res in verified(root)]
    assert set(stats[0]) == {shard_name(0), shard_name(1)}, stats
    assert set(stats[1]) == {shard_name(1)} and len(stats[1]) <= 2, stats


# ---- re-sharding -----------------------------------------------------------------------------------------
def test_resharding_verifies_what_it_reads(root):
    for rank, res in enumerate(resharded(root)):
        assert res["resharded"]["error"] is None and res["resharded"]["same_as_s2"], rank
        fell = res["fallback"]
        assert fell["error"] is None and fell["same_as_s1"] and "skipped 's2'" in fell["warnings"][0]
    errors = [res["corrupt"]["error"] for res in resharded(root)]
    assert all(e and shard_name(1) in e for e in errors), errors
    # new rank 0's chunk lies inside old rank 0's: it does not read the damaged file, and still names it
    assert "failed on rank(s) [1, 2]" in errors[0] and "checksum mismatch" in errors[0]
    assert all("shard file corrupted" in e for e in errors[1:])


def test_mid_accumulation_checkpoint_cannot_be_resharded(root):
    for rank, res in enumerate(resharded(root)):
        got = res["midacc"]
        err = got["error"]
        assert err and err.startswith("CheckpointError: ") and MANIFEST in err, (rank, err)
        assert "only resume on the same world size" in err and got["unchanged"]


# ---- fuzz ------------------------------------------------------------------------------------------------
def test_engine_rejects_fuzzed_checkpoints_on_every_rank(root):
    per_case = zip(*(res["fuzz"] for res in verified(root)))
    counts = collections.Counter()
    for ranks in per_case:
        kind = ranks[0]["kind"]
        if all(r["error"] for r in ranks):
            assert all(r["error"].split(":")[0] in ("CheckpointError", "IntegrityError") for r in ranks), ranks
            assert all(NAMES_A_FILE.search(r["error"]) and r["unchanged"] for r in ranks), ranks
            counts["rejected"] += 1
        else:
            assert kind not in ALWAYS_INVALID, ranks
            assert all(r["loaded_same"] for r in ranks), ranks  # loaded, and to exactly the saved weights
            counts["loaded"] += 1
    print(f"engine fuzz (2 ranks): {sum(counts.values())} cases, {counts['rejected']} rejected on every rank, "
          f"{counts['loaded']} loaded the saved weights, 0 other outcomes")
    assert counts["rejected"] >= len(ALWAYS_INVALID)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang("no answer in 20 s")


def _fuzz_load(d: str, tag, want: dict) -> str:
    """One load of a mutated checkpoint: ``rejected``, ``loaded`` or what else happened."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            full = load_full_checkpoint(d, tag=tag)
    except CheckpointError as err:
        return "rejected" if NAMES_A_FILE.search(str(err)) else f"error naming no file: {err}"
    except BaseException as err:  # noqa: BLE001 - every other outcome is what the fuzz looks for
        return f"{type(err).__name__}: {err}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    loaded = os.path.basename(os.path.dirname(full.manifest.path))
    if loaded != "s2" and not any(issubclass(w.category, CheckpointWarning) for w in caught):
        return f"fell back to {loaded} without a warning"
    same = set(full.state_dict) == set(want[loaded]) and all(
        torch.equal(full.state_dict[k], want[loaded][k]) for k in want[loaded])
    return "loaded" if same else f"loaded different weights from {loaded}"


def test_fuzz_mutated_checkpoints(root, tmp_path):
    """Every mutated checkpoint is loaded by tag and through ``latest``: each load raises CheckpointError
    naming a file or key, or gives exactly the weights of the tag it loaded (never another exception,
    never a hang); ``verify_checkpoint`` flags exactly the tags the loader rejects."""
    verified(root)
    run = os.path.join(root, "run")
    want = {tag: load_full_checkpoint(run, tag=tag).state_dict for tag in ("s1", "s2")}
    counts, others = collections.Counter(), []
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for i, (kind, seed) in enumerate(plan(FUZZ_CASES, FUZZ_SEED)):
        d = str(tmp_path / str(i))
        shutil.copytree(run, d)
        what = mutate(d, "s2", "s1", kind, random.Random(seed))
        for tag in ("s2", None):
            verdict = _fuzz_load(d, tag, want)
            if kind in FORGED and verdict.startswith("loaded different weights"):
                counts["forged_lies"] += 1  # a consistent forged manifest: a lie no reader can see through
                verdict = "loaded"
            counts[verdict if verdict in ("rejected", "loaded") else "other"] += 1
            by_kind[kind][verdict if verdict in ("rejected", "loaded") else "other"] += 1
            if verdict not in ("rejected", "loaded"):
                others.append(f"case {i} {kind} ({what}), tag={tag}: {verdict}")
            if tag == "s2" and kind not in FORGED and kind != "damage_latest":
                flagged = bool(verify_checkpoint(d, "s2"))
                if flagged != (verdict == "rejected"):
                    others.append(f"case {i} {kind} ({what}): verify_checkpoint says {flagged}, load {verdict}")
            if kind in ALWAYS_INVALID and tag == "s2" and verdict != "rejected":
                others.append(f"case {i} {kind} ({what}): not rejected")
        shutil.rmtree(d)
    tried = counts["rejected"] + counts["loaded"] + counts["other"]
    print(f"\ncheckpoint fuzz (seed {FUZZ_SEED}): {FUZZ_CASES} mutated checkpoints, {tried} loads: "
          f"{counts['rejected']} rejected with CheckpointError, {counts['loaded']} loaded the right weights, "
          f"{counts['other']} other outcomes ({counts['forged_lies']} of the loads are forged manifests, re-sealed "
          "after the edit, that load what they describe)")
    for kind, c in sorted(by_kind.items()):
        print(f"  {kind:15s} rejected {c['rejected']:3d}  loaded {c['loaded']:3d}  other {c['other']}")
    assert FUZZ_CASES >= 200 and not others, "\n".join(others[:20])
    assert counts["rejected"] >= FUZZ_CASES // 2  # the mutations do bite
