"""Checkpoints: sharded save/load with exact and elastic resume, and consolidation to one file.

    engine.save_checkpoint("ckpt")                       # every rank; tag defaults to global_step{N}
    path, client_state = engine.load_checkpoint("ckpt")  # same or different world size
    zeropp.checkpoint.consolidate("ckpt", "model.safetensors")   # no torch.distributed needed

The format and its crash safety are described in ``format.py`` (Notes [checkpoint atomicity] and [checkpoint
verification]); ``verify_checkpoint(dir)`` (``zeropp verify-checkpoint``) checks a tag without a process
group; what a shard holds and how it re-shards in ``engine_io.py``: functions over an engine, which the engine's
methods call (``zeropp.zero`` never imports this package). Universal checkpoints (whole per-parameter values and
optimizer states, no layout: ``to_universal``, ``load_universal_dir``) in ``universal.py`` and
``universal_format.py``; see also docs/checkpoints.md.
"""
from zeropp.checkpoint.consolidate import (
    FullCheckpoint, consolidate, load_full_checkpoint, write_state_dict,
)
from zeropp.checkpoint.engine_io import in_compute_dtype, load_checkpoint, save_16bit_model, save_checkpoint
from zeropp.checkpoint.format import FORMAT_VERSION, CheckpointError, CheckpointWarning, IntegrityError, list_tags
from zeropp.checkpoint.universal import Universal, load_universal
from zeropp.checkpoint.universal_format import load_universal_dir, read_universal, to_universal, write_universal
from zeropp.checkpoint.verify import VerifyReport, verify_checkpoint, verify_report

__all__ = [
    "save_checkpoint", "load_checkpoint", "save_16bit_model", "in_compute_dtype", "consolidate", "load_full_checkpoint",
    "write_state_dict", "FullCheckpoint", "CheckpointError",
    "IntegrityError", "CheckpointWarning", "FORMAT_VERSION", "list_tags",
    "verify_checkpoint", "verify_report", "VerifyReport",
    "Universal", "load_universal", "load_universal_dir", "read_universal", "to_universal", "write_universal",
]
