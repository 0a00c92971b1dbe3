"""Threads that follow the machine's load: the cores other programs leave free, measured as the engine runs.

In this file you will learn why one thread setting cannot be right both on an
idle CPU and on a busy one, and how an engine can measure which it is on.

torch and Numba run each operator on a team of OpenMP threads. Between two
operators a thread either spins (checks for the next job in a loop, libgomp's
rule for its first 300,000 rounds) or sleeps (`OMP_WAIT_POLICY=PASSIVE`) and
must be woken. A decode step is thousands of short operators, so:

- alone on the machine, spinning is worth a quarter of the throughput (waking
  a sleeping thread costs more than many of these operators take);
- beside other busy programs, a spinning thread holds a core that another
  program, or the engine's own main thread, needed: throughput falls to a quarter.

`tools/busy_bench.py` on a 2-core AMD EPYC (2026-12-05, 8 slots, tokens/s alone
and beside two busy loops): spinning 97-106 alone, and busy 27 or 28 in two runs,
46 or 49 in two more (a gamble); sleeping 72-81 alone, 43-50 busy; one thread in
all (nothing to spin or wake) 74 alone, 51 busy; this file's rule 97-106 alone,
47-50 busy.

So `SharedCores` keeps the threads spinning and changes how many there are.
Once a second, between steps, it reads how much CPU time the machine's cores
spent busy (/proc/stat) and subtracts this process's own (`time.process_time`,
all its threads, spinning included): what is left is other programs' work, in
cores. The engine then uses the cores they leave free (at least one, at most
the threads it started with):

    free cores = cores - others' busy cores          e.g. 2 - 1.1 (two busy loops, squeezed) = 0.9
    threads    = clamp(round(free cores), 1, start)       -> 1: nothing left to spin

A thread the team no longer uses stops spinning after its first wait, so one
thread means no spinning at all; when the others stop, the free cores come
back and so do the threads. Alone nothing changes. The engine's runner calls
`adjust()` before each forward (minicb/model_runner.py); `EngineConfig.cpu_threads`
says "share" (the default on a Linux CPU) or "fixed" (leave torch's setting,
and what `--threads` chose, alone). The reading is the machine's as Linux shows
it to this process: in a container whose /proc/stat shows the host's CPUs and
whose share is set by a quota rather than by the CPUs it may run on, other
tenants' work counts too, and "fixed" is the better choice. Measured: docs/results.md, "Threads on a
busy machine"; tests in tests/engine/test_cpu_threads.py.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Callable

PROC_STAT = "/proc/stat"
# Which of /proc/stat's per-CPU columns are work (user nice system idle iowait irq softirq steal ...):
# all but idle and iowait. steal, time the hypervisor gave another machine, is a core we did not get.
WORK_COLUMNS = (0, 1, 2, 5, 6, 7)


def busy_cpu_seconds(cpus: frozenset[int], path: str = PROC_STAT) -> float:
    """Seconds of work the CPUs in `cpus` have done since boot, by every program (Linux's /proc/stat)."""
    ticks = 0
    with open(path) as stat:
        for line in stat:
            name, *values = line.split() or [""]
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                ticks += sum(int(values[i]) for i in WORK_COLUMNS if i < len(values))
    return ticks / os.sysconf("SC_CLK_TCK")


def threads_for(cores: int, others: float, most: int) -> int:
    """How many threads to run: the cores `others` (other programs' busy cores) leave, within 1..most."""
    return max(1, min(most, round(cores - others)))


class FixedThreads:
    """Threads as they are: a GPU, a machine without /proc/stat, or cpu_threads="fixed"."""

    def adjust(self) -> None:
        pass


class SharedCores:
    """Runs on the cores other programs leave free, measured every `interval_s` of wall time.

    most: the threads the engine started with (torch's count then), never exceeded.
    The readings and the setter are arguments so that a test can play a machine's
    load (tests/engine/test_cpu_threads.py); by default they are /proc/stat,
    time.process_time, time.monotonic and minicb.cpu_attention.apply_num_threads
    (torch's threads and the compiled decode kernel's).
    """

    def __init__(self, most: int, cpus: frozenset[int], interval_s: float = 1.0,
                 machine_busy: Callable[[], float] | None = None, own_busy: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic, set_threads: Callable[[int], None] | None = None,
                 threads: int | None = None):
        # threads: the count now (most, if None); an engine built after another left it lower is
        # brought back up by the first adjust() that finds the cores free.
        if set_threads is None:
            from minicb.cpu_attention import apply_num_threads as set_threads
        self.most, self.cores, self.interval_s = most, len(cpus), interval_s
        self.machine_busy = machine_busy or (lambda: busy_cpu_seconds(cpus))
        self.own_busy, self.clock, self.set_threads = own_busy, clock, set_threads
        self.threads = most if threads is None else threads
        self.changes: list[tuple[float, float, int]] = []  # (when, others' busy cores, threads): each change made
        self._mark()

    def _mark(self) -> None:
        self.since, self.machine_at, self.own_at = self.clock(), self.machine_busy(), self.own_busy()

    def adjust(self) -> None:
        """Between steps: once an interval has passed, measure the others and set the thread count."""
        elapsed = self.clock() - self.since
        if elapsed < self.interval_s:
            return
        machine, own = self.machine_busy() - self.machine_at, self.own_busy() - self.own_at
        others = max(0.0, (machine - own) / elapsed)  # busy cores that were not this process's
        self._mark()
        threads = threads_for(self.cores, others, self.most)
        if threads != self.threads:
            self.set_threads(threads)
            self.threads = threads
            self.changes.append((self.since, others, threads))


def starting_threads() -> int:
    """The most threads an engine may use: what --threads chose (cpu_attention.set_num_threads), else
    torch's count the first time an engine asked, remembered, so that an engine built after another
    had lowered the count for a busy machine still has every core to come back to."""
    from minicb.cpu_attention import chosen_threads

    return chosen_threads() or _torch_threads_at_first_engine()


@functools.lru_cache(maxsize=1)
def _torch_threads_at_first_engine() -> int:
    import torch

    return torch.get_num_threads()


def thread_policy(setting: str, device) -> FixedThreads | SharedCores:
    """The engine's threads for EngineConfig.cpu_threads on `device`: SharedCores for "share" on a CPU
    where /proc/stat can be read, else FixedThreads."""
    import torch

    if setting == "fixed" or torch.device(device).type != "cpu" or not os.path.exists(PROC_STAT):
        return FixedThreads()
    cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(os.cpu_count()))
    return SharedCores(starting_threads(), cpus, threads=torch.get_num_threads())
