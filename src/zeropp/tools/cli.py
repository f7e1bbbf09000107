"""``zeropp`` command line: ``zeropp train`` launches the demo job on local processes."""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Callable, Optional


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _train_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "train",
        help="train the demo GPT on the shipped corpus on local processes",
        description="Train the shipped GPT on the shipped Shakespeare corpus with ZeRO-3 (+ ZeRO++ by default) on "
        "local gloo processes started by torch's elastic launcher. One host plays several nodes: "
        "--ranks-per-node sets how many ranks form one simulated node. Ends with the bytes moved per step, "
        "by phase and link, next to what plain ZeRO-3 would move.",
    )
    p.add_argument("--nproc", type=_positive, default=4, help="number of ranks to start (default: 4)")
    p.add_argument("--ranks-per-node", type=_positive, default=None,
                   help="ranks per simulated node; must divide --nproc (default: the config's "
                   "topology.ranks_per_node; the built-in config has 2, i.e. 2 nodes x 2 ranks)")
    p.add_argument("--config", default=None,
                   help="DeepSpeed-style JSON config (default: the built-in one: bf16, AdamW, ZeRO-3 + ZeRO++)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the training precision, overriding the config; auto: the config's, and for the built-in "
                   "config bf16 where the CPU multiplies bf16 fast (AVX512-BF16 or AMX), else fp32 (default: auto)")
    p.add_argument("--zeropp", action=argparse.BooleanOptionalAction, default=None,
                   help="switch qwZ, hpZ (group = one node) and qgZ all on or all off, overriding the config "
                   "(default: as the config says; the built-in config has them on)")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), default=None,
                   help="ZeRO-Offload: run the optimizer on the host (cpu); nvme: ZeRO-Infinity, optimizer "
                   "state in a per-rank file, and stage 3's parameters too unless hpZ is on (use --no-zeropp "
                   "with the built-in config to offload both) (default: as the config says)")
    p.add_argument("--nvme-path", default=None,
                   help="directory for the NVMe offload files (default: the config's, else "
                   "<tmp>/zeropp-nvme)")
    p.add_argument("--steps", type=_positive, default=60, help="optimizer steps (default: 60)")
    p.add_argument("--seed", type=int, default=1234, help="seed for the model and the batches (default: 1234)")
    p.add_argument("--block-size", type=_positive, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--n-layer", type=_positive, default=4, help="transformer blocks (default: 4)")
    p.add_argument("--n-embd", type=_positive, default=128, help="model width (default: 128)")
    p.add_argument("--log-every", type=_positive, default=10, help="steps between progress lines off a terminal")
    p.add_argument("--out", default=None, help="write losses and the communication report to this JSON file")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save checkpoints here, and resume from the newest complete one it holds (default: none)")
    p.add_argument("--save-every", type=_positive, default=None,
                   help="with --checkpoint-dir: save every N steps (default: only at the end)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart all ranks this many times after one fails (torchrun's --max-restarts); with "
                   "--checkpoint-dir the job continues from the newest checkpoint (default: 0)")


def _job_args(args: argparse.Namespace) -> list[str]:
    out = ["--steps", str(args.steps), "--seed", str(args.seed), "--block-size", str(args.block_size),
           "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--log-every", str(args.log_every)]
    if args.ranks_per_node:
        out += ["--ranks-per-node", str(args.ranks_per_node)]
    if args.config:
        out += ["--config", os.path.abspath(args.config)]
    if args.zeropp is not None:
        out.append("--zeropp" if args.zeropp else "--no-zeropp")
    if args.offload is not None:
        out += ["--offload", args.offload]
    if args.nvme_path:
        out += ["--nvme-path", os.path.abspath(args.nvme_path)]
    if args.out:
        out += ["--out", os.path.abspath(args.out)]
    if args.precision != "auto":
        out += ["--precision", args.precision]
    if args.checkpoint_dir:
        out += ["--checkpoint-dir", os.path.abspath(args.checkpoint_dir)]
    if args.save_every:
        out += ["--save-every", str(args.save_every)]
    return out


def _choose_precision(args: argparse.Namespace) -> None:
    """``--precision auto`` with the built-in config: fp32 where bf16 matmuls are slow (zeropp/tools/demo/cpu.py),
    said in the first line printed; a user's config keeps its own precision."""
    if args.precision != "auto" or args.config:
        return
    from zeropp.tools.demo.cpu import bf16_speed

    speed = bf16_speed()
    args.precision = "bf16" if speed.fast else "fp32"
    if not speed.fast:
        print(f"zeropp train: training in fp32, not the built-in config's bf16: {speed.why} "
              "(--precision bf16 to use it anyway)", flush=True)


def train(args: argparse.Namespace) -> int:
    """Check what every rank would find alike once, here (one error line, exit 2), then launch the ranks."""
    from zeropp.config.loader import ConfigError
    from zeropp.tools.job import PEER_LOST_EXIT, USER_ERROR_EXIT, check_before_launch
    from zeropp.topology import TopologyError

    if args.ranks_per_node and args.nproc % args.ranks_per_node:
        print(f"zeropp train: --ranks-per-node {args.ranks_per_node} must divide --nproc {args.nproc}",
              file=sys.stderr)
        return 2
    if args.max_restarts < 0:
        print(f"zeropp train: --max-restarts must be >= 0, got {args.max_restarts}", file=sys.stderr)
        return 2
    _choose_precision(args)
    try:
        with warnings.catch_warnings():  # the ranks read the config again and warn there
            warnings.simplefilter("ignore")
            check_before_launch(args, args.nproc)
    except (ConfigError, TopologyError) as err:
        print(f"zeropp train: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={args.nproc}", f"--max-restarts={args.max_restarts}",
         "--module", "zeropp.tools.job", *_job_args(args)]
    )
    try:
        run(launch)
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes <= {USER_ERROR_EXIT, PEER_LOST_EXIT}:  # the ranks said what went wrong, one line each
            return USER_ERROR_EXIT if USER_ERROR_EXIT in codes else PEER_LOST_EXIT
        raise
    return 0


def _consolidate_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "consolidate",
        help="write a sharded checkpoint's full fp32 weights to one file",
        description="Read a checkpoint saved by engine.save_checkpoint, shard file by shard file, and write the "
        "full fp32 model state dict (model.state_dict()'s keys, tied weights under each name) to OUT: "
        "safetensors for a .safetensors file, torch.save for .pt/.pth/.bin. Needs no torch.distributed.",
    )
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="the save_dir given to save_checkpoint")
    p.add_argument("out", metavar="OUT", help="output file (.safetensors, .pt, .pth or .bin)")
    p.add_argument("--tag", default=None, help="tag to read (default: the one CKPT_DIR/latest names)")


def _checkpoint_command(name: str, run: Callable[[], str]) -> int:
    """Run a checkpoint command: its one-line result on stdout, or its error on stderr and exit status 1."""
    from zeropp.checkpoint import CheckpointError

    try:
        out = run()
    except (CheckpointError, ValueError, RuntimeError, OSError) as err:
        print(f"zeropp {name}: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0


def consolidate(args: argparse.Namespace) -> int:
    from zeropp.checkpoint import consolidate as run_consolidate

    return _checkpoint_command("consolidate", lambda: run_consolidate(args.ckpt_dir, args.out, tag=args.tag))


def _verify_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "verify-checkpoint",
        help="check a sharded checkpoint's files without starting any process group",
        description="Check the tag that DIR/latest names (or --tag): the latest pointer, the manifest (its schema "
        "and its own SHA-256), every shard file's presence, size and SHA-256 against the manifest, and no "
        "unexpected shard file. Prints one line per problem and a summary; exit status 0 when valid, 1 if not.",
    )
    p.add_argument("ckpt_dir", metavar="DIR", help="the save_dir given to save_checkpoint")
    p.add_argument("--tag", default=None, help="tag to check (default: the one DIR/latest names)")


def verify_checkpoint(args: argparse.Namespace) -> int:
    from zeropp.checkpoint.verify import verify_report

    report = verify_report(args.ckpt_dir, args.tag)
    for line in report.notes:
        print(f"note: {line}")
    for line in report.problems:
        print(f"problem: {line}")
    print(report.summary())
    return 0 if report.ok else 1


def _convert_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "convert-checkpoint",
        help="rewrite a checkpoint of an older zeropp (pickled shards) as safetensors + JSON",
        description="Checkpoints of format versions 1 and 2 hold pickled shard files, which zeropp no longer "
        "loads when they hold more than tensors and plain data: unpickling runs whatever code the file holds. "
        "This command unpickles them once and rewrites each tag of DIR (or --tag) in format version 3, which "
        "holds no code. Run it only on a checkpoint whose origin you trust, and say so with --trust-pickle.",
    )
    p.add_argument("ckpt_dir", metavar="DIR", help="the save_dir given to save_checkpoint")
    p.add_argument("--tag", default=None, help="convert this tag only (default: every tag in DIR)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="required: you trust that nobody could have put code into DIR's shard files")


def convert_checkpoint(args: argparse.Namespace) -> int:
    from zeropp.checkpoint.convert import convert_checkpoint as run_convert

    def run() -> str:
        done = run_convert(args.ckpt_dir, args.tag, trust_pickle=args.trust_pickle)
        return f"converted {len(done)} tag(s) to format version 3: {', '.join(done) or 'none needed'}"
    return _checkpoint_command("convert-checkpoint", run)


def _export_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "export-deepspeed",
        help="write a zeropp checkpoint as a DeepSpeed ZeRO-3 checkpoint",
        description="Write tag --tag (default: the one SRC/latest names) of zeropp checkpoint SRC as the files "
        "DeepSpeed 0.19.8 writes for ZeRO stage 3 on N data-parallel ranks (DST/latest, "
        "DST/global_stepK/zero_pp_rank_R_mp_rank_00_{model,optim}_states.pt), so that DeepSpeed's "
        "engine.load_checkpoint(DST) continues the run. N is DeepSpeed's data-parallel size: its stage 3 loads "
        "only at the size it saved. State DeepSpeed's format cannot hold (LoCo's errors, int8 frozen weights, "
        "hpZ) is refused by name unless --drop-unsupported.",
    )
    p.add_argument("src", metavar="SRC", help="the zeropp checkpoint directory (save_dir of save_checkpoint)")
    p.add_argument("dst", metavar="DST", help="the DeepSpeed checkpoint directory to write")
    p.add_argument("--world-size", type=_positive, required=True, help="DeepSpeed's data-parallel size N")
    p.add_argument("--tag", default=None, help="tag of SRC to export (default: the one SRC/latest names)")
    p.add_argument("--drop-unsupported", action="store_true",
                   help="export without what DeepSpeed's format cannot hold, with a warning for each")


def export_deepspeed(args: argparse.Namespace) -> int:
    from zeropp.deepspeed.checkpoint_io import export_deepspeed as run_export

    return _checkpoint_command("export-deepspeed", lambda: run_export(args.src, args.dst, args.world_size, args.tag,
                                                                      args.drop_unsupported))


def _universal_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "to-universal",
        help="write a checkpoint as a universal one, which loads on any world size and ZeRO stage",
        description="Read checkpoint SRC (a zeropp or a DeepSpeed ZeRO checkpoint: its save directory, with --tag "
        "or the tag its latest names, or a tag directory) and write every parameter whole, its fp32 value and "
        "Adam's moments and step, with the optimizer groups, the schedule's position, the global step, buffers "
        "and client state, into the folder OUT, named in OUT's parent's latest_universal. --format deepspeed "
        "(default) writes DeepSpeed's universal layout (OUT/zero/<param>/fp32.pt ..., as DeepSpeed's "
        "ds_to_universal), which DeepSpeed 0.19.8 loads at any stage and world size with "
        "\"checkpoint\": {\"load_universal\": true}; --format zeropp writes zeropp's own files (safetensors and "
        "JSON). zeropp loads both the same way. Needs no torch.distributed.",
    )
    p.add_argument("src", metavar="SRC", help="the checkpoint: a save directory or a tag directory")
    p.add_argument("out", metavar="OUT", help="the universal folder to write (e.g. ckpt/global_step3_universal)")
    p.add_argument("--tag", default=None, help="tag of SRC to convert (default: the one SRC/latest names)")
    p.add_argument("--format", choices=("deepspeed", "zeropp"), default="deepspeed",
                   help="DeepSpeed's universal layout (default) or zeropp's own files")
    p.add_argument("--drop-unsupported", action="store_true",
                   help="convert without what the format cannot hold (LoCo's kept errors), with a warning")


def to_universal(args: argparse.Namespace) -> int:
    from zeropp.deepspeed.checkpoint.universal_io import to_universal as run_convert

    return _checkpoint_command("to-universal", lambda: run_convert(args.src, args.out, args.tag, args.format,
                                                                   args.drop_unsupported))


def _bench_parser(sub: "argparse._SubParsersAction") -> None:
    from zeropp.tools.cluster_bench.run import parser as bench_parser

    p = sub.add_parser(
        "bench",
        help="benchmark ZeRO++ against DDP, FSDP2, DeepSpeed and ZeRO-3 on a simulated slow-network cluster",
        description="Run every system on N network-namespace nodes x R ranks with inter-node links limited by "
        "tc tbf, for each bandwidth; record median step time, wire bytes (veth counters), ledger bytes, peak "
        "model-state memory and loss; write JSON, a markdown table and plots to --out. Needs root for the "
        "namespaces; without it, ledger-only mode on loopback. See docs/benchmarks.md.",
    )
    bench_parser(p)


def bench(args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    from zeropp.tools.cluster_bench.run import main as bench_main

    argv = list(sys.argv[1:] if argv is None else argv)
    return bench_main(argv[argv.index("bench") + 1:] if "bench" in argv else [], prog_args=args)


def _plan_parser(sub: "argparse._SubParsersAction") -> None:
    from zeropp.tools.plan.cli import DESCRIPTION, add_arguments  # no torch import: the CLI stays quick

    p = sub.add_parser("plan", help="predict step time and memory of each ZeRO stage / ZeRO++ technique for a model "
                       "and cluster, ranked; --calibrate measures this machine", description=DESCRIPTION)
    add_arguments(p)


def _run_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("run", help="run a training script unchanged with zeropp installed as its `deepspeed` "
                       "(put `-m zeropp.tools.run` where `python` goes under torchrun)")
    p.add_argument("script", help="the script, run as __main__")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments, as it reads them")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="zeropp", description="ZeRO-3 with ZeRO++ on PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _consolidate_parser(sub)
    _convert_parser(sub)
    _export_parser(sub)
    _verify_parser(sub)
    _universal_parser(sub)
    _bench_parser(sub)
    _plan_parser(sub)
    _run_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "train":
        return train(args)
    if args.command == "consolidate":
        return consolidate(args)
    if args.command == "export-deepspeed":
        return export_deepspeed(args)
    if args.command == "convert-checkpoint":
        return convert_checkpoint(args)
    if args.command == "verify-checkpoint":
        return verify_checkpoint(args)
    if args.command == "to-universal":
        return to_universal(args)
    if args.command == "bench":
        return bench(args, argv)
    if args.command == "plan":
        from zeropp.tools.plan.cli import main as plan_main

        return plan_main(args)
    if args.command == "run":
        from zeropp.tools.run import run

        run([args.script, *args.script_args])
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
