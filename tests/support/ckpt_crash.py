"""Run a world in which one rank is expected to die by SIGKILL, and report every rank's exit code.

``run_world`` treats a rank without a result as a failure; here that is the point. Once the killed rank is
gone, the survivors fail in their next collective (gloo sees the closed connection); any rank still alive
after ``grace`` seconds is killed so that the test never hangs.
"""
from __future__ import annotations

import tempfile
import time
from typing import Any, Callable

from support.world import _context, _free_port, _parent, _worker


def run_crashing_world(fn: Callable, world: int, *args: Any, ranks_per_node: int | None = None,
                       timeout: float = 120, grace: float = 15) -> list[int]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's exit code (-9: SIGKILL)."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _context(None)
        port = _free_port()
        parent = _parent()
        procs = [ctx.Process(target=_worker, args=(r, world, ranks_per_node or world, port, out_dir, fn, args, parent))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_exit = None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if first_exit is None and any(not p.is_alive() for p in procs):
                first_exit = time.monotonic()
            if first_exit is not None and time.monotonic() - first_exit > grace:
                break
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        return [p.exitcode for p in procs]
