"""``op_count.py``'s tables in RESULTS.md: operators per training step by family, eager and compiled, and whether
each family's step compiles whole (``--whole``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._compile_whole import TOLERANCE
from benchmarks._gpu_timing import error_cell
from benchmarks._provenance import later_notes, later_runs, provenance_line

__all__ = ["merge_op_counts", "render_compiled_count", "render_mixer_count", "render_op_count", "render_whole", "summarize_op_count"]


def render_op_count(summary: dict[str, Any]) -> str:
    """Operators per training step by family: CutMix + NoAlign, CutMix + TL-Align, their ratio, the top added."""
    lines = [provenance_line(summary["provenance"]), "",
             "| family | model | CutMix + NoAlign | CutMix + TL-Align | ratio | computing (no views) | ratio | "
             "operators TL-Align adds most |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = summary["families"]
    later, mark_of = later_runs(summary)
    for family, row in rows.items():
        top = ", ".join(f"{op} {n}" for op, n in row["top_added"][:4])
        lines.append(f"| {family}{mark_of(row)} | {row['model']} | {row['cutmix']} | {row['tlalign']} | {row['ratio']:.3f} | "
                     f"{row['cutmix_kernels']} -> {row['tlalign_kernels']} | {row['kernel_ratio']:.3f} | {top} |")
    within = sum(1 for r in rows.values() if r["ratio"] <= 1.25)
    computing = sum(1 for r in rows.values() if r["kernel_ratio"] <= 1.25)
    lines += ["", f"{within} of {len(rows)} families within the goal (the label path adds at most 25% of the operators); "
              f"{computing} counting computing operators alone."]
    return "\n".join(lines + later_notes(later))


def render_compiled_count(summary: dict[str, Any]) -> str:
    """Launches per compiled step by family: CutMix + NoAlign, TL-Align by each compiled label conv route."""
    lines = [provenance_line(summary["provenance"]), "",
             "| family | model | CutMix + NoAlign | TL-Align, label convs as convolutions | ratio | "
             "TL-Align, label convs as shifted sums | ratio | extern convolutions (NoAlign / convs / shifted) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    later, mark_of = later_runs(summary)
    for family, row in summary["families"].items():
        base, conv, shifted = row["cutmix"], row["tlalign/conv"], row["tlalign/shifted"]
        convs = " / ".join(f"{r['extern'].get('convolution', 0):.0f}" for r in (base, conv, shifted))
        lines.append(f"| {family}{mark_of(row)} | {row['model']} | {_launches(base)} | {_launches(conv)} | {row['ratios']['tlalign/conv']:.3f} | "
                     f"{_launches(shifted)} | {row['ratios']['tlalign/shifted']:.3f} | {convs} |")
    return "\n".join(lines + later_notes(later))


def render_whole(summary: dict[str, Any]) -> str:
    """Per family: graphs and breaks of a compiled TL-Align step and the largest differences from eager, or the error
    (the first step's time, the compile's, stays in the JSON: it is the trace's, on whatever else the machine ran)."""
    lines = [provenance_line(summary["provenance"]), "",
             "| family | model | whole | graphs | breaks | target | logits | loss | gradients |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = summary["families"]
    later, mark_of = later_runs(summary)
    for family, row in rows.items():
        if "error" in row:
            lines.append(f"| {family}{mark_of(row)} | {row['model']} | no: {error_cell(row['error'])} | | | | | | |")
            continue
        diffs = " | ".join(f"{row[k]:.1e}" for k in ("target", "logits", "loss", "grad"))
        lines.append(f"| {family}{mark_of(row)} | {row['model']} | {'yes' if row['whole'] else 'no'} | {row['graphs']} | "
                     f"{row['graph_breaks']} | {diffs} |")
    whole = sum(1 for r in rows.values() if r["whole"])
    worst = {k: max((r[k] for r in rows.values() if k in r), default=float("nan")) for k in ("target", "grad")}
    lines += ["", f"{whole} of {len(rows)} families compile whole: one graph, no break, no recompile on the second "
              f"batch, compiled = eager within {TOLERANCE:.0e} (the largest differences: targets {worst['target']:.1e}, "
              f"gradients {worst['grad']:.1e} of their scale)."]
    return "\n".join(lines + later_notes(later))


def render_mixer_count(summary: dict[str, Any]) -> str:
    """Operators one call of every mixer dispatches, on the CPU and on a CUDA batch's path, against timm's ``Mixup``."""
    from benchmarks._mixer_ops import format_mixers

    size = summary.get("size", 224)
    rows = summary["mixers"]
    lines = [provenance_line(summary["provenance"]), "",
             f"One call on a batch of {summary['batch_size']}x3x{size}x{size} (targets included); `/ timm`: the ratio to "
             "timm's batch-mode `Mixup` of the same kind (CutMix or MixUp).", "", format_mixers(rows)]
    ours = {n: r for n, r in rows.items() if n.startswith("ours")}
    within = [n for n, r in ours.items() if r["cuda_kernel_ratio"] <= 1.0]
    syncs = [n for n, r in ours.items() if r["cuda_syncs"]]
    lines += ["", f"{len(within)} of {len(ours)} of our mixers launch at most as many CUDA kernels as timm's `Mixup` "
              f"({', '.join(n.removeprefix('ours ') for n in within) or 'none'}); "
              + (f"host syncs in {', '.join(syncs)}." if syncs else "none reads a value back from the device (no host sync).")]
    return "\n".join(lines)


def _launches(counted: dict[str, Any]) -> str:
    """A compiled step's launches, with how many of them inductor generated."""
    return f"{counted['launches']:.0f} ({counted['kernels']:.0f} generated)"


def summarize_op_count(path: Path) -> tuple[str, dict[str, Any]]:
    """``benchmarks/results/op-count.json`` from ``benchmarks/op_count.py``'s JSON, without the per-operator lists;
    ``op-count-compiled.json`` from its ``--compiled`` JSON and ``op-count-whole.json`` from its ``--whole`` one, as
    they are; a committed summary (``benchmarks/results/op-count*.json``) as it is, to merge onto."""
    result = json.loads(path.read_text())
    if "mixers" in result:  # ``--mixers``, or its committed summary
        return "op-count-mixers", {k: result[k] for k in ("provenance", "batch_size", "size", "mixers") if k in result}
    # a committed summary passed again (``merge_op_counts``) says its kind by its name
    if result.get("whole") or path.stem == "op-count-whole":
        return "op-count-whole", {"provenance": result["provenance"], "batch_size": result["batch_size"],
                                  "families": result["families"]}
    if result.get("compiled") or path.stem == "op-count-compiled":
        return "op-count-compiled", {"provenance": result["provenance"], "batch_size": result["batch_size"],
                                     "families": result["families"]}
    families = {f: {k: v for k, v in row.items() if not k.endswith("_ops")} for f, row in result["families"].items()}
    return "op-count", {"provenance": result["provenance"], "batch_size": result["batch_size"], "families": families}


def merge_op_counts(parts: Sequence[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """One table from several ``op_count.py`` summaries of one kind (eager, ``--compiled`` or ``--whole``) and batch
    size: a later run's rows replace an earlier one's, each row keeping the provenance of the run that counted it
    (marked in the table). The committed ``benchmarks/results/op-count*.json`` is itself such a summary: passed first,
    a run of a few families replaces theirs and keeps the others'."""
    if len(parts) == 1:
        return parts[0]
    name, first = parts[0]
    if name == "op-count-mixers":
        raise ValueError("--add-op-count takes one op_count.py --mixers JSON (its run counts every mixer at once)")
    families: dict[str, Any] = {}
    for other, summary in parts:
        if other != name:
            raise ValueError(f"--add-op-count combines runs of one kind (eager, --compiled or --whole), got {name} and {other}")
        if summary["batch_size"] != first["batch_size"]:
            raise ValueError(f"--add-op-count: the runs counted batches of {first['batch_size']} and "
                             f"{summary['batch_size']}; combine runs of one --batch-size")
        families.update({f: {"provenance": summary["provenance"], **row} for f, row in summary["families"].items()})
    return name, {**first, "families": families}
