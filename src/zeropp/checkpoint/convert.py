"""``zeropp convert-checkpoint --trust-pickle DIR``: rewrite checkpoints of format versions 1-2 (pickled shards)
as version 3 (safetensors + JSON, Note [data, not code] in ``safe_io.py``), once, for checkpoints whose origin
the user trusts.

Unpickling runs whatever the file's author put in it, so this is the one place zeropp does it, and only when
asked in so many words (``trust_pickle=True``, the command's ``--trust-pickle``). Each shard's size and
SHA-256 are still checked against its manifest first (version 2), so a file changed after its save is refused
even then. A tag is rewritten whole into a hidden temporary directory and renamed into place, as a save
publishes one (Note [checkpoint atomicity] in ``format.py``): a crash leaves the old tag as it was.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Optional

import torch

from zeropp.checkpoint.engine_state import rng_as_data
from zeropp.checkpoint.format import (
    FORMAT_VERSION, MANIFEST, CheckpointError, atomic_write, atomic_write_text, fsync_dir, list_tags,
    rename_into_place, shard_name,
)
from zeropp.checkpoint.manifest import DIGEST_KEY, read_manifest, seal
from zeropp.checkpoint.safe_io import write_tree
from zeropp.checkpoint.verify import check_files, verify_shard


def convert_checkpoint(save_dir: str, tag: Optional[str] = None, trust_pickle: bool = False) -> list[str]:
    """Convert every pickled tag of ``save_dir`` (or only ``tag``); returns the tags converted.

    Raises :class:`CheckpointError` without ``trust_pickle`` (nothing is read), and for a tag whose files do
    not match its manifest.
    """
    if not trust_pickle:
        raise CheckpointError("convert-checkpoint unpickles the checkpoint's shard files, which runs any code they "
                              "hold: pass trust_pickle=True (--trust-pickle) only for a checkpoint whose origin you "
                              "trust")
    tags = [tag] if tag is not None else list_tags(save_dir)
    if not tags:
        raise CheckpointError(f"no checkpoint tag found in {save_dir}")
    done = []
    for t in tags:
        if _convert_tag(os.path.abspath(save_dir), t):
            done.append(t)
    return done


def _convert_tag(save_dir: str, tag: str) -> bool:
    tag_dir = os.path.join(save_dir, tag)
    manifest = read_manifest(tag_dir)
    if manifest.version >= FORMAT_VERSION:
        return False
    check_files(manifest)
    nonce = manifest.nonce or secrets.token_hex(8)  # version 1 had none: the converted tag gets one
    tmp = os.path.join(save_dir, f".{tag}.tmp-{nonce}")
    os.makedirs(tmp, exist_ok=True)
    try:
        shards = []
        for rank in range(manifest.world_size):
            verify_shard(manifest, rank)
            payload = torch.load(manifest.shard_path(rank), map_location="cpu", weights_only=False)  # trusted
            payload.update(format_version=FORMAT_VERSION, nonce=nonce)
            if payload.get("rng") is not None:
                payload["rng"] = rng_as_data(payload["rng"])
            name = shard_name(rank)
            written = atomic_write(os.path.join(tmp, name), lambda f, p=payload: write_tree(f, p, "shard"))
            shards.append({"rank": rank, "file": name, "bytes": written.size, "sha256": written.sha256})
        raw = {k: v for k, v in manifest.raw.items() if k != DIGEST_KEY}
        raw.update(format_version=FORMAT_VERSION, nonce=nonce, shards=shards)
        atomic_write_text(os.path.join(tmp, MANIFEST), json.dumps(seal(raw), indent=1))
        fsync_dir(tmp)
        aside = os.path.join(save_dir, f".{tag}.old-{nonce}")
        rename_into_place(tmp, os.path.join(save_dir, tag), aside)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(save_dir)
    shutil.rmtree(aside, ignore_errors=True)
    return True
