"""One GRPO step (generate, score, train) on the emulated 2 x 2 cluster: DeepSpeed ZeRO-3, zeropp ZeRO-3 and zeropp
ZeRO++, generation and training timed apart, with the bytes that crossed nodes in each.

    sudo .venv/bin/python bench/bench_rlhf.py [--bandwidths unlimited,200mbit] [--steps 2] [--warmup 1]
        [--systems ds_zero3,zeropp_zero3,zeropp_plus] [--layers 6] [--hidden 512] [--deepspeed-path DIR]
        [--ledger-only] [--out bench/results/rlhf.json]

The ranks run in ``zeropp bench``'s network namespaces (2 nodes of 2 ranks, each node's link shaped with ``tc``;
without root, ledger-only: loopback, no shaping and no wire counters). TRL's ``GRPOTrainer`` on a transformers Llama
built from a config (``--layers`` x ``--hidden``, about 19M parameters by default, a byte tokenizer), prompts of
shipped text, a Python reward (vowels), bf16, ``num_generations`` 4, 16 new tokens, HF ``generate``:

- ``ds_zero3``: TRL's own DeepSpeed path (``GRPOConfig(deepspeed=...)``, ZeRO-3), real DeepSpeed (0.19.8,
  ``DS_ACCELERATOR=cpu``; put it on ``PYTHONPATH`` with ``--deepspeed-path`` if it is not installed);
- ``zeropp_zero3`` / ``zeropp_plus``: ``ZeroppTrainer`` mixed into ``GRPOTrainer``, stage 3 / with qwZ, hpZ (2)
  and qgZ. Generation gathers the model once per step through the forward's strategy (Note [generation gathers]).

Per step and rank: the generation phase (TRL's ``_generate_single_turn``: the whole-model gather and ``generate``)
and the rest of the step (scoring, reference-free loss, backward, optimizer), and the bytes ``eth0`` counted in each
(the node's traffic across nodes, read by each node's first rank). Reported: medians over the timed steps of rank 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

SYSTEMS = ("ds_zero3", "zeropp_zero3", "zeropp_plus")
ZEROPP = {"zeropp_zero3": {"stage": 3},
          "zeropp_plus": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                          "zero_quantized_gradients": True}}
PROMPTS = ["To be or not to", "Fair is foul and", "Double double toil", "The quality of mercy", "Now is the winter",
           "All the world is", "Friends, Romans, and", "If music be the"]


def tokenizer() -> Any:
    """Printable ASCII, one token a character (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{chr(i): i - 29 for i in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def save_model(path: str, layers: int, hidden: int) -> int:
    """The benchmarked Llama and its tokenizer under ``path``; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                                         max_position_embeddings=64, tie_word_embeddings=False))
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _wire() -> Optional[int]:
    """Bytes the node's link carried so far; None in ledger-only mode (no link of the node's to read)."""
    from zeropp.tools.cluster_bench.cluster import read_link_counters
    counters = read_link_counters()
    return None if counters is None else counters["rx"] + counters["tx"]


def worker(system: str, model_dir: str, steps: int, warmup: int, result: str) -> None:
    """One rank: the GRPO run of ``system``, timing and counting each step's two phases."""
    if system.startswith("zeropp"):
        import zeropp
        zeropp.install_deepspeed_alias()  # the mixin needs none, but TRL's imports then see one DeepSpeed
    else:  # on a machine without a GPU accelerate joins the ranks in torch's group only; DeepSpeed's own
        import deepspeed  # comm layer must know them before from_pretrained's zero.Init reads its world size
        deepspeed.init_distributed(dist_backend="gloo")
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [float(sum(ch in "aeiou" for ch in text)) for text in completions]

    base: Any = GRPOTrainer
    if system.startswith("zeropp"):
        from zeropp.hf import ZeroppTrainer
        base = type("ZeroppGRPOTrainer", (ZeroppTrainer, GRPOTrainer), {})
    phases: dict[str, list[Any]] = {"generation_s": [], "step_s": [], "generation_wire": [], "step_wire": []}

    def timed(phase: str, call: Callable[[], Any]) -> Any:
        """``call()``, its seconds and the bytes across the link recorded under ``phase``."""
        wire, t = _wire(), time.perf_counter()
        out = call()
        phases[f"{phase}_s"].append(time.perf_counter() - t)
        after = _wire()
        phases[f"{phase}_wire"].append(None if wire is None or after is None else after - wire)
        return out

    class Timed(base):  # type: ignore[misc, valid-type]
        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            return timed("generation", lambda: super(Timed, self)._generate_single_turn(*args, **kwargs))

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            return timed("step", lambda: super(Timed, self).training_step(*args, **kwargs))

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3}}
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlhf-"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=16, max_steps=warmup + steps, learning_rate=1e-5, logging_steps=1,
                      save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True, seed=0, bf16=True,
                      gradient_checkpointing=False, deepspeed=ds if system == "ds_zero3" else None)
    kw: dict[str, Any] = {"model": model_dir, "reward_funcs": reward, "args": args,
                          "train_dataset": datasets.Dataset.from_dict({"prompt": PROMPTS * 8})}
    if system.startswith("zeropp"):
        kw["zeropp_config"] = {"zero_optimization": ZEROPP[system], "topology": {"ranks_per_node": 2},
                               "bf16": {"enabled": True}}
    torch.manual_seed(0)
    trainer = Timed(**kw)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(result, "w") as f:
            json.dump({"phases": phases, "rewards": rewards, "warmup": warmup}, f)


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians of the timed steps; training is the step less its generation."""
    w = raw["warmup"]
    gen, step = raw["phases"]["generation_s"][w:], raw["phases"]["step_s"][w:]
    gwire, swire = raw["phases"]["generation_wire"][w:], raw["phases"]["step_wire"][w:]
    train = [s - g for s, g in zip(step, gen)]
    counted = None not in gwire + swire  # ledger-only: no wire bytes at all, never the host's interface's
    return {"generation_s": statistics.median(gen), "training_s": statistics.median(train),
            "step_s": statistics.median(step), "generation_share": statistics.median(g / s for g, s in zip(gen, step)),
            "generation_wire_bytes": statistics.median(gwire) if counted else None,
            "training_wire_bytes": statistics.median(s - g for s, g in zip(swire, gwire)) if counted else None,
            "rewards": raw["rewards"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bandwidths", default="unlimited,200mbit")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--ledger-only", action="store_true", help="no namespaces: loopback, no shaping, no wire bytes")
    p.add_argument("--deepspeed-path", default=None, help="a folder holding DeepSpeed, put on the ranks' PYTHONPATH")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rlhf.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.model_dir, args.steps, args.warmup, args.result)
        return
    from zeropp.tools.cluster_bench.cluster import Cluster
    work = tempfile.mkdtemp(prefix="rlhf-bench-")
    os.chmod(work, 0o777)
    model_dir = os.path.join(work, "model")
    params = save_model(model_dir, args.layers, args.hidden)
    env = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    if args.deepspeed_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.deepspeed_path, os.environ.get("PYTHONPATH")]))
    rows: list[dict[str, Any]] = []
    cluster = Cluster(nodes=2, ranks_per_node=2, namespaces=not args.ledger_only)
    with cluster:
        for bw in args.bandwidths.split(","):
            cluster.shape(None if bw == "unlimited" else bw)
            for system in args.systems.split(","):
                result = os.path.join(work, f"{system}_{bw}.json")
                argv = [sys.executable, os.path.abspath(__file__), "--worker", system, "--model-dir", model_dir,
                        "--result", result, "--steps", str(args.steps), "--warmup", str(args.warmup)]
                t = time.perf_counter()
                codes = cluster.launch(argv, os.path.join(work, f"logs_{system}_{bw}"), env=env)
                exit_codes = cluster.wait(codes, args.timeout)
                row: dict[str, Any] = {"system": system, "bandwidth": bw, "wall_s": time.perf_counter() - t}
                if any(exit_codes) or not os.path.exists(result):
                    log = os.path.join(work, f"logs_{system}_{bw}", "rank0.log")
                    row["error"] = f"exit codes {exit_codes}; " + open(log).read()[-1500:]
                else:
                    with open(result) as f:
                        row.update(summarize(json.load(f)))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "rewards"}), flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results_io import write_results
    write_results(args.out, {"meta": {"date": datetime.date.today().isoformat(), "parameters": params,
                                      "mode": "network namespaces" if cluster.namespaces else
                                      f"ledger-only ({cluster.why_local})",
                                      "command": "python bench/bench_rlhf.py " + " ".join(sys.argv[1:])},
                             "rows": rows})


if __name__ == "__main__":
    main()
