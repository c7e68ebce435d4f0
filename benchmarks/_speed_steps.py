"""Step timing: the img/s, step time and peak memory of every training-step variant, per model or per family.

Variants run interleaved over one model and optimizer (``TrainingSteps``): ``repeats`` rounds, each
running every variant's block of ``steps`` steps back to back in a rotating order; ratios are
paired per round. Memory is measured in a fresh process per variant (``_step_memory``).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
from typing import Any, Callable

from benchmarks import _families
from benchmarks._interleave import interleaved_times, paired
from benchmarks._malloc import minor_faults
from benchmarks._speed_tables import format_families, result_head
from benchmarks._step_memory import measure_memory
from benchmarks._training_step import TrainingSteps
from benchmarks._variants import BASELINE, LABELS

__all__ = ["measure_families", "measure_steps"]


def measure_steps(
    args: argparse.Namespace, progress: Callable[[str], None], refused: dict[str, str] | None = None
) -> dict[str, Any]:
    """Step time of every variant, interleaved: ``repeats`` rounds, each running every variant's
    block of ``steps`` steps back to back in a rotating order; ratios are paired per round.

    A variant whose scheme refuses the model (TransMix on a pooled family) is left out and its
    reason put in ``refused``."""
    bench = TrainingSteps.for_args(args, list(args.variants))
    why = dict(bench.refused)
    for v in args.variants:
        if v not in why:
            try:  # pooled families refuse TransMix when the forward starts
                bench.step(v)
            except ValueError as err:
                why[v] = str(err).splitlines()[0]
    variants = [v for v in args.variants if v not in why]
    for v, reason in why.items():
        progress(f"{LABELS[v]}: refused: {reason}")
    if refused is not None:
        refused.update(why)
    faults: dict[str, list[float]] = {}  # minor page faults per step, per round (glibc's malloc handing pages back)
    times = interleaved_times(
        {v: partial(bench.step, v) for v in variants}, rounds=args.repeats, per_block=args.steps,
        warmup=args.warmup, sync=bench.sync, progress=progress, label="steps: round",
        counter=minor_faults, counts=faults,
    )  # fmt: skip
    memory = {v: measure_memory(v, args, progress) for v in variants}
    summary: dict[str, Any] = {}
    for v, ts in times.items():
        summary[v] = {
            "img_s": args.batch_size / statistics.median(ts),
            "step_ms_median": 1000 * statistics.median(ts),
            "step_ms_min": 1000 * min(ts),
            "step_ms_max": 1000 * max(ts),
            **memory[v],
            "step_s_per_round": ts,
        }
        if faults.get(v):  # where getrusage exists: the faults' median and max over the rounds
            summary[v]["faults_per_step"] = statistics.median(faults[v])
            summary[v]["faults_per_step_max"] = max(faults[v])
    if BASELINE in summary:
        base = summary[BASELINE]
        for v, s in summary.items():
            s["time_ratio"], s["time_ratio_min"], s["time_ratio_max"] = paired(times[v], times[BASELINE])
            s["memory_ratio"] = s["peak_mb"] / base["peak_mb"]
            s["step_memory_ratio"] = s["step_mb"] / base["step_mb"] if base["step_mb"] > 0 else float("nan")
            s["alloc_ratio"] = s["alloc_peak_mb"] / base["alloc_peak_mb"]
            s["alloc_step_ratio"] = s["alloc_step_mb"] / base["alloc_step_mb"]
    return summary



def measure_families(args: argparse.Namespace, progress: Callable[[str], None],
                     save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``measure_steps`` on each asked-for family's model (``_families.family_models()``), one after the other;
    ``save(rows)`` after each (a run cut short keeps the families it measured)."""
    rows: dict[str, Any] = {}
    models = _families.family_models()
    for family in _families.family_names(args.families):
        progress(f"family {family}: {models[family]}")
        fam_args = argparse.Namespace(**{**vars(args), "model": models[family]})
        refused: dict[str, str] = {}
        rows[family] = {"model": models[family], "steps": measure_steps(fam_args, progress, refused), "refused": refused}
        # Each family's row as soon as it is measured: a long run cut short still says something.
        table = format_families({**result_head(args), "families": {family: rows[family]}})
        progress(next(line for line in table.splitlines() if line.startswith(f"| {family} |")))
        if save is not None:
            save(rows)
    return rows

