"""How many threads a CPU engine computes with, chosen while it runs from how busy its cores are.

torch's OpenMP threads spin between parallel regions (``GOMP_SPINCOUNT``), which is what makes a
step of thousands of short regions fast on idle cores. Beside a CPU-bound process it is what
makes it slow: with more runnable threads than cores, a spinning thread holds the core that its
descheduled partner needs to finish the region, and single-stream decode fell 10× beside one
busy-looping process on 2 cores. One thread per core that is actually free avoids that: a
team of one never waits for a partner.

:class:`AdaptiveThreads` measures, over windows of ``interval`` seconds of stepping, how much of
this process's CPUs the rest of the machine used: the CPUs' idle time (``/proc/stat``) and this
process's own CPU time (spinning included) leave the other processes' share. It lowers the
thread count when the cores left for this process drop well below it and raises it when they
come back, with a margin each way so that it does not flap; never above the count the engine was
configured with, never below one. Every rank of a tensor-parallel or data-parallel engine runs
its own, so ranks sharing cores share them out.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

LOWER_MARGIN = 0.6
"""Cores: drop threads when the cores left for this process are this far below the count."""
RAISE_MARGIN = 0.7
"""Cores: add threads when the cores left are this far above the count."""


@dataclass(frozen=True)
class Sample:
    """Cumulative counters at one moment (seconds)."""

    wall: float
    idle: float
    """Idle (and I/O wait) time summed over the process's CPUs."""
    process: float
    """This process's CPU time, all its threads."""


def read_idle(cpus: frozenset[int]) -> float:
    """Idle and I/O-wait seconds of ``cpus`` since boot, from ``/proc/stat``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if name != "cpu" and int(name[3:]) in cpus:
                total += int(fields[3]) + int(fields[4])
    return total / tick


def take_sample(cpus: frozenset[int]) -> Sample:
    times = os.times()
    return Sample(time.monotonic(), read_idle(cpus), times.user + times.system)


class AdaptiveThreads:
    """The thread count for the next step, from the CPU left to this process.

    ``sample`` is injectable for tests; by default it reads ``/proc``."""

    def __init__(
        self,
        max_threads: int,
        cpus: frozenset[int],
        interval: float = 0.3,
        sample: Callable[[frozenset[int]], Sample] = take_sample,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.cpus = cpus
        self.interval = interval
        self._sample = sample
        self._mark = sample(cpus)

    def before_step(self) -> None:
        """Update the count when a window has passed, and give it to the calling thread (torch's
        and OpenMP's thread count is per thread)."""
        if time.monotonic() - self._mark.wall >= self.interval:
            self.update(self._sample(self.cpus))
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def update(self, now: Sample) -> None:
        """Decide from the window since the last sample, then start a new window at ``now``."""
        wall = now.wall - self._mark.wall
        if wall <= 0:
            return
        free = (now.idle - self._mark.idle) / wall
        ours = (now.process - self._mark.process) / wall
        self._mark = now
        room = min(len(self.cpus), free + ours)
        threads = self.threads
        if room <= threads - LOWER_MARGIN or room >= threads + RAISE_MARGIN:
            threads = min(self.max_threads, max(1, round(room)))
        if threads != self.threads:
            logger.debug(
                "threads %d -> %d (other processes used %.2f of %d cores)",
                self.threads, threads, len(self.cpus) - room, len(self.cpus),
            )
            self.threads = threads
