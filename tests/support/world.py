"""Start a world of gloo processes once, run one function on every rank, collect what each returns.

Process start-up dominates on two cores, so a test module starts a world once (module-scoped fixture) and
its worker function runs every scenario, returning plain results for the tests to assert on.

Ranks are forked from a fork server that imported torch and zeropp once per test session (about 0.1 s for a
world of 4, against 7-8 s when every rank imports them itself). A rank takes the test process's environment,
working directory and stdout/stderr as they are when the world starts, and runs the exit handlers a spawned
interpreter would run. A world given ``env`` (settings read before Python runs, such as glibc's malloc
tunables) is spawned, each rank a fresh interpreter (a rank's memory is then its own, to the page). A world that
only needs ranks that have not imported transformers yet (``ZEROPP_FRESH_INTERPRETER`` in ``env``: a rank that
installs the DeepSpeed alias first) starts one fresh interpreter, a zygote, which imports torch and zeropp once
and forks each rank from itself.
"""
from __future__ import annotations

import atexit
import gc
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the fork server; a rank imports only what its test module adds
_PRELOAD = ["torch", "torch.distributed", "zeropp", "zeropp.zero.engine", "zeropp.checkpoint", "zeropp.hf",
            "support.world", "transformers", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.llama.modeling_llama"]


# what a zygote imports before it forks the ranks of a world that must not find transformers imported
_FRESH_PRELOAD = ["torch", "torch.distributed", "zeropp", "zeropp.zero.engine", "zeropp.checkpoint", "support.world"]


def _context(env: dict[str, str] | None) -> Any:
    if env:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # modules that fail to import are skipped by the server
    return ctx


def _parent() -> dict[str, Any]:
    """What a rank takes from the test process as the world starts: environment, directory, stdout/stderr."""
    return {"environ": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()}


def _adopt(parent: dict[str, Any]) -> None:
    """Make a rank forked from the fork server look like one started by the test now: its environment and
    working directory, and its stdout/stderr (a test's capture file) opened again through /proc."""
    os.environ.clear()
    os.environ.update(parent["environ"])
    os.chdir(parent["cwd"])
    for fd in (1, 2):
        try:
            new = os.open(f"/proc/{parent['pid']}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(new, fd)
        os.close(new)


def _kill_group(p: Any) -> None:
    """End a world's process and, for a zygote, the ranks it forked (its process group)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        p.kill()
    p.join()


def _finalize() -> None:
    """What a spawned rank's interpreter does at exit and a forked one skips (it leaves by ``os._exit``): collect
    garbage and run the exit handlers (weakref finalizers among them: offload files are removed there)."""
    gc.collect()
    atexit._run_exitfuncs()


def _worker(rank: int, world: int, ranks_per_node: int, port: int, out_dir: str, fn: Callable, args: tuple,
            parent: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    _adopt(parent)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(ranks_per_node),
                      LOCAL_RANK=str(rank % ranks_per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException as err:  # the parent re-raises with the rank's traceback
        result = ("error", f"rank {rank}: {err!r}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    _finalize()


def _zygote(world: int, ranks_per_node: int, port: int, out_dir: str, fn: Callable, args: tuple,
            parent: dict[str, Any]) -> None:
    """A fresh interpreter: import torch and zeropp once (not transformers), then fork every rank and wait for them.
    It leads a process group of its own, which holds the ranks: the parent ends the group on a timeout."""
    import importlib
    os.setpgid(0, 0)
    for name in _FRESH_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _worker(rank, world, ranks_per_node, port, out_dir, fn, args, parent)
            except BaseException:  # noqa: BLE001 - the result file says what happened; exit without cleanup
                code = 1
            os._exit(code)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def _log_world(fn: Callable, world: int, seconds: float) -> None:
    """``ZEROPP_TEST_WORLD_LOG=path``: one line per world (the test that started it, its size, its seconds), to see
    where a suite's time goes."""
    path = os.environ.get("ZEROPP_TEST_WORLD_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t{getattr(fn, '__name__', fn)}\t"
                    f"{world}\t{seconds:.2f}\n")


def run_world(fn: Callable, world: int, *args: Any, ranks_per_node: int | None = None, timeout: float = 600,
              env: dict[str, str] | None = None, dead: frozenset[int] = frozenset()) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results in rank order.

    ``env`` is set in the ranks' environment from their start (for settings read before Python runs, such
    as glibc's malloc tunables). Ranks in ``dead`` are expected to die or hang without a result
    (fault-injection tests): once the others finish, a hung one is killed; their entry is their exit code.
    """
    rpn = ranks_per_node or world
    start = time.perf_counter()
    try:
        return _run_world(fn, world, args, rpn, timeout, env, dead)
    finally:
        _log_world(fn, world, time.perf_counter() - start)


def _run_world(fn: Callable, world: int, args: tuple, rpn: int, timeout: float, env: dict[str, str] | None,
               dead: frozenset[int]) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _context(env)
        port = _free_port()
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        parent = _parent()
        if env and "ZEROPP_FRESH_INTERPRETER" in env and not dead:  # one fresh interpreter, the ranks forked from it
            procs = [ctx.Process(target=_zygote, args=(world, rpn, port, out_dir, fn, args, parent))]
        else:
            procs = [ctx.Process(target=_worker, args=(r, world, rpn, port, out_dir, fn, args, parent))
                     for r in range(world)]
        try:
            for p in procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for r, p in enumerate(procs):
            if r not in dead:
                p.join(timeout)
        for r, p in enumerate(procs):
            if r in dead and p.is_alive():  # a hung (stopped) rank: the others are done with it
                p.kill()
                p.join()
        for p in procs:
            if p.is_alive():
                _kill_group(p)
                raise TimeoutError(f"world of {world} did not finish in {timeout}s")
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.pkl")
            if r in dead and not os.path.exists(path):
                results.append(procs[r].exitcode)
                continue
            if not os.path.exists(path):
                code = procs[r].exitcode if len(procs) == world else f"? (forked by a zygote that exited with " \
                    f"{procs[0].exitcode})"
                raise RuntimeError(f"rank {r} exited with code {code} and no result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(value)
            results.append(value)
        return results
