"""The GPU suite's clock: a deadline every part asks before each unit of work, and rounds timed by CUDA events.

Every figure is the median over interleaved rounds of calls after warm-up, timed by CUDA events
(host clock on the CPU), with the spread of the paired per-round ratios to a baseline.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["Deadline", "OutOfTime", "error_cell", "summarise", "timed_rounds", "working_calls"]


class Deadline:
    """Seconds left of the suite's budget; a part asks before each unit of work."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class OutOfTime(Exception):
    """The suite's deadline came before a unit of work could start."""


def error_cell(why: object) -> str:
    """A recorded error (``working_calls``) as a markdown table cell: its first line, its pipes escaped."""
    return (str(why).splitlines() or ["?"])[0][:160].replace("|", "\\|")


_Call = TypeVar("_Call", bound=Callable[[], object])


def working_calls(
    calls: dict[str, _Call], log: Callable[[str], None], keep: str | None = None,
) -> tuple[dict[str, _Call], dict[str, str]]:
    """``calls`` that ran once without an error, and each failing one's error (``Type: first line``): a route a GPU
    refuses (a candidate kernel, an op this torch lacks) is recorded and left out, not the end of its part. ``keep``
    (the baseline) is not tried apart: its error ends the part, as nothing could be compared with it."""
    working: dict[str, _Call] = {}
    errors: dict[str, str] = {}
    for name, call in calls.items():
        if name == keep:
            working[name] = call
            continue
        try:
            call()
        except Exception as err:  # noqa: BLE001  # recorded beside the figures, the others still timed
            errors[name] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
            log(f"  {name} left out: {errors[name]}")
            continue
        working[name] = call
    return working, errors


def timed_rounds(
    calls: dict[str, Callable[[], object]], rounds: int, steps: int, warmup: int, device: torch.device,
    deadline: Deadline, log: Callable[[str], None],
) -> dict[str, list[float]]:
    """Milliseconds per call of every entry in each round: rounds rotate the order, each entry runs
    ``steps`` calls back to back between two CUDA events (a host clock and a sync on the CPU)."""
    cuda = device.type == "cuda"
    for name, call in calls.items():
        for _ in range(warmup):
            call()
    if cuda:
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        if deadline.left() < 0:
            raise OutOfTime(f"after {r} of {rounds} rounds")
        for name in order:
            if cuda:
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                for _ in range(steps):
                    calls[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / steps)
            else:
                t0 = time.perf_counter()
                for _ in range(steps):
                    calls[name]()
                times[name].append(1000 * (time.perf_counter() - t0) / steps)
        order = order[1:] + order[:1]
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f} ms" for n in calls))
    return times


def summarise(times: dict[str, list[float]], baseline: str | None) -> dict[str, Any]:
    """Median and range of each entry's ms, and its paired per-round ratio to ``baseline``."""
    out: dict[str, Any] = {}
    for name, ts in times.items():
        row: dict[str, Any] = {"ms_median": statistics.median(ts), "ms_min": min(ts), "ms_max": max(ts), "ms_per_round": ts}
        if baseline is not None and baseline in times:
            ratios = [t / b for t, b in zip(ts, times[baseline])]
            row.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        out[name] = row
    return out

