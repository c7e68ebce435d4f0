"""``speed.py``'s tables in RESULTS.md: the summary kept of its JSON (no per-round arrays) and its tables."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._gpu_timing import error_cell
from benchmarks._provenance import later_notes, later_runs, provenance_line
from benchmarks._speed_tables import (
    FAULTS_NOTE, LABEL_WORK_HEADER, family_cells, family_header, fmt, label_work_row, recorded_malloc_note,
)
from benchmarks._variants import BASELINE, CONTROL, LABELS, timm_step_note

__all__ = ["merge_speed", "render_families", "render_label_work", "render_mixers", "render_steps",
           "steps_or_missing", "mixers_or_missing", "summarize_speed"]

_DROP = ("step_s_per_round", "s_per_repeat", "alloc_top_mb")  # per-round arrays and op lists: not shown, not kept


def render_steps(summary: dict[str, Any]) -> str:
    """The training-step table of ``speed.py``: time, RSS and allocator peaks, each as a ratio to CutMix + NoAlign."""
    cfg = summary["config"]
    lines = [provenance_line(summary["provenance"]), "",
             f"Training step of the `{cfg['model']}` model, batch {cfg['batch_size']}, {cfg['repeats']} interleaved "
             f"rounds of {cfg['steps']} steps; ratios to {LABELS[BASELINE]}, paired per round (median [min, max]).", "",
             "| variant | img/s | step ms (median [min, max]) | time ratio | alloc peak MB | alloc ratio "
             "| alloc step MB | alloc step ratio | peak RSS MB | RSS ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for v, s in summary["steps"].items():
        ratio = (f"{fmt(s['time_ratio'], 3)} [{fmt(s['time_ratio_min'], 3)}, {fmt(s['time_ratio_max'], 3)}]"
                 if "time_ratio" in s else "-")
        lines.append(
            f"| {LABELS[v]} | {fmt(s['img_s'], 1)} | {fmt(s['step_ms_median'], 1)} [{fmt(s['step_ms_min'], 1)}, "
            f"{fmt(s['step_ms_max'], 1)}] | {ratio} | {fmt(s['alloc_peak_mb'], 1)} | {fmt(s.get('alloc_ratio'), 4)} "
            f"| {fmt(s['alloc_step_mb'], 1)} | {fmt(s.get('alloc_step_ratio'), 4)} | {fmt(s['peak_mb'], 0)} "
            f"| {fmt(s.get('memory_ratio'), 3)} |"
        )
    if "timm-cutmix" in summary["steps"]:
        lines += ["", f"{LABELS['timm-cutmix']}: {timm_step_note()}"]
    return "\n".join(lines + recorded_malloc_note(cfg))


_LATER_ROUNDS = " (a row marked [*n]: its run's rounds and warm-up, which the note's command gives)"

_SAME_SETTINGS = (("batch_size", "--batch-size"), ("steps", "--steps"), ("threads", "--threads"), ("amp", "--no-amp"),
                  ("num_classes", "--num-classes"), ("pixel_boxes", "--pixel-boxes"), ("device", "--device"))
"""The settings a per-family table's rows must share (``merge_speed``); the rounds (``--repeats``) and the warm-up
may differ, as a row marked with a later run says by its command."""


def merge_speed(parts: Sequence[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """One summary from several ``speed.py`` summaries: ``--families`` runs combine (a later run's rows replace an
    earlier one's, each row keeping the provenance of the run that measured it); anything else must be alone.
    The committed ``benchmarks/results/speed-families-<device>.json`` is itself such a summary: passed first, a new
    run adds or replaces its families."""
    names = {name for name, _ in parts}
    if len(parts) == 1:
        return parts[0]
    if len(names) != 1 or not next(iter(names)).startswith(("speed-families", "speed-control", "speed-labels")):
        raise ValueError(f"--add-speed combines several speed.py --families runs of one device only, got {sorted(names)}")
    name, first = parts[0]
    families: dict[str, Any] = {}
    for _, summary in parts:
        if summary["config"].get("variants") != first["config"].get("variants") and not name.startswith("speed-labels"):
            raise ValueError("--add-speed: the runs measured different --variants; combine runs of the same variants")
        if summary["config"].get("malloc", "default") != first["config"].get("malloc", "default"):
            raise ValueError("--add-speed: the runs timed under different --malloc settings; combine runs of one setting")
        for key, flag in _SAME_SETTINGS:  # what a row's figure means: one table, one setting (rounds only add precision)
            if summary["config"].get(key) != first["config"].get(key):
                raise ValueError(f"--add-speed: the runs timed with {flag} {first['config'].get(key)} and "
                                 f"{summary['config'].get(key)}; a table's rows share it: combine runs of one {flag}")
        # a row keeps the provenance it already carries (the committed summary passed again, to add a family)
        families.update({f: {"provenance": summary["provenance"], **row} for f, row in summary["families"].items()})
    return name, {**first, "families": families}


def render_families(summary: dict[str, Any]) -> str:
    """``speed.py --families``: per family, TL-Align's step time and allocator peaks as ratios to CutMix + NoAlign."""
    cfg = summary["config"]
    variants = [v for v in cfg["variants"] if v != BASELINE]
    # runs since the faults were counted have them (a table of older rows shows no column for them)
    faults = any("faults_per_step" in s for row in summary["families"].values() for s in row["steps"].values())
    later, mark_of = later_runs(summary)
    lines = [provenance_line(summary["provenance"]), "",
             f"One small timm model per family at its default input size, batch {cfg['batch_size']}, "
             f"{cfg['repeats']} interleaved rounds of {cfg['steps']} steps{_LATER_ROUNDS if later else ''}; time: the "
             "paired per-round ratio to "
             f"{LABELS[BASELINE]} (median [min, max]); alloc peak: ratio of the allocator's peak live bytes (model, "
             "optimizer state, batch and step); alloc step: ratio of what the step adds on top. Target: time <= 1.03, "
             "alloc <= 1.01.", "",
             *family_header(variants, "model (CutMix step ms)", faults)]
    for family, row in summary["families"].items():
        base = row["steps"][BASELINE]
        lines.append(f"| {family}{mark_of(row)} | `{row['model']}` ({fmt(base['step_ms_median'], 0)}) | "
                     + " | ".join(family_cells(row, variants, faults)) + " |")
    notes = (["", FAULTS_NOTE] if faults else []) + recorded_malloc_note(cfg)
    return "\n".join(lines + notes + later_notes(later))


def render_label_work(summary: dict[str, Any]) -> str:
    """``speed.py --families --label-profile``: per family, the forward's label work and the operators adding most."""
    cfg = summary["config"]
    later, mark_of = later_runs(summary)
    lines = [provenance_line(summary["provenance"]), "",
             f"Batch {cfg['batch_size']}, default input size. Forward ms: no grad, train mode, median of "
             f"{cfg['repeats']} interleaved rounds of {cfg['steps']} forwards; label work: TL-Align's forward minus "
             "NoAlign's (median [min, max] over the paired rounds; labels carry no gradient, so this is the step's "
             "extra work); share: of a CutMix + NoAlign training step; top added operators: self CPU ms per forward, "
             "TL-Align's profile minus NoAlign's (median over paired profiles), with the calls each adds.", "",
             *LABEL_WORK_HEADER]
    lines += [label_work_row(family, row, mark_of(row)) for family, row in summary["families"].items()]
    return "\n".join(lines + recorded_malloc_note(cfg) + later_notes(later))


def render_mixers(summary: dict[str, Any]) -> str:
    """The mixer table of ``speed.py``: time per batch, paired ratio to timm's batch-mode ``Mixup``."""
    cfg = summary["config"]
    lines = [provenance_line(summary["provenance"]), "",
             f"Time per batch of {cfg['mixer_batch']}x3x{cfg['mixer_size']}x{cfg['mixer_size']} (targets included; "
             f"{cfg['mixer_repeats']} interleaved rounds of {cfg['mixer_calls']} calls); ratio to timm's batch-mode "
             "`Mixup` of the same kind (CutMix or MixUp), paired per round (median [min, max]).", "",
             "| mixer | ms (median [min, max]) | paired ratio to timm batch mode |", "| --- | ---: | ---: |"]
    for name, s in summary["mixers"].items():
        if "error" in s:
            lines.append(f"| {name} | left out: {error_cell(s['error'])} | - |")
            continue
        lines.append(f"| {name} | {fmt(s['ms_median'], 2)} [{fmt(s['ms_min'], 2)}, {fmt(s['ms_max'], 2)}] "
                     f"| {fmt(s['paired_ratio'], 2)} [{fmt(s['paired_ratio_min'], 2)}, {fmt(s['paired_ratio_max'], 2)}] |")
    return "\n".join(lines + recorded_malloc_note(cfg))


def summarize_speed(path: Path) -> tuple[str, dict[str, Any]]:
    """``(section name, summary)`` of a ``speed.py`` JSON: everything but the per-round arrays."""
    result = json.loads(path.read_text())
    if "provenance" not in result:
        raise ValueError(f"{path} has no provenance (written before speed.py recorded it): run speed.py again")

    def trim(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {name: {k: v for k, v in row.items() if k not in _DROP} for name, row in table.items()}

    device = "cuda" if str(result["config"]["device"]).startswith("cuda") else "cpu"
    if "families" in result and result["config"].get("label_profile"):  # --families --label-profile
        return f"speed-labels-{device}", {"kind": "speed-labels", "provenance": result["provenance"],
                                          "config": result["config"], "families": result["families"]}
    if "families" in result:  # speed.py --families: one row per family, its own section
        families = {name: {**row, "steps": trim(row["steps"])} for name, row in result["families"].items()}
        # a run with the A/A control measured the noise floor beside the cost: a section of its own
        kind = "speed-control" if CONTROL in result["config"].get("variants", ()) else "speed-families"
        return f"{kind}-{device}", {"kind": kind, "provenance": result["provenance"],
                                            "config": result["config"], "families": families}
    summary = {"kind": "speed", "provenance": result["provenance"], "config": result["config"],
               **{part: trim(result[part]) for part in ("steps", "mixers") if part in result}}
    return f"speed-{device}", summary


def steps_or_missing(summary: dict[str, Any]) -> str:
    """The training-step table, or why a summary has none."""
    if "steps" not in summary:
        return "The summary holds no training-step table (it was run with `--only mixers`)."
    return render_steps(summary)


def mixers_or_missing(summary: dict[str, Any]) -> str:
    """The mixer table, or why a summary has none."""
    if "mixers" not in summary:
        return "The summary holds no mixer table (it was run with `--only steps`)."
    return render_mixers(summary)
