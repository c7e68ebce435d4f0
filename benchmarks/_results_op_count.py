"""``op_count.py``'s tables in RESULTS.md: operators per training step by family, eager and compiled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks._provenance import provenance_line

__all__ = ["render_compiled_count", "render_op_count", "summarize_op_count"]


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


def _launches(counted: dict[str, Any]) -> str:
    """A compiled step's launches, with how many of them inductor generated."""
    return f"{counted['launches']:.0f} ({counted['kernels']:.0f} generated)"


def summarize_op_count(path: Path) -> tuple[str, dict[str, Any]]:
    """``benchmarks/results/op-count.json`` from ``benchmarks/op_count.py``'s JSON, without the per-operator lists;
    ``op-count-compiled.json`` from its ``--compiled`` JSON, as it is."""
    result = json.loads(path.read_text())
    if result.get("compiled"):
        return "op-count-compiled", {"provenance": result["provenance"], "batch_size": result["batch_size"],
                                     "families": result["families"]}
    families = {f: {k: v for k, v in row.items() if not k.endswith("_ops")} for f, row in result["families"].items()}
    return "op-count", {"provenance": result["provenance"], "batch_size": result["batch_size"], "families": families}

