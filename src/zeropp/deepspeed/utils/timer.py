"""``deepspeed.utils.timer.ThroughputTimer``: DeepSpeed's throughput stopwatch, over the engine's step timing."""
from __future__ import annotations

import time
from typing import Any

from zeropp.zero.timing import WARM_UP_STEPS


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``. Read without calling it, it is a view of the engine's own step timing
    (``zero/timing.py``): samples per second over the steps after the first two (``start_step``), as DeepSpeed
    counts them. A script that calls ``start()``/``stop()`` itself drives it as DeepSpeed's stopwatch: from the
    first ``start()`` its counts and times are those of the script's calls (starting from the engine's counts
    then), with DeepSpeed's rules (times from the ``start_step``-th global step on, ``step_elapsed_time`` summed
    over a step's micro-steps). It logs nothing: the engine's time report does (``wall_clock_breakdown``)."""

    start_step = WARM_UP_STEPS

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._driven = False  # the script called start(): the counters below are the truth
        self.initialized = self.started = False
        self.start_time = self.end_time = 0.0
        self.epoch_count = 0
        self._micro = self._global = 0
        self._total = self._step = 0.0

    @property
    def batch_size(self) -> int:
        return self._engine.train_batch_size()

    @property
    def micro_step_count(self) -> int:
        return self._micro if self._driven else self._engine.micro_steps

    @property
    def global_step_count(self) -> int:
        return self._global if self._driven else self._engine.global_steps

    @property
    def total_elapsed_time(self) -> float:
        """Seconds of the steps counted (after the first ``start_step``)."""
        return self._total if self._driven else self._engine.timer.warm_seconds

    @property
    def step_elapsed_time(self) -> float:
        """Seconds of the last step (driven: of the global step under way)."""
        return self._step if self._driven else float(self._engine.timer.report().get("step_s", 0.0))

    def avg_samples_per_sec(self) -> float:
        """Global samples per second over the counted steps; ``-inf`` before any, as in DeepSpeed."""
        if self._driven:
            counted = self._global - self.start_step
            if self._global <= 0 or counted <= 0 or self._total <= 0:
                return float("-inf")
            return self.batch_size * counted / self._total
        timer = self._engine.timer
        if timer.warm_steps == 0 or timer.warm_seconds <= 0:
            return float("-inf")
        return self.batch_size * timer.warm_steps / timer.warm_seconds

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self._micro = 0

    def start(self) -> None:
        if not self._driven:  # from here on the script's calls count, from where the engine's counts are
            self._micro, self._global = self.micro_step_count, self.global_step_count
            self._total, self._driven = self.total_elapsed_time, True
        self.initialized = self.started = True
        if self._global >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self._micro += 1
        if global_step:
            self._global += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self._total += duration
            self._step += duration
            if global_step:
                self._step = 0.0
