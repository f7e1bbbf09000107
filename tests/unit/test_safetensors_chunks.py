"""A rank's chunk read straight from safetensors files equals the chunk cut from the whole tensor."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from zeropp.partition.safetensors_chunks import CheckpointFormatError, SafetensorsChunks
from zeropp.partition.spec import ShardSpec, take_chunk

TENSORS = {
    "w": torch.randn(7, 5, generator=torch.Generator().manual_seed(0)),
    "b": torch.arange(3, dtype=torch.bfloat16),
    "i": torch.arange(11, dtype=torch.int64).reshape(11, 1),
    "one": torch.tensor([2.5]),
}


def test_chunks_equal_the_chunks_of_the_whole_tensor(tmp_path):
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsChunks(tmp_path)
    assert set(ckpt.keys()) == set(TENSORS)
    for name, full in TENSORS.items():
        assert torch.equal(ckpt.read(name), full)
        for world in (1, 3, 4):
            spec = ShardSpec(full.numel(), full.shape, world)
            for rank in range(world):
                got = ckpt.read_chunk(name, spec, rank)
                assert got.dtype == full.dtype and torch.equal(got, take_chunk(full, spec, rank, world)), (name, rank)


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    save_file({"w": TENSORS["w"]}, str(tmp_path / "a.safetensors"))
    save_file({"b": TENSORS["b"]}, str(tmp_path / "b.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "a.safetensors", "b": "b.safetensors"}}))
    ckpt = SafetensorsChunks(tmp_path)
    assert torch.equal(ckpt.read("b"), TENSORS["b"]) and torch.equal(ckpt.read("w"), TENSORS["w"])


def test_bad_files_are_errors_that_name_them(tmp_path):
    with pytest.raises(CheckpointFormatError, match="no model.safetensors"):
        SafetensorsChunks(tmp_path)
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path))
    with pytest.raises(CheckpointFormatError, match="shape"):
        SafetensorsChunks(tmp_path).read_chunk("w", ShardSpec(36, torch.Size([6, 6]), 2), 0)
    entries = SafetensorsChunks(tmp_path).entries
    last = max(entries, key=lambda n: entries[n].offset)  # the tensor whose data ends the file
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    with pytest.raises(CheckpointFormatError, match="truncated"):
        SafetensorsChunks(tmp_path).read(last)
    path.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(CheckpointFormatError, match=str(path.name)):
        SafetensorsChunks(path)
