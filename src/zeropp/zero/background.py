"""The delayed parameter update's thread: one optimizer update run beside the next forward and backward."""
from __future__ import annotations

import threading
from typing import Callable, Optional


class BackgroundUpdate:
    """One optimizer update on a daemon thread; ``wait`` re-raises what it raised."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="zeropp-delayed-update", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as err:  # re-raised on the training thread by wait()
            self._error = err

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
