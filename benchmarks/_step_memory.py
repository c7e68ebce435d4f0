"""Peak memory of a training step: peak RSS or ``max_memory_allocated``, and the live bytes of torch's CPU allocator.

Every variant's memory is measured in its own process (``speed.py --worker VARIANT``), so that CPU
peak memory is that process's peak RSS. RSS (glibc arenas, pages) swings by a few percent between
processes, so on CPU the peak of live bytes in torch's CPU allocator is measured too: the
profiler's allocation events of a fresh model, optimizer and batch and of its steps, replayed in
time order (``allocator_peak``).
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import torch

from benchmarks._training_step import TrainingSteps
from benchmarks._variants import LABELS

__all__ = ["AllocPeak", "allocator_peak", "measure_memory", "memory_worker", "replay_to_peak"]

T = TypeVar("T")

SPEED_SCRIPT = Path(__file__).resolve().parent / "speed.py"  # runs memory_worker with --worker


def _proc_status_mb(field: str) -> float:
    """A memory field of ``/proc/self/status`` (Linux), MB: ``VmRSS`` now, ``VmHWM`` the peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}; CPU peak memory needs Linux")


def _reset_peak_rss() -> None:
    """Reset the process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


ALLOCATOR_DEVICES = frozenset({"cpu", "mkldnn", "ideep"})  # what torch's profiler counts as CPU memory
WINDOW = "speed.allocator_peak.window"


@dataclass(frozen=True)
class AllocPeak:
    """Live bytes of torch's CPU allocator around a window of code, replayed from profiler events.

    Only blocks allocated while the profiler ran are known to it: ``start_bytes`` counts
    those still live when the window starts, not what was allocated before profiling.
    """

    start_bytes: int  # live when the window starts
    peak_bytes: int  # the most live at once during the window (>= start_bytes)
    top: dict[str, int]  # bytes allocated in the window and live at its peak, by allocating op, largest first

    @property
    def step_bytes(self) -> int:
        """What the window adds at its peak on top of what was live when it started."""
        return self.peak_bytes - self.start_bytes


@dataclass(frozen=True)
class _Alloc:
    time_ns: int
    ptr: int
    size: int  # negative: a free
    op: str


def _op_label(event: torch._C._profiler._ProfilerEvent) -> str:
    """``outermost op > innermost op`` of an allocation (ops inside the window annotation only)."""
    names: list[str] = []
    parent = event.parent
    while parent is not None and parent.name != WINDOW:
        names.append(parent.name)
        parent = parent.parent
    if not names:
        return "(no op)"
    return names[-1] if len(names) == 1 else f"{names[-1]} > {names[0]}"


def allocator_peak(window: Callable[[], None], before: Callable[[], None] = lambda: None, top: int = 8) -> AllocPeak:
    """Peak live bytes of torch's CPU allocator while ``window`` runs (what ``max_memory_allocated`` is on CUDA).

    Both callables run under ``torch.profiler`` with ``profile_memory=True``; its allocation
    events (size, negative for a free, and a timestamp) are replayed in time order. The
    profiler does not report the free of a block allocated before it started, so whatever
    ``window`` may free (the previous step's gradients and activations) has to be allocated
    by ``before``, under the profiler too.

    Args:
        window: the code whose peak is wanted, e.g. one training step.
        before: run first, e.g. building the model and a warm-up step.
        top: how many allocating ops to keep in ``AllocPeak.top``.

    Returns:
        An ``AllocPeak``; e.g. a window that allocates 10 MB, frees it and allocates 4 MB
        has ``step_bytes == 10_000_000``.
    """
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch._C._profiler import _EventType

    # no record_shapes: the replay needs sizes and op names alone, and recording shapes grew the process by more
    # than a step's activations per step (ConvMixer-768/32 at batch 2: +1.3 GB a profiled step, +0.2 without),
    # which took its batch-8 memory run past this machine's 24 GB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False, with_stack=False) as prof:
        before()
        with record_function(WINDOW):
            window()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("the profiler recorded nothing")
    allocs: list[_Alloc] = []
    span: tuple[int, int] | None = None
    stack = list(results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.TorchOp and event.name == WINDOW:
            span = (event.start_time_ns, event.end_time_ns)
        elif event.tag == _EventType.Allocation:
            fields = event.extra_fields
            assert isinstance(fields, torch._C._profiler._ExtraFields_Allocation)
            if fields.device.type in ALLOCATOR_DEVICES:
                allocs.append(_Alloc(event.start_time_ns, fields.ptr, fields.alloc_size, _op_label(event)))
    if span is None:
        raise RuntimeError(f"the profiler recorded no {WINDOW!r} annotation")
    allocs.sort(key=lambda a: a.time_ns)
    start = sum(a.size for a in allocs if a.time_ns < span[0])
    inside = [(a.ptr, a.size, a.op) for a in allocs if span[0] <= a.time_ns <= span[1]]
    peak, by_op = replay_to_peak(inside, lambda op: op, start, top)
    return AllocPeak(start_bytes=start, peak_bytes=peak, top=by_op)


def replay_to_peak(
    events: Sequence[tuple[int, int, T]], label: Callable[[T], str], start: int = 0, top: int = 8,
) -> tuple[int, dict[str, int]]:
    """Allocator events replayed in order: the most bytes live at once, and the blocks live at that point by label.

    Args:
        events: ``(address, size, what)``, the size negative for a free (a free of a block allocated before the
            events lowers the count: it frees what was live at the start).
        label: names a block by its ``what`` (an operator, a stack), called for the blocks live at the peak only.
        start: bytes live before the first event.
        top: how many labels to return, largest first.

    Returns:
        ``(peak, labels)``: at least ``start``; and the bytes of the blocks allocated in ``events`` and live at the
        peak, summed by ``label``.
    """
    live, peak, at_peak = start, start, 0
    for i, (_, size, _) in enumerate(events, 1):
        live += size
        if live > peak:
            peak, at_peak = live, i
    owners: dict[int, tuple[int, T]] = {}  # replayed again up to the peak: who holds the bytes there
    for ptr, size, what in events[:at_peak]:
        if size > 0:
            owners[ptr] = (size, what)
        else:
            owners.pop(ptr, None)
    by_label: Counter[str] = Counter()
    for size, what in owners.values():
        by_label[label(what)] += size
    return peak, dict(by_label.most_common(top))


def memory_worker(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: peak memory of ``args.warmup`` training steps of one variant.

    ``peak_mb`` is the peak during the training steps: the process's peak RSS (CPU;
    reset after set-up, so imports and model building do not count) or
    ``max_memory_allocated`` (CUDA). ``step_mb`` is what the steps add on top of the
    model, optimizer state and batch already in memory: the part alignment can change.

    ``alloc_peak_mb`` and ``alloc_step_mb`` are the same two figures counted in live
    bytes of torch's allocator instead of pages (on CUDA they are ``peak_mb`` and
    ``step_mb``). On CPU they come from ``allocator_peak`` over a second, fresh
    model, optimizer and batch, built, set up and warmed up under the profiler (so
    that every block they hold is known to it) once the RSS figures are taken (the
    profiler's own buffers would count in RSS); ``alloc_top_mb`` says which ops hold
    the step's bytes at the peak. In this process rather than the parent: the
    parent's model carries every variant's adapter.
    """
    bench = TrainingSteps.for_args(args, [variant])
    bench.step(variant)  # creates the optimizer state, so it counts as set-up
    bench.sync()
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)
        before = torch.cuda.memory_allocated(bench.device) / 2**20
    else:
        gc.collect()
        before = _proc_status_mb("VmRSS")
        _reset_peak_rss()
    for _ in range(max(1, args.warmup)):
        bench.step(variant)
    bench.sync()
    if bench.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(bench.device) / 2**20
    else:
        peak = _proc_status_mb("VmHWM")
    result: dict[str, Any] = {"peak_mb": peak, "step_mb": max(0.0, peak - before)}
    if bench.device.type == "cuda":
        return result | {"alloc_peak_mb": result["peak_mb"], "alloc_step_mb": result["step_mb"], "alloc_top_mb": {}}
    del bench
    gc.collect()
    fresh: list[TrainingSteps] = []

    def set_up() -> None:
        fresh.append(TrainingSteps.for_args(args, [variant]))
        for _ in range(1 + max(1, args.warmup)):  # optimizer state, then warm-up
            fresh[0].step(variant)

    alloc = allocator_peak(lambda: fresh[0].step(variant), set_up)
    return result | {
        "alloc_peak_mb": alloc.peak_bytes / 2**20,
        "alloc_step_mb": alloc.step_bytes / 2**20,
        "alloc_top_mb": {op: n / 2**20 for op, n in alloc.top.items()},
    }


def measure_memory(variant: str, args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run ``memory_worker`` for one variant in its own subprocess (a clean peak RSS)."""
    progress(f"memory: {LABELS[variant]}")
    cmd = [sys.executable, str(SPEED_SCRIPT), "--worker", variant, "--device", args.device,
           "--model", args.model, "--batch-size", str(args.batch_size), "--warmup", str(args.warmup),
           "--num-classes", str(args.num_classes), "--threads", str(torch.get_num_threads())]
    if getattr(args, "pixel_boxes", False):
        cmd.append("--pixel-boxes")
    if not args.amp:
        cmd.append("--no-amp")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the memory run of {variant} on {args.model} {_how_it_ended(proc.returncode)}:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def _how_it_ended(returncode: int) -> str:
    """A failed subprocess's end in words: a signal by name, and what a SIGKILL without a traceback usually is."""
    if returncode >= 0:
        return f"failed (exit status {returncode})"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if name == "SIGKILL":
        return ("was killed (SIGKILL), most likely by the kernel's out-of-memory killer (dmesg says): the model is too "
                "big for this machine's memory at this batch size; use a smaller --batch-size or leave the family out")
    return f"was killed by {name}"
