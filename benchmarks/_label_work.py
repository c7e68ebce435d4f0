"""Where the label work goes (``speed.py --families --label-profile``): per family, TL-Align's forward against NoAlign's.

No grad, train mode, interleaved rounds; their difference is the label work (labels carry no
gradient, so the backward does the same work), given with its share of a CutMix + NoAlign training
step and the operators that add the most time (``torch.profiler`` self CPU time, TL-Align's
forward minus NoAlign's).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
from typing import Any, Callable

import torch

from benchmarks import _families
from benchmarks._interleave import interleaved_times
from benchmarks._speed_tables import format_label_families, result_head
from benchmarks._training_step import TrainingSteps

__all__ = ["measure_label_families", "measure_label_work"]


def _op_times(call: Callable[[], object], iters: int) -> dict[str, tuple[float, int]]:
    """Self CPU ms and calls per ``call`` of every operator it runs (``torch.profiler``), over ``iters`` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            call()
    return {e.key: (e.self_cpu_time_total / 1000 / iters, e.count // iters) for e in prof.key_averages()}


def measure_label_work(args: argparse.Namespace, progress: Callable[[str], None], top: int = 4) -> dict[str, Any]:
    """The label work of TL-Align on ``args.model``: forward with TL-Align minus forward with NoAlign (no grad, train
    mode, one CutMix batch, interleaved rounds), its share of a CutMix + NoAlign training step, and the ``top``
    operators by added self CPU time (median over ``args.repeats`` interleaved profiles: the model's own operators
    swing by several percent between profiles, which a single difference would read as label work), with the calls
    they add."""
    bench = TrainingSteps.for_args(args, ["cutmix", "tlalign"])
    if "tlalign" in bench.refused:
        return {"refused": bench.refused["tlalign"]}
    mixed, label_map = bench.mixer(bench.images, bench.labels)

    def forward(variant: str) -> None:
        with torch.no_grad(), torch.autocast(bench.device.type, dtype=torch.bfloat16, enabled=bench.amp):
            bench.adapted[variant](mixed, label_map)

    steps = interleaved_times({"step": partial(bench.step, "cutmix")}, rounds=args.repeats, per_block=args.steps,
                              warmup=args.warmup, sync=bench.sync, progress=progress, label="CutMix steps: round")
    fwd = interleaved_times({v: partial(forward, v) for v in ("cutmix", "tlalign")}, rounds=args.repeats,
                            per_block=args.steps, warmup=args.warmup, sync=bench.sync, progress=progress,
                            label="forwards: round")
    diffs = [1000 * (t - c) for t, c in zip(fwd["tlalign"], fwd["cutmix"])]
    profiles: dict[str, list[dict[str, tuple[float, int]]]] = {"cutmix": [], "tlalign": []}
    for r in range(args.repeats):
        progress(f"profiles: round {r + 1}/{args.repeats}")
        for v in ("cutmix", "tlalign") if r % 2 == 0 else ("tlalign", "cutmix"):
            profiles[v].append(_op_times(partial(forward, v), args.steps))
    keys = {k for p in profiles["tlalign"] + profiles["cutmix"] for k in p}

    def added(key: str) -> tuple[float, int]:
        ms = statistics.median(t.get(key, (0.0, 0))[0] - c.get(key, (0.0, 0))[0]
                               for t, c in zip(profiles["tlalign"], profiles["cutmix"]))
        return ms, profiles["tlalign"][0].get(key, (0.0, 0))[1] - profiles["cutmix"][0].get(key, (0.0, 0))[1]

    ranked = sorted(((*added(k), k) for k in keys), reverse=True)
    step_ms = 1000 * statistics.median(steps["step"])
    label_ms = statistics.median(diffs)
    return {
        "step_ms": step_ms,
        "forward_ms": {v: 1000 * statistics.median(ts) for v, ts in fwd.items()},
        "label_ms": label_ms, "label_ms_min": min(diffs), "label_ms_max": max(diffs),
        "label_share": label_ms / step_ms,
        "top_ops": [[name, ms, calls] for ms, calls, name in ranked[:top]],
    }


def measure_label_families(args: argparse.Namespace, progress: Callable[[str], None],
                           save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``measure_label_work`` for every family asked for (``save(rows)`` after each, as ``_speed_steps.measure_families``)."""
    rows: dict[str, Any] = {}
    models = _families.family_models()
    for family in _families.family_names(args.families):
        progress(f"family {family}: {models[family]}")
        fam_args = argparse.Namespace(**{**vars(args), "model": models[family]})
        rows[family] = {"model": models[family], "labels": measure_label_work(fam_args, progress)}
        table = format_label_families({**result_head(args), "families": {family: rows[family]}})
        progress(next(line for line in table.splitlines() if line.startswith(f"| {family} |")))
        if save is not None:
            save(rows)
    return rows

