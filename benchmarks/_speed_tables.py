"""``speed.py``'s results as markdown: the report it prints and writes, and the label-work rows RESULTS shares.

No torch at import: ``benchmarks/report.py`` renders the same rows from the committed summaries.
"""

from __future__ import annotations

import argparse
import math
import platform
from typing import Any

from benchmarks._gpu_timing import error_cell
from benchmarks._variants import BASELINE, LABELS

__all__ = ["FAULTS_NOTE", "LABEL_WORK_HEADER", "describe_device", "family_cells", "family_header", "fault_cell", "fmt",
           "format_families", "format_label_families", "format_report", "label_work_row", "malloc_note",
           "recorded_malloc_note", "result_head"]


def describe_device(device: str) -> str:
    """The device a run measured on, as the report's first line: the GPU or CPU, threads, torch (and CUDA)."""
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def fmt(x: float, digits: int) -> str:
    """``x`` with ``digits`` decimals; ``-`` for a missing or NaN figure."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


LABEL_WORK_HEADER = ("| family | model | CutMix step ms | forward ms NoAlign / TL-Align | label work ms | share of step "
                     "| top added operators |", "| --- | --- | ---: | ---: | ---: | ---: | --- |")


def label_work_row(family: str, row: dict[str, Any], mark: str = "") -> str:
    """One family's row of the label-work table (``speed.py --families --label-profile``), as RESULTS and the
    benchmark's own report print it."""
    lab = row["labels"]
    if "refused" in lab:
        return f"| {family}{mark} | `{row['model']}` | refused | | | | {lab['refused']} |"
    fwd = lab["forward_ms"]
    ops = ", ".join(f"{str(name).removeprefix('aten::')} {ms:+.1f} ({calls:+d})" for name, ms, calls in lab["top_ops"])
    return (f"| {family}{mark} | `{row['model']}` | {fmt(lab['step_ms'], 0)} | {fmt(fwd['cutmix'], 1)} / "
            f"{fmt(fwd['tlalign'], 1)} | {fmt(lab['label_ms'], 1)} [{fmt(lab['label_ms_min'], 1)}, "
            f"{fmt(lab['label_ms_max'], 1)}] | {fmt(100 * lab['label_share'], 1)}% | {ops} |")


def format_label_families(result: dict[str, Any]) -> str:
    """The ``--families --label-profile`` report: per family, the label work of the forward."""
    cfg = result["config"]
    lines = [
        f"device: {result['device']}", f"command: {result['command']}", "",
        f"Per family: batch {cfg['batch_size']}, default input size; forward ms (no grad, train mode, median of "
        f"{cfg['repeats']} interleaved rounds of {cfg['steps']}); label work = TL-Align forward - NoAlign forward "
        "(median [min, max] of the paired rounds), its share of the CutMix + NoAlign training step; the operators "
        "adding the most self CPU time (profiler, TL-Align minus NoAlign, median of the paired profiles; the calls "
        "each adds per forward)",
        "",
        *LABEL_WORK_HEADER,
    ]
    lines += [label_work_row(family, row) for family, row in result["families"].items()]
    return "\n".join(lines + recorded_malloc_note(cfg))


def result_head(args: argparse.Namespace) -> dict[str, Any]:
    """What ``format_families`` reads besides the rows."""
    return {"device": describe_device(args.device), "command": "", "config": {"variants": args.variants,
            "batch_size": args.batch_size, "repeats": args.repeats, "steps": args.steps,
            "malloc": getattr(args, "malloc", "default")}}


FAULTS_NOTE = ("page faults a step: minor page faults per training step (median over the rounds; getrusage), in the "
               "order of the variants, baseline first: memory glibc's malloc handed back to the kernel and the step "
               "faulted in again, one 4 KiB page at a time, a cost of the allocator's state, not of the work.")


def malloc_note(cfg: dict[str, Any]) -> str:
    """How the timing process's malloc was set (``speed.py --malloc``)."""
    if cfg.get("malloc") == "keep":
        return ("malloc: kept heap (`--malloc keep`: glibc serves every size from its heap and never trims it, so "
                "after warm-up a step reuses pages already faulted in).")
    return "malloc: glibc's default (blocks over its threshold mapped and unmapped, heap top trimmed)."


def recorded_malloc_note(cfg: dict[str, Any]) -> list[str]:
    """``malloc_note`` as a paragraph of a table's notes for a run that recorded its ``--malloc`` setting; none for a
    run from before the option (which ran on glibc's default and did not say so)."""
    return ["", malloc_note(cfg)] if "malloc" in cfg else []


def fault_cell(row: dict[str, Any], variants: list[str]) -> str:
    """A family's faults a step, one figure per variant in ``variants`` (``-``: refused, or not recorded)."""
    figures = []
    for v in variants:
        s = row["steps"].get(v)
        figures.append("-" if s is None or "faults_per_step" not in s else _count(s["faults_per_step"]))
    return " / ".join(figures)


def _count(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def family_header(variants: list[str], model: str, faults: bool) -> list[str]:
    """The per-family table's header and rule: family, ``model``'s column title, each variant's time and allocator
    ratios, and the faults a step where ``faults`` (the printed report and RESULTS share it)."""
    return ["| family | " + model + " | " + " | ".join(f"{LABELS[v]} time | alloc peak | alloc step" for v in variants)
            + (" | page faults a step" if faults else "") + " |",
            "| --- | --- |" + " ---: | ---: | ---: |" * len(variants) + (" ---: |" if faults else "")]


def family_cells(row: dict[str, Any], variants: list[str], faults: bool) -> list[str]:
    """A family's cells after its model cell: per variant its paired time ratio (median [min, max]) and its alloc
    peak and alloc step ratios (``refused`` where the scheme refused the model), then the faults a step of the
    baseline and every variant where ``faults`` (the printed report and RESULTS share it)."""
    cells = []
    for v in variants:
        s = row["steps"].get(v)
        cells.append("refused | - | -" if s is None else
                     f"{fmt(s['time_ratio'], 3)} [{fmt(s['time_ratio_min'], 3)}, {fmt(s['time_ratio_max'], 3)}] | "
                     f"{fmt(s.get('alloc_ratio'), 4)} | {fmt(s.get('alloc_step_ratio'), 4)}")
    if faults:
        cells.append(fault_cell(row, [BASELINE, *variants]))
    return cells


def format_families(result: dict[str, Any]) -> str:
    """The ``--families`` report: per family, each variant's time and allocator peaks as ratios to the baseline."""
    cfg = result["config"]
    variants = [v for v in cfg["variants"] if v != BASELINE]
    lines = [
        f"device: {result['device']}", f"command: {result['command']}", "",
        f"Per family: batch {cfg['batch_size']}, default input size, {cfg['repeats']} interleaved repeats x "
        f"{cfg['steps']} steps; time = paired per-repeat ratio to {LABELS[BASELINE]} (median [min, max]); "
        "alloc peak = ratio of the allocator's peak live bytes (model, optimizer state, batch and step); "
        "alloc step = ratio of what the step adds on top",
        "",
        *family_header(variants, "model", faults=True),
    ]
    for family, row in result["families"].items():
        base = row["steps"][BASELINE]
        lines.append(f"| {family} | {row['model']} ({fmt(base['step_ms_median'], 0)} ms) | "
                     + " | ".join(family_cells(row, variants, faults=True)) + " |")
    return "\n".join(lines + ["", FAULTS_NOTE, malloc_note(cfg)])


def format_report(result: dict[str, Any]) -> str:
    """The report of one model: the training-step table, the mixer table, or both."""
    lines = [f"device: {result['device']}", f"command: {result['command']}", ""]
    if "steps" in result:
        cfg = result["config"]
        lines += [
            f"Training step, {cfg['model']}, batch {cfg['batch_size']}, {cfg['repeats']} interleaved repeats "
            f"x {cfg['steps']} steps (median; ratio = paired per-repeat ratio to {LABELS[BASELINE]}, median [min, max])",
            "",
            "| variant | img/s | step ms (median [min, max]) | time ratio | peak MB | memory ratio "
            "| step MB | step memory ratio | alloc peak MB | alloc ratio | alloc step MB | alloc step ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for v, s in result["steps"].items():
            ratio = (
                f"{s['time_ratio']:.3f} [{s['time_ratio_min']:.3f}, {s['time_ratio_max']:.3f}]"
                if "time_ratio" in s
                else "-"
            )
            mem = f"{s['memory_ratio']:.3f}" if "memory_ratio" in s else "-"
            step_mem = f"{s['step_memory_ratio']:.3f}" if "step_memory_ratio" in s else "-"
            alloc = f"{s['alloc_ratio']:.4f}" if "alloc_ratio" in s else "-"
            alloc_step = f"{s['alloc_step_ratio']:.4f}" if "alloc_step_ratio" in s else "-"
            lines.append(
                f"| {LABELS[v]} | {s['img_s']:.1f} | {s['step_ms_median']:.1f} [{s['step_ms_min']:.1f}, "
                f"{s['step_ms_max']:.1f}] | {ratio} | {s['peak_mb']:.0f} | {mem} | {s['step_mb']:.0f} | {step_mem} "
                f"| {s['alloc_peak_mb']:.1f} | {alloc} | {s['alloc_step_mb']:.1f} | {alloc_step} |"
            )
        lines += [
            "",
            "peak MB: peak RSS during the training steps (CPU; the peak is reset after imports and set-up) or "
            "max_memory_allocated (CUDA), one fresh process per variant; step MB: what the steps add on top of the "
            "model, optimizer state and batch. alloc peak MB / alloc step MB: the same in live bytes of torch's "
            "CPU allocator (torch.profiler allocation events replayed in time order; on CUDA the same as peak MB / "
            "step MB).",
        ]
        lines += [f"{LABELS[v]}: not measured, the scheme refuses this model: {why}" for v, why in result.get("refused", {}).items()]
        lines.append("")
    if "mixers" in result:
        cfg = result["config"]
        lines += [
            f"Mixer cost per batch of {cfg['mixer_batch']}x3x{cfg['mixer_size']}x{cfg['mixer_size']} "
            f"(targets included; {cfg['mixer_repeats']} interleaved repeats of {cfg['mixer_calls']} calls; "
            "paired ratio = per-repeat ratio to timm's batch mode of the same kind, median [min, max])",
            "",
            "| mixer | ms (median [min, max]) | paired ratio to timm batch mode | ratio of medians |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, s in result["mixers"].items():
            if "error" in s:
                lines.append(f"| {name} | left out: {error_cell(s['error'])} | - | - |")
                continue
            lines.append(
                f"| {name} | {s['ms_median']:.2f} [{s['ms_min']:.2f}, {s['ms_max']:.2f}] | {s['paired_ratio']:.2f} "
                f"[{s['paired_ratio_min']:.2f}, {s['paired_ratio_max']:.2f}] | {s['ratio_to_timm_batch']:.2f} |"
            )
    return "\n".join(lines + recorded_malloc_note(result["config"]))

