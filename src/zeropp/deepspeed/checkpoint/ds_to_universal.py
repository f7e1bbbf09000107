"""``deepspeed.checkpoint.ds_to_universal``: DeepSpeed's converter to universal checkpoints, without DeepSpeed.

    python -m zeropp.deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step3 \\
        --output_folder ckpt/global_step3_universal

With the alias installed, ``from deepspeed.checkpoint import ds_to_universal`` gives this module
(``ds_to_universal.main(ds_to_universal.parse_arguments([...]))``); ``python -m deepspeed.checkpoint.ds_to_universal``
itself does not run under the alias (runpy asks the module's loader for DeepSpeed's name, which it does not serve):
run it as ``python -m zeropp.deepspeed.checkpoint.ds_to_universal``, or ``zeropp to-universal``.

``--input_folder`` is a tag directory of a DeepSpeed ZeRO checkpoint (stage 1-3, what DeepSpeed's converter takes)
or of a zeropp checkpoint (``ckpt/global_step3`` with its ``manifest.json``; a zeropp save directory reads the tag
its ``latest`` names). The output folder gets DeepSpeed's universal layout (``zero/<param>/fp32.pt``, ...;
``universal_io.py``) and ``<parent>/latest_universal`` names it, so an engine with
``"checkpoint": {"load_universal": true}`` continues from ``engine.load_checkpoint(<parent>)``: DeepSpeed's (any
stage and world size) or zeropp's. Nothing is unpickled beyond DeepSpeed's checkpoint format (Note [reading
DeepSpeed's pickles]).

DeepSpeed's own options are accepted: ``--num_extract_workers`` and ``--num_merge_workers`` (zeropp converts in one
pass and ignores them), ``--keep_temp_folder`` (there is none), ``--no_strict`` and ``--inject_missing_state``
(zeropp needs no ``universal_checkpoint_info`` in the source: it writes the key itself).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from zeropp.checkpoint.format import CheckpointError
from zeropp.deepspeed.checkpoint.universal_io import open_source, write_ds_universal


def parse_arguments(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """DeepSpeed's command line for the converter."""
    parser = argparse.ArgumentParser(prog="ds_to_universal", description=__doc__.splitlines()[0])
    parser.add_argument("--input_folder", type=str, required=True, help="the checkpoint's tag directory")
    parser.add_argument("--output_folder", type=str, required=True, help="the universal checkpoint folder to write")
    parser.add_argument("--num_extract_workers", default=4, type=int, help="accepted; zeropp uses one pass")
    parser.add_argument("--num_merge_workers", default=2, type=int, help="accepted; zeropp uses one pass")
    parser.add_argument("--keep_temp_folder", action="store_true", help="accepted; zeropp writes no temporary slices")
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="accepted; nothing to relax")
    parser.add_argument("--inject_missing_state", action="store_true",
                        help="accepted; zeropp writes universal_checkpoint_info itself")
    parser.add_argument("--drop_unsupported", action="store_true",
                        help="zeropp: convert a zeropp checkpoint without LoCo's kept errors (with a warning)")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> str:
    """Convert ``args.input_folder`` into ``args.output_folder``; returns the folder written."""
    print(f"Converting checkpoint in {args.input_folder} to a universal checkpoint in {args.output_folder}")
    uc = open_source(args.input_folder, None, getattr(args, "drop_unsupported", False))
    out = write_ds_universal(uc, args.output_folder)
    print(f"*** Done! {len(uc.params)} parameters written to {out}")
    return out


def run(argv: Optional[list[str]] = None) -> int:
    """The command: 0 on success, 1 with the error on stderr."""
    try:
        main(parse_arguments(argv))
    except (CheckpointError, OSError, ValueError) as err:
        print(f"ds_to_universal: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
