"""The alignment analysis' tables in RESULTS.md (``alignment_analysis.py``): per-block errors and target RMSEs."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._provenance import current_command, provenance_line

__all__ = ["render_analysis", "render_rmse", "summarize_analysis", "summarize_rmse"]

_SCHEME_NAMES = {"cutmix": "CutMix (area lambda)", "transmix": "TransMix", "token_labeling": "TokenLabeling (own area)",
                 "tl_align": "TL-Align"}


def summarize_analysis(path: Path) -> tuple[str, dict[str, Any]]:
    """``(section name, summary)`` of an ``alignment_analysis.py`` JSON: the model, the per-block errors, the RMSEs."""
    numbers = json.loads(path.read_text())
    if "provenance" not in numbers:
        raise ValueError(f"{path} has no provenance (written before the analysis recorded it): run "
                         "alignment_analysis.py again")
    cfg = numbers["config"]
    if not cfg.get("checkpoint") and cfg.get("sharpen", 1.0) == 1.0:
        raise ValueError(f"{path} is a random-init run without --sharpen: its attention is nearly uniform, so it "
                         "shows nothing RESULTS.md keeps; add a --sharpen S or a --checkpoint run")
    name = "analysis-trained" if cfg.get("checkpoint") else "analysis-sharpened"
    curves = numbers["per_block_sample0"]
    summary = {"kind": "analysis", "provenance": numbers["provenance"], "config": cfg, "model": numbers["model"],
               "initialisation": numbers["initialisation"], "grid": numbers["grid"],
               "images": len(numbers["classes"]), "rmse": numbers["rmse"],
               "mean_abs_error_vs_similarity": curves["mean_abs_error_vs_similarity"],
               "rmse_by_size": [{k: v for k, v in b.items() if k in ("label", "kind", "rmse")}
                                for b in numbers["rmse_by_size"]]}
    return name, summary


def summarize_rmse(items: Sequence[tuple[str, Path]]) -> tuple[str, dict[str, Any]]:
    """``("analysis-finetune", summary)``: the CutMix-vs-TL-Align target RMSE of several analysed checkpoints.

    ``items``: ``(label, analysis.json)`` pairs, e.g. a model trained from scratch, the finetune
    profile's base model and a cell fine-tuned from it, analysed on the same images.
    """
    rows = []
    for label, path in items:
        name, one = summarize_analysis(path)
        if name != "analysis-trained":
            raise ValueError(f"{path} analysed a random-init model: --add-rmse compares trained checkpoints")
        rows.append({"label": label, "checkpoint": one["config"]["checkpoint"], "model": one["model"],
                     "images": one["images"], "grid": one["grid"], "rmse": one["rmse"],
                     "last_block_error": {k: v[-1] for k, v in one["mean_abs_error_vs_similarity"].items()},
                     "provenance": one["provenance"]})
    if not rows:
        raise ValueError("--add-rmse needs at least one LABEL=analysis.json")
    return "analysis-finetune", {"kind": "rmse", "provenance": rows[0]["provenance"], "rows": rows}


def render_rmse(summary: dict[str, Any]) -> str:
    """One row per analysed checkpoint: how far TL-Align's targets moved from the area (CutMix) targets."""
    lines = ["| model | images | RMSE(CutMix, TL-Align targets) | last block: mean abs error to the similarity ratio, "
             "CutMix / TL-Align | command |", "| --- | ---: | ---: | ---: | --- |"]
    for r in summary["rows"]:
        err = r["last_block_error"]
        lines.append(f"| {r['label']} | {r['images']} | {r['rmse']:.4f} | {err.get('cutmix', math.nan):.3f} / "
                     f"{err.get('tl_align', math.nan):.3f} | `{current_command(r['provenance'].get('command', 'unknown'))}` |")
    dates = sorted({str(r["provenance"].get("date")) for r in summary["rows"]})
    return "\n".join([provenance_line(summary["provenance"]), "", f"Analysed {', '.join(dates)}.", "", *lines])


def render_analysis(summary: dict[str, Any]) -> str:
    """Each scheme's mean |ratio - similarity ratio| per block, and the RMSE of CutMix vs TL-Align targets."""
    errors: dict[str, list[float]] = summary["mean_abs_error_vs_similarity"]
    blocks = len(next(iter(errors.values())))
    model = summary["model"]
    lines = [provenance_line(summary["provenance"]), "",
             f"Model: {model.get('name')} ({summary['initialisation']}), {summary['images']} CutMix images, "
             f"{summary['grid'][0]}x{summary['grid'][1]} tokens. Mean |mixing ratio - similarity ratio| over all "
             "tokens and images (App. B Eq. 13's similarity ratio as the reference; lower is closer):", "",
             "| scheme | " + " | ".join(f"after block {i}" for i in _picked(blocks)) + " |",
             "| --- |" + " ---: |" * len(_picked(blocks))]
    for scheme, values in errors.items():
        lines.append(f"| {_SCHEME_NAMES.get(scheme, scheme)} | " + " | ".join(
            f"{values[i - 1]:.3f}" for i in _picked(blocks)) + " |")
    cfg = summary["config"]
    sizes = (f"; the widths: depth {cfg['size_depth']}, {cfg['size_img']} px, patch {cfg['size_patch']}, initialised "
             "like the analysed model" if not cfg.get("size_checkpoints") and "size_depth" in cfg else "")
    lines += ["", f"RMSE between the CutMix and TL-Align targets (Fig. 3){sizes}:", "", "| model | RMSE |",
              "| --- | ---: |"]
    lines += [f"| {b['label']} | {b['rmse']:.4f} |" for b in summary["rmse_by_size"]]
    return "\n".join(lines)


def _picked(blocks: int) -> list[int]:
    """Block numbers shown: the first, a few in between, the last."""
    return sorted({1, max(1, blocks // 4), max(1, blocks // 2), max(1, 3 * blocks // 4), blocks})
