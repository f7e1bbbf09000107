"""Verifiable checkpoints without a process group: the manifest schema and digest, shard checksums hashed
while writing, every corruption case on hand-made checkpoints (tests/support/ckpt_handmade.py), the
``latest`` fall back, version-1 reading, a full disk in the write path, ``zeropp verify-checkpoint`` and
the agreement row that lets every rank name another rank's failure."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import warnings
import zlib
from types import SimpleNamespace

import pytest
import torch

from support.ckpt_handmade import full_state, make_checkpoint, read_raw, to_version_1, write_raw
from zeropp.tools import cli
from zeropp.checkpoint import (
    CheckpointError, CheckpointWarning, IntegrityError, load_full_checkpoint, verify_checkpoint, verify_report,
)
from zeropp.checkpoint import collective, engine_io, resolve
from zeropp.checkpoint.format import (
    FAULT_ENV, LATEST, MANIFEST, Written, atomic_write, atomic_write_text, check_tag, shard_name,
)
from zeropp.checkpoint.manifest import read_manifest
from zeropp.checkpoint.resolve import Candidate


@pytest.fixture
def ckpt(tmp_path) -> str:
    """``tmp_path`` with tags ``old`` (seed 1) and ``new`` (seed 2, named by ``latest``)."""
    make_checkpoint(str(tmp_path), "old", seed=1, created=1000.0)
    make_checkpoint(str(tmp_path), "new", seed=2, created=2000.0)
    return str(tmp_path)


def _shard(d: str, tag: str, rank: int) -> str:
    return os.path.join(d, tag, shard_name(rank))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# ---- writing ---------------------------------------------------------------------------------------------
def test_checksum_is_hashed_while_writing_and_matches_the_file(tmp_path):
    path = str(tmp_path / "x.pt")
    written = atomic_write(path, lambda f: torch.save({"t": torch.arange(100_000.0)}, f))
    with open(path, "rb") as f:
        data = f.read()
    assert written.size == len(data) and written.sha256 == hashlib.sha256(data).hexdigest()


def test_a_writer_that_seeks_is_hashed_from_disk(tmp_path):
    path = str(tmp_path / "x.bin")

    def write(f):
        f.write(b"aaaa")
        f.seek(0)
        f.write(b"b")

    written = atomic_write(path, write)
    assert written.sha256 == hashlib.sha256(b"baaa").hexdigest()


def test_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = str(tmp_path / "latest")
    atomic_write_text(path, "previous")
    monkeypatch.setenv(FAULT_ENV, "latest:0")
    with pytest.raises(CheckpointError, match=f"cannot write {path}: no space left on device") as info:
        atomic_write_text(path, "next", point="latest")
    assert info.value.errno == errno.ENOSPC and info.value.file == LATEST
    assert os.listdir(tmp_path) == ["latest"]  # the temporary file is gone
    assert open(path).read() == "previous"


# ---- verification of a whole tag -------------------------------------------------------------------------
def test_valid_checkpoint_verifies_and_loads(ckpt, capsys):
    report = verify_report(ckpt)
    assert report.ok and report.tag == "new" and report.files == 2 and report.bytes > 0, report
    assert _same(load_full_checkpoint(ckpt).state_dict, full_state(2))
    assert cli.main(["verify-checkpoint", ckpt]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "tag 'new'" in out and "SHA-256" in out


def _truncate(d):
    path = _shard(d, "new", 1)
    os.truncate(path, os.path.getsize(path) - 10)
    return f"shard file truncated: .*{shard_name(1)}"


def _bitflip(d):
    _flip(_shard(d, "new", 0), 200)
    return f"shard file corrupted: .*{shard_name(0)} has SHA-256"


def _missing(d):
    os.unlink(_shard(d, "new", 1))
    return f"shard file missing: .*{shard_name(1)} \\(rank 1 of 2\\)"


def _extra(d):
    shutil.copy(_shard(d, "new", 1), os.path.join(d, "new", shard_name(2)))
    return f"unexpected shard file .*{shard_name(2)}: .*manifest.json records 2 shard file"


def _appended(d):
    with open(_shard(d, "new", 0), "ab") as f:
        f.write(b"\0")
    return f"shard file longer than recorded: .*{shard_name(0)}"


def _shard_of_another_save(d):
    shutil.copy(_shard(d, "old", 1), _shard(d, "new", 1))  # same size (same model), other bytes
    return f"shard file corrupted: .*new.*{shard_name(1)} .*copied from another checkpoint"


def _manifest_of_another_save(d):
    shutil.copy(os.path.join(d, "old", MANIFEST), os.path.join(d, "new", MANIFEST))
    return f"shard file corrupted: .*new.*{shard_name(0)}"


def _manifest_edited_sensibly(d):
    raw = read_raw(os.path.join(d, "new"))
    raw["engine"]["global_steps"] = 7  # valid JSON, valid schema: only the digest can tell
    write_raw(os.path.join(d, "new"), raw)
    return "manifest.json was altered after the save"


def _manifest_not_json(d):
    with open(os.path.join(d, "new", MANIFEST), "a") as f:
        f.write("}")
    return "cannot read checkpoint manifest .*manifest.json"


def _resealed_shard_swap(d):
    """A forger who also fixes the manifest's digest is still caught: the shard carries the save's nonce."""
    tag_dir = os.path.join(d, "new")
    shutil.copy(_shard(d, "old", 1), _shard(d, "new", 1))
    raw, old = read_raw(tag_dir), read_raw(os.path.join(d, "old"))
    raw["shards"][1] = old["shards"][1]
    write_raw(tag_dir, raw, reseal=True)
    return f"{shard_name(1)} was written by another save"


CORRUPTIONS = [_truncate, _bitflip, _missing, _extra, _appended, _shard_of_another_save, _manifest_of_another_save,
               _manifest_edited_sensibly, _manifest_not_json]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_each_corruption_is_detected_naming_the_file(ckpt, corrupt):
    pattern = corrupt(ckpt)
    with pytest.raises(IntegrityError, match=pattern):
        load_full_checkpoint(ckpt, tag="new")  # an explicit tag never falls back
    problems = verify_checkpoint(ckpt, "new")
    assert problems and any(re.search(pattern, p) for p in problems), problems
    assert verify_checkpoint(ckpt, "old") == []  # and the other tag is untouched


def test_a_resealed_manifest_with_a_foreign_shard_fails_on_load(ckpt):
    pattern = _resealed_shard_swap(ckpt)
    assert verify_checkpoint(ckpt, "new") == []  # bytes and digests agree: only unpickling can tell
    with pytest.raises(IntegrityError, match=pattern):
        load_full_checkpoint(ckpt, tag="new")


# ---- the manifest's schema -------------------------------------------------------------------------------
def _set(path: str, value):
    def edit(raw):
        *parents, last = path.split(".")
        obj = raw
        for key in parents:
            obj = obj[int(key)] if isinstance(obj, list) else obj[key]
        if value is KeyError:
            del obj[last]
        else:
            obj[int(last) if isinstance(obj, list) else last] = value
    return edit


NONSENSE = [
    ("shards.0.bytes", -5, "shards[0].bytes' must be an integer >= 0"),
    ("shards.1.bytes", "12", "shards[1].bytes' must be an integer"),
    ("shards.0.sha256", "xyz", "shards[0].sha256' must be a matching string"),
    ("shards.1.file", "../../etc/passwd", "shards[1].file' must be 'shard_rank00001.safetensors'"),
    ("shards.1.rank", 0, "shards[1].rank' must be 1"),
    ("shards", [], "shards' has 0 entries, but topology.world_size is 2"),
    ("topology.world_size", 3, "shards' has 2 entries, but topology.world_size is 3"),
    ("topology.world_size", True, "topology.world_size' must be an integer"),
    ("topology", KeyError, "key 'topology' is missing"),
    ("params", {"w": 1}, "key 'params' must be a list"),
    ("params.0.shape", [5.5], "params[0].shape' must be a list of integers"),
    ("params.0.numel", 6, "params[0].numel' is 6, but shape [5] holds 5"),
    ("params.0.chunk", 2, "params[0].chunk' is 2: 2 chunks cannot hold the 5 elements"),
    ("params.0.chunk", 10**12, "key 'params' chunks need"),
    ("params.1.name", "w", "params[1].name' must be a new"),
    ("params.1.optimizer_index", 0, "params[1].optimizer_index' 0 is used"),
    ("params.0.world", 4, "params[0].world' is 4"),
    ("params.0.aliases", KeyError, "params[0].aliases' is missing"),
    ("state_dict_keys.0.param", "nope", "state_dict_keys[0].param' names no recorded parameter"),
    ("engine.gradient_accumulation_steps", 0, "engine.gradient_accumulation_steps' must be an integer >= 1"),
    ("created_unix", "yesterday", "created_unix' must be a finite number"),
    ("nonce", KeyError, "key 'nonce' is missing"),
    ("manifest_sha256", 5, "manifest_sha256' must be a matching string"),
    ("format_version", 0, "format_version' must be an integer >= 1"),
    ("format_version", 1, "'manifest_sha256' belongs to format version 2"),  # a downgrade cannot skip the checks
]


@pytest.mark.parametrize("path,value,message", NONSENSE, ids=[f"{p}={v!r}"[:40] for p, v, _ in NONSENSE])
def test_nonsense_manifest_names_the_file_and_key(ckpt, path, value, message):
    tag_dir = os.path.join(ckpt, "new")
    raw = read_raw(tag_dir)
    _set(path, value)(raw)
    write_raw(tag_dir, raw)
    with pytest.raises(IntegrityError) as info:
        load_full_checkpoint(ckpt, tag="new")
    text = str(info.value)
    assert "manifest.json" in text and message in text, text
    assert any(message in p for p in verify_checkpoint(ckpt))


def test_newer_format_is_not_a_corruption_and_never_falls_back(ckpt):
    tag_dir = os.path.join(ckpt, "new")
    raw = read_raw(tag_dir)
    raw["format_version"] = 99
    write_raw(tag_dir, raw)
    with pytest.raises(CheckpointError, match="format version 99, newer than this zeropp reads") as info:
        load_full_checkpoint(ckpt)  # tag=None: the older tag is not a substitute for an upgrade
    assert not isinstance(info.value, IntegrityError)


# ---- latest and the fall back ----------------------------------------------------------------------------
def test_latest_on_a_damaged_tag_falls_back_with_a_warning(ckpt):
    _flip(_shard(ckpt, "new", 1), 300)
    with pytest.warns(CheckpointWarning, match=f"fell back to tag 'old': skipped 'new': shard file corrupted: "
                                               f".*{shard_name(1)}"):
        full = load_full_checkpoint(ckpt)
    assert _same(full.state_dict, full_state(1))
    assert any("shard file corrupted" in p for p in verify_checkpoint(ckpt))


def test_latest_on_a_missing_tag_falls_back(ckpt):
    shutil.rmtree(os.path.join(ckpt, "new"))
    with pytest.warns(CheckpointWarning, match="'latest' names 'new', which is not there"):
        assert _same(load_full_checkpoint(ckpt).state_dict, full_state(1))
    assert any("'latest' names tag 'new', which is not there" in p for p in verify_checkpoint(ckpt))
    with pytest.raises(CheckpointError, match="tag 'new' not found"):
        load_full_checkpoint(ckpt, tag="new")


def test_without_latest_the_newest_complete_tag_loads(ckpt):
    os.unlink(os.path.join(ckpt, LATEST))
    make_checkpoint(ckpt, "newer_but_named_first", seed=3, latest=False, created=500.0)  # saved earliest
    with pytest.warns(CheckpointWarning, match="no 'latest' file found: looked for .*latest"):
        assert _same(load_full_checkpoint(ckpt).state_dict, full_state(2))  # by save time, not by name
    assert any("no 'latest' file found" in p for p in verify_checkpoint(ckpt))
    assert verify_checkpoint(ckpt, "old") == []  # an explicit tag does not need `latest`


def test_every_tag_damaged_lists_each_reason(ckpt):
    _flip(_shard(ckpt, "new", 0), 300)
    os.truncate(_shard(ckpt, "old", 1), 10)
    with pytest.raises(IntegrityError, match="no loadable checkpoint .*skipped 'new': shard file corrupted.*"
                                             "skipped 'old': shard file truncated"):
        load_full_checkpoint(ckpt)


def test_nothing_to_load_says_where_it_looked(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint to load: .* holds no complete tag .*no 'latest'"):
        load_full_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="directory .*nowhere does not exist"):
        load_full_checkpoint(str(tmp_path / "nowhere"))
    assert verify_checkpoint(str(tmp_path / "nowhere")) == [f"checkpoint directory not found: {tmp_path}/nowhere"]


def test_torn_save_leftovers_are_notes_not_problems(ckpt):
    os.makedirs(os.path.join(ckpt, ".next.tmp-0123"))
    report = verify_report(ckpt)
    assert report.ok and any(".next.tmp-0123" in n for n in report.notes)


# ---- version 1 -------------------------------------------------------------------------------------------
def test_version_1_loads_with_a_warning_that_it_cannot_be_verified(ckpt, capsys):
    shutil.rmtree(os.path.join(ckpt, "new"))
    make_checkpoint(ckpt, "new", seed=2, created=2000.0, version=2)  # pickled shards, as versions 1 and 2 wrote
    to_version_1(os.path.join(ckpt, "new"))
    with pytest.warns(CheckpointWarning, match="format version 1: .*no checksums"):
        assert _same(load_full_checkpoint(ckpt).state_dict, full_state(2))
    report = verify_report(ckpt)
    assert report.ok and report.version == 1 and any("no checksums" in n for n in report.notes)
    assert cli.main(["verify-checkpoint", ckpt]) == 0
    assert "format version 1 has no checksums" in capsys.readouterr().out
    os.truncate(os.path.join(ckpt, "new", shard_name(0, 1)), 100)  # sizes are still checked
    with pytest.raises(IntegrityError, match="truncated"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        load_full_checkpoint(ckpt, tag="new")


# ---- the command line ------------------------------------------------------------------------------------
def test_verify_checkpoint_cli_prints_one_line_per_problem(ckpt, capsys):
    _missing(ckpt)
    _bitflip(ckpt)
    assert cli.main(["verify-checkpoint", ckpt, "--tag", "new"]) == 1
    lines = capsys.readouterr().out.splitlines()
    problems = [line for line in lines if line.startswith("problem: ")]
    assert len(problems) == 2 and shard_name(1) in problems[0] and shard_name(0) in problems[1], lines
    assert lines[-1].startswith("INVALID: ") and "2 problem(s)" in lines[-1]
    assert cli.main(["verify-checkpoint", ckpt, "--tag", "old"]) == 0
    with pytest.raises(SystemExit) as info:
        cli.main(["verify-checkpoint"])
    assert info.value.code == 2


# ---- the agreement row: another rank's failure, named ----------------------------------------------------
class _FakeComm:
    """An all-reduce over two ranks in one process: adds what the other rank contributes."""

    def __init__(self, rank: int, other_row: list[int]) -> None:
        self.rank, self.other_row = rank, other_row

    def all_reduce(self, table, group, phase):
        table[1 - self.rank] += torch.tensor(self.other_row, dtype=torch.int64)


def _engine(rank: int, other_row: list[int]) -> SimpleNamespace:
    topo = SimpleNamespace(world_size=2, rank=rank, world=None)
    return SimpleNamespace(state=SimpleNamespace(topo=topo, comm=_FakeComm(rank, other_row)))


def test_a_rank_that_did_not_fail_names_the_other_ranks_file_and_problem():
    err = CheckpointError("x", file=shard_name(1), problem="write failed", errno=errno.ENOSPC)
    row = collective._row(err) + collective.written_row(None)
    engine = _engine(0, row)
    with pytest.raises(CheckpointError, match=r"failed on rank\(s\) \[1\]; rank 1: /tmp/t/shard_rank00001.safetensors: "
                                              "no space left on device") as info:
        collective.agree(engine, None, "writing", lambda n: f"/tmp/t/{n}", collective.written_row(None))
    assert not isinstance(info.value, IntegrityError)
    bad = IntegrityError("y", file=MANIFEST, problem="checksum mismatch")
    failure, _ = collective.agree_outcome(_engine(0, collective._row(bad)), None, "loading", lambda n: n)
    assert failure.integrity and isinstance(failure.error, IntegrityError)
    assert "rank 1: manifest.json: checksum mismatch" in str(failure.error)


def test_shard_digest_travels_in_the_row_exactly():
    written = Written(123, hashlib.sha256(b"z").hexdigest())
    assert collective.written_of(collective.written_row(written)) == written
    assert json.dumps(collective.written_row(written))  # plain ints, any sign


def test_a_failing_rank_raises_a_checkpoint_error_whatever_it_caught():
    """The rank that failed raised its own exception unchanged (a KeyError, an OSError); now every rank
    raises a CheckpointError, the failing one chained from what it caught."""
    ok = collective._row(None)
    cause = KeyError("counters")
    with pytest.raises(CheckpointError, match="loading failed on rank 0: KeyError: 'counters'") as info:
        collective.agree(_engine(0, ok), cause, "loading")
    assert info.value.__cause__ is cause and not isinstance(info.value, IntegrityError)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(CheckpointError, match="publishing failed on rank 1: OSError: .*No space left") as info:
        collective.agree(_engine(1, ok), full, "publishing")
    assert info.value.errno == errno.ENOSPC
    damaged = IntegrityError("z", file=shard_name(0), problem="truncated")
    with pytest.raises(IntegrityError) as info:  # checkpoint errors keep their class, file and problem
        collective.agree(_engine(0, ok), damaged, "loading")
    assert info.value is damaged


def test_a_bad_tag_name_is_a_checkpoint_error(ckpt):
    for bad in ("", ".hidden", "a/b", "../new"):
        with pytest.raises(CheckpointError, match="must be a plain, non-hidden directory name"):
            check_tag(bad)
    with pytest.raises(CheckpointError, match="'../new' must be a plain"):
        load_full_checkpoint(ckpt, tag="../new")
    assert any("must be a plain" in p for p in verify_checkpoint(ckpt, ".new"))


def test_agreement_on_a_candidate_never_lets_one_rank_skip_alone():
    """Rank 0 saw damage, rank 1 a problem a fall back must not hide: rank 0 must raise too (a plain
    CheckpointError), not go on alone to the next tag and wait there for rank 1."""
    cand = Candidate("new", "/ckpt/new")
    crc = zlib.crc32(b"new")
    misfit = collective._row(CheckpointError("model does not match")) + [crc]
    settle = collective._outcome_on_every_rank(_engine(0, misfit), "loading")
    got = settle(IntegrityError("torn", file=shard_name(0), problem="truncated"), cand)
    assert isinstance(got, CheckpointError) and not isinstance(got, IntegrityError) and "torn" in str(got)
    with pytest.raises(CheckpointError, match="torn"):
        resolve.read_first_good(resolve.Candidates("/ckpt", latest=cand), lambda d: 1 / 0, lambda e, c: got)
    elsewhere = collective._row(None) + [zlib.crc32(b"old")]  # the ranks' fall back orders differ
    with pytest.raises(CheckpointError, match="the ranks tried different tags"):
        collective._outcome_on_every_rank(_engine(0, elsewhere), "loading")(None, cand)


# ---- work a load does not need ---------------------------------------------------------------------------
def test_other_tags_are_sorted_only_when_falling_back(ckpt, monkeypatch):
    make_checkpoint(ckpt, "third", seed=3, latest=False, created=3000.0)
    make_checkpoint(ckpt, "new", seed=2, created=2000.0)  # `latest` back on `new`
    parsed: list[str] = []
    real = resolve._created
    monkeypatch.setattr(resolve, "_created", lambda d: parsed.append(os.path.basename(d)) or real(d))
    assert _same(load_full_checkpoint(ckpt).state_dict, full_state(2))
    assert parsed == []  # `latest` was fine: no other manifest read to sort the others
    _flip(_shard(ckpt, "new", 1), 300)
    with pytest.warns(CheckpointWarning, match="fell back to tag 'third'"):  # newest save first
        assert _same(load_full_checkpoint(ckpt).state_dict, full_state(3))
    assert sorted(parsed) == ["old", "third"]


def test_manifest_entries_are_parsed_once(ckpt):
    m = read_manifest(os.path.join(ckpt, "new"))
    assert m.params is m.params and m.shards is m.shards
    assert [s.file for s in m.shards] == [shard_name(0), shard_name(1)]
    assert m.shard_path(1) == os.path.join(ckpt, "new", shard_name(1))


def test_leftover_notes_say_which_ones_a_load_reads(ckpt):
    os.makedirs(os.path.join(ckpt, ".new.old-00ab"))
    os.makedirs(os.path.join(ckpt, ".new.tmp-00cd"))
    notes = verify_report(ckpt).notes
    assert any(".new.tmp-00cd" in n and "ignored by loads" in n for n in notes), notes
    assert any(".new.old-00ab" in n and "a load of tag 'new' reads it while" in n for n in notes), notes
    assert not any(".old-" in n and "ignored by loads" in n for n in notes), notes


# ---- publishing: a failed directory rename --------------------------------------------------------------
def test_a_failed_rename_of_a_resave_puts_the_old_tag_back(tmp_path, monkeypatch):
    """The second rename of a re-save fails after the old tag went aside: the old tag is renamed back
    (``tag=None`` loads never list an aside copy) and the temporary directory is removed."""
    save_dir = str(tmp_path)
    make_checkpoint(save_dir, "t", seed=1)
    tmp_dir = os.path.join(save_dir, ".t.tmp-00ff")
    make_checkpoint(tmp_dir, "x", seed=2, latest=False)  # some content for the new tag
    monkeypatch.setattr(engine_io, "_manifest", lambda *args: {"tag": "t"})
    real = os.rename

    def rename(src, dst):
        if src == tmp_dir:
            raise OSError(errno.EIO, os.strerror(errno.EIO), src)
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        engine_io._publish(None, "t", [], [], tmp_dir, os.path.join(save_dir, "t"), "00ff", True)
    assert sorted(os.listdir(save_dir)) == ["latest", "t"]  # no aside copy, no temporary directory
    assert _same(load_full_checkpoint(save_dir).state_dict, full_state(1))
