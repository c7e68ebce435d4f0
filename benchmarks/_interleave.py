"""Step and mixer timing, interleaved: every entry runs in rounds, in an order rotated each round.

The machine is noisy: load that comes and goes hits every entry of a round alike, so ratios are
taken per round (paired) and reported as median [min, max].
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

__all__ = ["interleaved_times", "paired"]


def interleaved_times(
    calls: dict[str, Callable[[], object]],
    *,
    rounds: int,
    per_block: int,
    warmup: int,
    sync: Callable[[], None],
    progress: Callable[[str], None],
    label: str,
    counter: Callable[[], int | None] | None = None,
    counts: dict[str, list[float]] | None = None,
    host: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of every entry, per round: each round runs every entry's block of
    ``per_block`` calls back to back, in an order rotated by one each round, so that load
    that comes and goes hits every entry alike (pair the rounds for ratios).

    With ``counter`` (a running total, e.g. ``_malloc.minor_faults``) and ``counts``, ``counts[name]`` gets what
    the counter rose by per call in each round, beside the times (left empty where the counter says ``None``).

    With ``host``, ``host[name]`` gets the seconds per call until the block's last call returned, before the wait for
    the device (``sync``): on a GPU, a time near the full one says the host issuing the work is what it waits on, one
    well below says the device's work is (on the CPU the two are one)."""
    for call in calls.values():  # warm-up: kernels, allocator, autotuning
        for _ in range(warmup):
            call()
    sync()
    times: dict[str, list[float]] = {name: [] for name in calls}
    if counts is not None:
        counts.update({name: [] for name in calls})
    if host is not None:
        host.update({name: [] for name in calls})
    order = list(calls)
    for r in range(rounds):
        progress(f"{label} {r + 1}/{rounds}")
        for name in order:
            before = counter() if counter is not None else None
            t0 = time.perf_counter()
            for _ in range(per_block):
                calls[name]()
            issued = time.perf_counter()
            sync()
            times[name].append((time.perf_counter() - t0) / per_block)
            if host is not None:
                host[name].append((issued - t0) / per_block)
            after = counter() if counter is not None else None
            if counts is not None and before is not None and after is not None:
                counts[name].append((after - before) / per_block)
        order = order[1:] + order[:1]
    return times


def paired(times: Sequence[float], reference: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max of the per-round ratios ``times / reference`` (same round: same machine load)."""
    ratios = [t / r for t, r in zip(times, reference)]
    return statistics.median(ratios), min(ratios), max(ratios)

