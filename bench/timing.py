"""Timing shared by the benchmarks: CUDA events on a GPU, wall clock elsewhere.

A GPU runs asynchronously: the host returns from a launch long before the
kernel ends, so GPU timings bracket the calls with CUDA events and
synchronise once at the end; on a CPU every call is synchronous and the wall
clock is the measure. Medians, because other work on the machine adds noise
that only ever makes a call slower.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    device = torch.device(device) if device is not None else None
    if (device is None and torch.cuda.is_available()) or (device is not None and device.type == "cuda"):
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device | str, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of one ``fn()`` call on ``device`` after ``warmup`` untimed calls."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class StepClock:
    """Start-to-start wall time of consecutive steps (a training step syncs itself by reading its loss),
    and this process's CPU time over the same intervals (all its threads: on a CPU, the work the step did,
    which other jobs on the machine do not stretch as they stretch the wall time).

    ``stamp()`` at the start of every step and once after the last; ``intervals(skip)``
    gives the step times without the first ``skip`` (warm-up) steps, ``intervals(skip, cpu=True)``
    their CPU seconds.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []

    def stamp(self) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())

    def clear(self) -> None:
        self.stamps.clear()
        self.cpu_stamps.clear()

    def intervals(self, skip: int = 0, cpu: bool = False) -> list[float]:
        stamps = self.cpu_stamps if cpu else self.stamps
        return [b - a for a, b in zip(stamps, stamps[1:])][skip:]


def peak_memory_reset() -> None:
    """Start a new peak-memory window (CUDA only: a CPU process's peak RSS cannot be reset)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float | None:
    """Peak GPU memory allocated by torch since the last reset, GiB (None on CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu, {torch.get_num_threads()} threads"


def profiled(fn, rows: int = 30) -> str:
    """``fn()`` under torch.profiler: the ops that took the most device time (CPU time without a
    GPU), and the host's busy time against the wall time (a step whose host time nears its wall
    time is launch-bound: the GPU waits for Python)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    host = sum(e.self_cpu_time_total for e in averages) / 1e6
    device = sum(e.self_device_time_total for e in averages) / 1e6 if cuda else None
    calls = sum(e.count for e in averages)
    head = (f"wall {wall:.3f} s, host busy {host:.3f} s" + (f", device busy {device:.3f} s" if cuda else "")
            + f", {calls} op calls")
    return head + "\n" + averages.table(sort_by=sort, row_limit=rows)
