"""What a rank prints when it dies of a signal: the rank, then every thread's Python stack.

Note [crash report]: zeropp refuses what it can see (Note [released storage] in ``partition/unit.py``), but
native code can still fault: a C++ extension reading freed memory, a driver error, an out-of-memory kill.
Without help the process vanishes with "Segmentation fault" or nothing, the other ranks fail with
``PeerLostError`` naming it, and nothing says where it was. So every rank an engine runs turns Python's
``faulthandler`` on (all threads, to stderr) unless the process already enabled it its own way, and puts a
small C handler in front of it for SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT that writes one line naming
the rank, the world size and the process, then hands the signal back to the handler it found (faulthandler's,
which prints the stacks and lets the signal end the process as before; a handler installed after this one,
by a later ``faulthandler.enable()`` say, replaces it). The line is written with ``write(2)``
only, which is safe inside a signal handler. Without a C compiler the stacks are printed without that line.
"""
from __future__ import annotations

import ctypes
import faulthandler
import os
import sys
from typing import Optional

from zeropp import native

_SOURCE = r"""
#include <signal.h>
#include <string.h>
#include <unistd.h>

static char line[256];
static size_t line_len;
static struct sigaction before[65];
static const int SIGNALS[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

static void on_signal(int sig, siginfo_t *info, void *ctx) {
    (void)info; (void)ctx;
    ssize_t ignored = write(2, line, line_len);
    (void)ignored;
    /* hand the signal back to the handler that was there before (faulthandler's, which prints the stacks
       and re-raises): blocked while this one runs, it is delivered there as this one returns, whether it
       came from a fault, from abort() or from another process */
    sigaction(sig, &before[sig], NULL);
    raise(sig);
}

int zeropp_crash_line(const char *text) {
    size_t n = strlen(text);
    if (n >= sizeof(line)) n = sizeof(line) - 1;
    memcpy(line, text, n);
    line_len = n;
    struct sigaction act;
    memset(&act, 0, sizeof(act));
    act.sa_sigaction = on_signal;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    for (size_t i = 0; i < sizeof(SIGNALS) / sizeof(SIGNALS[0]); i++) {
        struct sigaction cur;
        if (sigaction(SIGNALS[i], NULL, &cur) == 0 && cur.sa_sigaction == on_signal) {
            continue;  /* installed already: keep the handler it hands back to */
        }
        if (sigaction(SIGNALS[i], &act, &before[SIGNALS[i]]) != 0) return -1;
    }
    return 0;
}
"""

_LIB: Optional[ctypes.CDLL] = None


def _library() -> Optional[ctypes.CDLL]:
    global _LIB
    if _LIB is None:
        path = native.build_shared_library("crash", _SOURCE, ["-O2", "-shared", "-fPIC"], [[]], libs=())
        if path is None:
            return None
        _LIB = ctypes.CDLL(path)
        _LIB.zeropp_crash_line.argtypes = [ctypes.c_char_p]
        _LIB.zeropp_crash_line.restype = ctypes.c_int
    return _LIB


def install(rank: int, world_size: int) -> bool:
    """Note [crash report]: stacks of every thread on a fatal signal, after a line naming ``rank``. Returns
    whether that line is installed (False without a C compiler: the stacks alone)."""
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a stderr replaced by an object without a file
            faulthandler.enable(file=sys.__stderr__, all_threads=True)
    lib = _library()
    if lib is None:
        return False
    text = (f"\nzeropp: rank {rank} of {world_size} (pid {os.getpid()}) received a fatal signal; "
            "the Python stack of each thread follows\n")
    return lib.zeropp_crash_line(text.encode()) == 0
