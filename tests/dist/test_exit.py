"""Leaving cleanly (Note [leaving the process group] in api.py): a torchrun script that trains with zeropp and
ends without tearing anything down has no gloo worker thread left when the interpreter finalizes, because the
group is destroyed at exit (whether zeropp or the script created it) and zeropp's own groups hold their handles
weakly. A worker still alive there can abort the process ("terminate called without an active exception")."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''
    import atexit, os
    import torch
    import torch.distributed as dist

    def gloo_workers():
        names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
        return sum(name == "pt_gloo_runloop" for name in names)

    def note(line):  # a file per rank: the ranks' stdout interleaves
        with open(f"rank{os.environ['RANK']}.txt", "a") as f:
            print(line, file=f)

    # Registered before zeropp's hook, so it runs after it (atexit is last in, first out).
    atexit.register(lambda: note(f"AT_EXIT workers={gloo_workers()} initialized={dist.is_initialized()}"))
    if os.environ.get("OWN_GROUP") == "1":  # the script (or accelerate, under the Trainer) makes the group,
        import torch._dynamo  # after Dynamo is imported, as under the Trainer (transformers.trainer imports it)
        dist.init_process_group("gloo")
    import zeropp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "topology": {"ranks_per_node": 1}}
    engine, *_ = zeropp.initialize(model=model, config=config)
    loss = engine(torch.randn(2, 16)).square().mean()
    engine.backward(loss)
    engine.step()
    note(f"TRAINED workers={gloo_workers()}")
''')


@pytest.mark.parametrize("own_group", [False, True], ids=["zeropps_group", "the_scripts_group"])
def test_no_gloo_worker_survives_into_finalization(tmp_path: Path, own_group: bool) -> None:
    script = tmp_path / "train_and_leave.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["OWN_GROUP"] = "1" if own_group else "0"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        trained, at_exit = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert trained.startswith("TRAINED workers=") and trained != "TRAINED workers=0"  # gloo was working
        assert at_exit == "AT_EXIT workers=0 initialized=False", rank
