"""Timing shared by the Python benchmarks: the time of one call, and medians over interleaved rounds."""

import statistics
import time


def per_call_us(fn, calls):
    """Microseconds per call of fn over `calls` back-to-back calls."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls / 1e3


def interleaved_medians(sides, calls, rounds):
    """The median per-call microseconds of each callable in `sides` (a dict) over `rounds` rounds,
    each round timing every side once in turn, so that a slow minute reaches every side alike."""
    times = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            times[name].append(per_call_us(fn, calls))
    return {name: statistics.median(t) for name, t in times.items()}
