"""One rank of one case: python worker.py IMPL MODULE CASE RANK WORLD PORT RESULT_FILE."""
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    impl, module, name, rank, world, port, out = sys.argv[1:8]
    os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DS_ACCELERATOR="cpu")
    res = {"status": "pass"}
    try:
        if impl == "zeropp":
            import zeropp
            zeropp.install_deepspeed_alias()
        import torch
        torch.manual_seed(42)
        import deepspeed
        if impl == "deepspeed":
            # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op (g++) in every fresh process;
            # on this shared 2-core machine that build does not finish in a case's time. gloo does the same
            # collectives, so the op is left out (a speed-up only; no result depends on it).
            import importlib
            importlib.import_module("deepspeed.comm.torch")
            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        sys.path.insert(0, HERE)
        mod = __import__(module)
        for n, w, fn, kw in mod.CASES:
            if n == name:
                if not getattr(fn, "no_init", False):  # cases that test how DeepSpeed starts the group itself
                    deepspeed.init_distributed(dist_backend="gloo")
                fn(**kw)
                break
        else:
            raise KeyError(f"no case {name}")
    except BaseException as e:  # noqa: BLE001 - a case's every failure is recorded
        tb = traceback.extract_tb(e.__traceback__)
        ours = [f for f in tb if f.filename.startswith(HERE)]
        where = ours[-1] if ours else (tb[-1] if tb else None)
        first = (str(e).strip().splitlines() or [""])[0]
        res = {"status": "fail" if isinstance(e, AssertionError) else "error",
               "exception": f"{type(e).__name__}: {first}"[:500],
               "line": f"{os.path.basename(where.filename)}:{where.lineno}: {where.line}" if where else "",
               "deepest": f"{tb[-1].filename}:{tb[-1].lineno}: {tb[-1].line}" if tb else "",
               "traceback": traceback.format_exc()[-4000:]}
    with open(out, "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
