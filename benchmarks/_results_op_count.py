"""``op_count.py``'s tables in RESULTS.md: operators per training step by family, eager and compiled, and whether
each family's step compiles whole (``--whole``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks._compile_whole import TOLERANCE
from benchmarks._gpu_timing import error_cell
from benchmarks._provenance import provenance_line

__all__ = ["render_compiled_count", "render_op_count", "render_whole", "summarize_op_count"]


def render_op_count(summary: dict[str, Any]) -> str:
    """Operators per training step by family: CutMix + NoAlign, CutMix + TL-Align, their ratio, the top added."""
    lines = [provenance_line(summary["provenance"]), "",
             "| family | model | CutMix + NoAlign | CutMix + TL-Align | ratio | computing (no views) | ratio | "
             "operators TL-Align adds most |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = summary["families"]
    for family, row in rows.items():
        top = ", ".join(f"{op} {n}" for op, n in row["top_added"][:4])
        lines.append(f"| {family} | {row['model']} | {row['cutmix']} | {row['tlalign']} | {row['ratio']:.3f} | "
                     f"{row['cutmix_kernels']} -> {row['tlalign_kernels']} | {row['kernel_ratio']:.3f} | {top} |")
    within = sum(1 for r in rows.values() if r["ratio"] <= 1.25)
    computing = sum(1 for r in rows.values() if r["kernel_ratio"] <= 1.25)
    lines += ["", f"{within} of {len(rows)} families within the goal (the label path adds at most 25% of the operators); "
              f"{computing} counting computing operators alone."]
    return "\n".join(lines)


def render_compiled_count(summary: dict[str, Any]) -> str:
    """Launches per compiled step by family: CutMix + NoAlign, TL-Align by each compiled label conv route."""
    lines = [provenance_line(summary["provenance"]), "",
             "| family | model | CutMix + NoAlign | TL-Align, label convs as convolutions | ratio | "
             "TL-Align, label convs as shifted sums | ratio | extern convolutions (NoAlign / convs / shifted) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for family, row in summary["families"].items():
        base, conv, shifted = row["cutmix"], row["tlalign/conv"], row["tlalign/shifted"]
        convs = " / ".join(f"{r['extern'].get('convolution', 0):.0f}" for r in (base, conv, shifted))
        lines.append(f"| {family} | {row['model']} | {_launches(base)} | {_launches(conv)} | {row['ratios']['tlalign/conv']:.3f} | "
                     f"{_launches(shifted)} | {row['ratios']['tlalign/shifted']:.3f} | {convs} |")
    return "\n".join(lines)


def render_whole(summary: dict[str, Any]) -> str:
    """Per family: graphs and breaks of a compiled TL-Align step and the largest differences from eager, or the error
    (the first step's time, the compile's, stays in the JSON: it is the trace's, on whatever else the machine ran)."""
    lines = [provenance_line(summary["provenance"]), "",
             "| family | model | whole | graphs | breaks | target | logits | loss | gradients |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = summary["families"]
    for family, row in rows.items():
        if "error" in row:
            lines.append(f"| {family} | {row['model']} | no: {error_cell(row['error'])} | | | | | | |")
            continue
        diffs = " | ".join(f"{row[k]:.1e}" for k in ("target", "logits", "loss", "grad"))
        lines.append(f"| {family} | {row['model']} | {'yes' if row['whole'] else 'no'} | {row['graphs']} | "
                     f"{row['graph_breaks']} | {diffs} |")
    whole = sum(1 for r in rows.values() if r["whole"])
    worst = {k: max((r[k] for r in rows.values() if k in r), default=float("nan")) for k in ("target", "grad")}
    lines += ["", f"{whole} of {len(rows)} families compile whole: one graph, no break, no recompile on the second "
              f"batch, compiled = eager within {TOLERANCE:.0e} (the largest differences: targets {worst['target']:.1e}, "
              f"gradients {worst['grad']:.1e} of their scale)."]
    return "\n".join(lines)


def _launches(counted: dict[str, Any]) -> str:
    """A compiled step's launches, with how many of them inductor generated."""
    return f"{counted['launches']:.0f} ({counted['kernels']:.0f} generated)"


def summarize_op_count(path: Path) -> tuple[str, dict[str, Any]]:
    """``benchmarks/results/op-count.json`` from ``benchmarks/op_count.py``'s JSON, without the per-operator lists;
    ``op-count-compiled.json`` from its ``--compiled`` JSON and ``op-count-whole.json`` from its ``--whole`` one, as
    they are."""
    result = json.loads(path.read_text())
    if result.get("whole"):
        return "op-count-whole", {"provenance": result["provenance"], "batch_size": result["batch_size"],
                                  "families": result["families"]}
    if result.get("compiled"):
        return "op-count-compiled", {"provenance": result["provenance"], "batch_size": result["batch_size"],
                                     "families": result["families"]}
    families = {f: {k: v for k, v in row.items() if not k.endswith("_ops")} for f, row in result["families"].items()}
    return "op-count", {"provenance": result["provenance"], "batch_size": result["batch_size"], "families": families}

