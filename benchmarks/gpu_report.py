"""The GPU suite's JSON (``benchmarks/gpu_suite.py``) as text: the suite's closing table and RESULTS' section.

Every figure is read from the JSON as measured: a ratio is the median of the paired per-round
ratios, ``[min, max]`` their range; a part cut short or failed says so instead of a figure.
"""

from __future__ import annotations

from typing import Any

__all__ = ["summary_table", "gpu_section"]


def _ratio(row: dict[str, Any]) -> str:
    if "ratio" not in row:
        return "-"
    return f"{row['ratio']:.3f} [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]"


def _missing(part: dict[str, Any]) -> str | None:
    for key in ("error", "skipped"):
        if key in part:
            return f"{key}: {str(part[key])[:300]}"
    return None


def _rows(table: dict[str, Any], memory: bool = False) -> list[str]:
    lines = []
    for name, row in table.items():
        if not isinstance(row, dict) or "ms_median" not in row:
            continue
        mem = f" | {row['peak_mb']:.0f} | {row.get('memory_ratio', float('nan')):.3f}" if memory else ""
        extra = f" | {row.get('graphs', '-')} | {row.get('graph_breaks', '-')}" if "graphs" in row else (" | - | -" if memory else "")
        lines.append(f"| {name} | {row['ms_median']:.2f} | {_ratio(row)}{mem}{extra} |")
    return lines


def summary_table(result: dict[str, Any]) -> str:
    """A short plain table of every part (what the suite prints last)."""
    return "\n".join(gpu_section(result, heading=False))


def gpu_section(result: dict[str, Any], heading: bool = True) -> list[str]:
    """RESULTS' lines for one suite run: provenance, then a table per part."""
    prov = result.get("provenance", {})
    parts = result.get("parts", {})
    out = ["## The GPU suite (`benchmarks/gpu_suite.py`)", ""] if heading else []
    out += [
        f"Command: `{prov.get('command', '?')}`; {prov.get('date', '?')} to {prov.get('finished', '?')}; "
        f"{result.get('device', '?')}, torch {result.get('torch', '?')}; batch {result.get('batch_size')}, "
        f"{result.get('rounds')} interleaved rounds of {result.get('steps')} steps after warm-up, CUDA events; "
        "ratio = median of the paired per-round ratios [min, max].",
        "",
    ]
    routes = parts.get("routes", {})
    out += ["### Attention with labels, forward + backward, by route (ratio to plain SDPA without labels)", ""]
    out += [_missing(routes) or ""] if _missing(routes) else []
    for shape, table in routes.items():
        if isinstance(table, dict) and "ms_median" not in table:
            out += [f"{shape}:", "", "| route | ms | ratio |", "| --- | --- | --- |", *_rows(table), ""]
    deit = parts.get("deit", {})
    out += ["### DeiT-S training step (ratio to CutMix + NoAlign of the same mode)", ""]
    if _missing(deit):
        out += [_missing(deit) or "", ""]
    for mode in ("eager", "compiled"):
        if mode in deit:
            out += [f"{mode}:", "", "| variant | ms | ratio | peak MB | memory ratio | graphs | breaks |",
                    "| --- | --- | --- | --- | --- | --- | --- |", *_rows(deit[mode], memory=True), ""]
    mixers = parts.get("mixers", {})
    out += ["### Mixers (paired ratio to timm's `Mixup` in batch mode)", ""]
    if _missing(mixers):
        out += [_missing(mixers) or "", ""]
    else:
        out += ["| mixer | ms | ratio to timm |", "| --- | --- | --- |"]
        for name, row in mixers.items():
            if isinstance(row, dict) and "ms_median" in row:
                out.append(f"| {name} | {row['ms_median']:.2f} | {row['paired_ratio']:.3f} "
                           f"[{row['paired_ratio_min']:.3f}, {row['paired_ratio_max']:.3f}] |")
        out.append("")
    tests = parts.get("tests", {})
    out += ["### GPU tests", "", _missing(tests) or f"`{tests.get('command', '?')}`: {tests.get('summary', '?')}", ""]
    families = parts.get("families", {})
    out += ["### Every family's small model, compiled (ratio of CutMix + TL-Align to CutMix + NoAlign)", ""]
    out += ["| family | model | CutMix ms | TL-Align ms | ratio | memory ratio | graphs (TL-Align) | breaks |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for family, row in families.items():
        if not isinstance(row, dict) or family == "seconds":
            continue
        if _missing(row) or "tlalign" not in row:
            out.append(f"| {family} | {row.get('model', '-')} | {_missing(row) or 'not measured'} | | | | | |")
            continue
        t, c = row["tlalign"], row["cutmix"]
        out.append(f"| {family} | {row['model']} | {c['ms_median']:.2f} | {t['ms_median']:.2f} | {_ratio(t)} | "
                   f"{t['memory_ratio']:.3f} | {t.get('graphs', '-')} | {t.get('graph_breaks', '-')} |")
    out.append("")
    return out
