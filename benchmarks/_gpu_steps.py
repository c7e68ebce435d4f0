"""The GPU suite's training steps: the shared step set-up, eager and compiled, timed side by side with peak memory.

``Steps`` is ``_training_step.TrainingSteps`` (the set-up ``speed.py`` and ``op_count.py`` use too)
for CutMix + NoAlign and CutMix + TL-Align, with a step per variant, attention route and compiled
adapter; ``compiled_pair`` and ``eager_pair`` time the two side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

from benchmarks._gpu_timing import Deadline, OutOfTime, summarise, timed_rounds
from benchmarks._memory_account import memory_account
from benchmarks._training_step import TrainingSteps, timm_step_refusal

__all__ = ["Steps", "compiled_pair", "dynamo_stats", "eager_pair", "kernel_table", "timed_with_memory"]


class Steps(TrainingSteps):
    """Training steps of one model by CutMix + NoAlign and CutMix + TL-Align (the adapters share its parameters), and
    the bare model's by timm's ``Mixup`` (``timm-cutmix``)."""

    def __init__(self, model_name: str, args: argparse.Namespace) -> None:
        device = torch.device(args.device)
        super().__init__(
            model_name, num_classes=10 if model_name.startswith("example:") else args.num_classes,
            batch_size=args.batch_size, device=device, amp=device.type == "cuda",
            variants=("cutmix", "tlalign", *([] if timm_step_refusal(args.batch_size) else ["timm-cutmix"])),
            strict=True,
        )  # fmt: skip

    def call(self, variant: str, route: Any = None, compiled: Any = None) -> Callable[[], None]:
        """One full training step (mix, forward, loss, backward, AdamW) of ``variant``: ``none`` (no
        mixing), ``cutmix``, ``tlalign`` or ``timm-cutmix``; by an attention ``route``; through ``compiled`` (the
        adapter, or for ``timm-cutmix`` the bare model)."""
        return partial(self.step, variant, route, compiled)

    def peak_mb(self, step: Callable[[], None]) -> float:
        """Peak allocated memory of one more step (CUDA), 0 on the CPU."""
        if self.device.type != "cuda":
            return 0.0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20


@contextlib.contextmanager
def dynamo_stats() -> Iterator[dict[str, int]]:
    """Graphs and graph breaks dynamo made inside the block (its counters, read at exit)."""
    from torch._dynamo.utils import counters

    counters.clear()
    stats: dict[str, int] = {}
    yield stats
    stats["graphs"] = int(counters["stats"]["unique_graphs"])
    stats["graph_breaks"] = int(sum(counters["graph_break"].values()))


def timed_with_memory(
    steps: Steps, calls: dict[str, Callable[[], None]], args: argparse.Namespace, deadline: Deadline,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """``calls`` timed side by side (ratios to ``cutmix``), each row with its peak memory and the ratio of that."""
    summary = summarise(timed_rounds(dict(calls), args.rounds, args.steps, args.warmup, steps.device, deadline, log), "cutmix")
    for name, row in summary.items():
        row["peak_mb"] = steps.peak_mb(calls[name])
    base = summary["cutmix"]["peak_mb"]
    for row in summary.values():
        row["memory_ratio"] = row["peak_mb"] / base if base else float("nan")
    return summary


def compiled_pair(
    steps: Steps, args: argparse.Namespace, deadline: Deadline, log: Callable[[str], None], routes: Sequence[str] = (),
    timm: bool = False,
) -> dict[str, Any]:
    """CutMix + NoAlign and CutMix + TL-Align (the device's route, then each of ``routes``), each adapter
    compiled, timed side by side; with ``timm``, the bare model compiled beside them, mixed by timm's ``Mixup``
    (``timm-cutmix``: timm's own ``--torchcompile`` step). A variant that fails to compile is recorded, the others
    are timed."""
    calls: dict[str, Callable[[], None]] = {}
    info: dict[str, Any] = {}
    for name in ("cutmix", "tlalign", *(f"tlalign/{r}" for r in routes), *(["timm-cutmix"] if timm else [])):
        variant, _, route = name.partition("/")
        if deadline.left() < 0:
            raise OutOfTime("while compiling")
        torch._dynamo.reset()
        module = steps.model if variant == "timm-cutmix" else steps.adapted[variant]
        compiled = torch.compile(module, mode=getattr(args, "compile_mode", None))
        t0 = time.perf_counter()
        try:
            with dynamo_stats() as stats:
                step = steps.call(variant, route or None, compiled=compiled)
                step()
                step()  # a second step: a recompile would show here
        except Exception as err:
            info[name] = {"error": f"{type(err).__name__}: {str(err)[:1500]}"}
            log(f"  compiled {name}: {info[name]['error'][:300]}")
            continue
        info[name] = {"compile_s": time.perf_counter() - t0, **stats}
        log(f"  compiled {name}: {info[name]}")
        calls[name] = step
    if "cutmix" not in calls:
        return info
    timed = timed_with_memory(steps, calls, args, deadline, log)
    profiled(steps, calls, timed, args, log)
    return {**info, **{name: {**info[name], **row} for name, row in timed.items()}}


def profiled(steps: Steps, calls: dict[str, Callable[[], None]], rows: dict[str, Any], args: argparse.Namespace,
             log: Callable[[str], None]) -> None:
    """With ``--profile``: each timed row gains its step's ``kernel_table`` and ``memory_account`` (what one more step
    adds at its peak, and which lines hold it), and the log the top five of each (and, on a GPU, its top five host
    calls)."""
    if not getattr(args, "profile", False):
        return
    for name, step in calls.items():
        table = rows[name]["kernels"] = kernel_table(step, steps.device)
        log(f"  {name}: {table['per_step_ms']:.2f} ms of kernels a step, {table['launches_per_step']:.0f} launches; top: "
            + "; ".join(f"{k['ms_per_step']:.2f} ms {k['name'][:60]}" for k in table["top"][:5]))
        if "host_top" in table:
            log(f"  {name}: {table['host_ms_per_step']:.2f} ms of host calls a step; top: "
                + "; ".join(f"{k['ms_per_step']:.2f} ms {k['calls_per_step']:.0f}x {k['name'][:50]}" for k in table["host_top"][:5]))
        try:  # a diagnostic: its failure is recorded, and the rows timed already are kept
            account = rows[name]["memory_account"] = memory_account(step, steps.device)
        except Exception as err:
            rows[name]["memory_account"] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
            log(f"  {name}: no memory account ({rows[name]['memory_account']['error'][:200]})")
            continue
        log(f"  {name}: {account['step_mb']:.1f} MB added at the step's peak; held by: "
            + "; ".join(f"{s['mb']:.1f} MB {s['site'][:60]}" for s in account["top"][:5]))


def kernel_table(step: Callable[[], object], device: torch.device, steps: int = 5, top: int = 15) -> dict[str, Any]:
    """What ``step`` runs on the device, from the profiler over ``steps`` steps: kernel time and launches a step,
    and the ``top`` kernels by time (on the CPU: its operators by self time). Where a ratio says a step is slower,
    this says which kernels make the difference."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows, host = [], []
    for event in prof.key_averages():
        on_device = getattr(getattr(event, "device_type", None), "name", "") == "CUDA"
        if cuda and not on_device:  # a host call: what the GPU may wait on
            if event.self_cpu_time_total > 0:
                host.append({"name": event.key, "ms_per_step": event.self_cpu_time_total / 1e3 / steps,
                             "calls_per_step": event.count / steps})
            continue
        us = getattr(event, "self_device_time_total", 0.0) if cuda else event.self_cpu_time_total
        if us > 0:
            rows.append({"name": event.key, "ms_per_step": us / 1e3 / steps, "calls_per_step": event.count / steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    host.sort(key=lambda r: -r["ms_per_step"])
    table: dict[str, Any] = {
        "per_step_ms": sum(r["ms_per_step"] for r in rows),
        "launches_per_step": sum(r["calls_per_step"] for r in rows),
        "top": rows[:top],
    }
    if cuda:  # the host's own time by operator and runtime call (self time, so nothing counted twice)
        table["host_ms_per_step"] = sum(r["ms_per_step"] for r in host)
        table["host_top"] = host[:top]
    return table


def eager_pair(
    steps: Steps, args: argparse.Namespace, deadline: Deadline, log: Callable[[str], None], routes: Sequence[str] = (),
) -> dict[str, Any]:
    """CutMix + NoAlign and CutMix + TL-Align (the device's route, then each of ``routes``), eager, side by side."""
    calls = {"cutmix": steps.call("cutmix"), "tlalign": steps.call("tlalign"),
             **{f"tlalign/{r}": steps.call("tlalign", r) for r in routes}}
    timed = timed_with_memory(steps, calls, args, deadline, log)
    profiled(steps, calls, timed, args, log)
    return timed

