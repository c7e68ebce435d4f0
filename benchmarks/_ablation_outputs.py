"""The ablation's files: ``table.md``, ``runs.csv``, ``deltas.csv``, ``results.json`` (and ``table.png``)."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._ablation_plan import Planned
from benchmarks._ablation_plots import plot
from benchmarks._ablation_stats import cell_stat, summarise, table_deltas
from benchmarks._ablation_config import AblationConfig
from benchmarks._rows import Cell
from benchmarks._stats import NO_DIFFERENCE

__all__ = ["render_markdown", "write_outputs", "write_atomic"]


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fmt(values: dict[int, float] | None) -> str:
    stat = cell_stat(list(values.values())) if values else None
    return "-" if stat is None else str(stat)


def render_markdown(cfg: AblationConfig, planned: Sequence[Planned], records: Sequence[dict[str, Any]],
                    teacher: dict[str, Any] | None = None, base_model: dict[str, Any] | None = None) -> str:
    """The table in the paper's shape, with a caption saying what was run."""
    cells = summarise(records)
    deltas = {d.row: str(d.delta) for d in table_deltas(cfg, planned, records)}
    rows: list[Cell] = []
    for p in planned:
        if all(p.cell.row != c.row or p.cell.aligned != c.aligned for c in rows):
            rows.append(p.cell)
    m = cfg.model
    size = f"{m.name}" + (f" (dim {m.embed_dim}, depth {m.depth}, patch {m.patch_size})" if m.embed_dim else "")
    steps = {int(r["result"]["steps"]) for r in records}
    name = "Token labeling table" if cfg.table == "tokenlabel" else f"Table {cfg.table}"
    caption = (f"{name} on {cfg.data.source} ({cfg.data.subset or 'all'} train / "
               f"{cfg.data.test_subset or 'all'} test images), {size}, {'/'.join(map(str, sorted(steps)))} steps of "
               f"{cfg.recipe.batch_size}; top-1 (%) as mean ± std over seeds {', '.join(map(str, cfg.seeds))}; "
               f"Δ = mean of the paired per-seed differences [95% t interval], seeds where it was positive / seeds, "
               f"and '{NO_DIFFERENCE}' where the interval spans 0 (one seed: no interval).")
    lines = [caption, ""]
    mark = {True: "✓", False: "×"}
    if cfg.table == 7:
        beyond = any(c.flags.other for c in rows)  # rows beyond the paper get a column naming their mixer
        lines += ["| MixUp | CutMix | Random | Block-wise |" + (" Beyond the paper |" if beyond else "")
                  + " Top-1 (%) | +TL-Align Top-1 (%) | Δ |",
                  "| :-: | :-: | :-: | :-: |" + (" :-: |" if beyond else "") + " --: | --: | --: |"]
        for row in dict.fromkeys(c.row for c in rows):
            flags = next(c.flags for c in rows if c.row == row)
            base, aligned = cells.get((row, False)), cells.get((row, True))
            has_aligned = any(c.row == row and c.aligned for c in rows)
            other = f" {flags.other or '×'} |" if beyond else ""
            lines.append(
                f"| {mark[flags.mixup]} | {mark[flags.cutmix]} | {mark[flags.random]} | {mark[flags.blockwise]} |{other}"
                f" {_fmt(base)} | {_fmt(aligned) if has_aligned else '-'} "
                f"| {deltas.get(row, '-')} |"
            )
    else:  # one column, each row against the baseline row: Table 8's "none", the tokenlabel table's CutMix
        first = "cutmix" if cfg.table == "tokenlabel" else "none"
        against = "Δ vs CutMix (%)" if cfg.table == "tokenlabel" else "Δ (%)"
        lines += [f"| {'Training' if cfg.table == 'tokenlabel' else 'Alignment'} | Top-1 (%) | {against} |",
                  "| :-- | --: | --: |"]
        for c in rows:
            values = cells.get((c.row, c.aligned))
            delta = deltas.get(c.row, "-") if c.row != first else "-"
            lines.append(f"| {c.label} | {_fmt(values)} | {delta} |")
        if teacher is not None:
            lines += ["", _teacher_line(teacher)]
    if base_model is not None:
        lines += ["", _base_line(base_model)]
    return "\n".join(lines) + "\n"


def _teacher_line(teacher: dict[str, Any]) -> str:
    """The annotator under the token-labeling table: what it is, how good it is, what its maps cost."""
    run, result = teacher["run"], teacher["result"]
    model = run["model"]
    maps = teacher.get("score_maps")
    stored = (f"; its maps: {maps['images']} images, {maps['map_size'][0]}x{maps['map_size'][1]} cells, top-{maps['k']}, "
              f"{maps['bytes_per_image']:.0f} bytes per image" if maps else "")
    return (f"Annotator: {model['name']} with global average pooling and no class token (dim {model['embed_dim']}, "
            f"depth {model['depth']}, patch {model['patch_size']}), trained with CutMix for {run['recipe']['epochs']:g} "
            f"epochs ({result['steps']} steps, seed {run['seed']}): top-1 {result['top1']:.2f}%{stored}.")


_CSV_FIELDS = ("table", "row", "label", "aligned", "seed", "key", "mixer", "scheme", "top1", "correct", "evaluated",
               "train_loss", "steps", "train_seconds", "eval_seconds", "images_per_second", "world", "device")


_DELTA_FIELDS = ("table", "row", "label", "against", "n", "mean", "ci_low", "ci_high", "positive", "verdict")


def write_outputs(out: Path, cfg: AblationConfig, planned: Sequence[Planned], records: Sequence[dict[str, Any]],
                  markdown: str, teacher: dict[str, Any] | None = None, base: dict[str, Any] | None = None,
                  job: dict[str, Any] | None = None) -> None:
    """``table.md``, ``runs.csv``, ``deltas.csv``, ``results.json`` and ``table.png`` in ``out``, each atomically.

    ``job`` is the job's provenance (``benchmarks._provenance``: date, command, machine, torch), kept in
    ``results.json`` for ``python -m benchmarks.report``.
    """
    write_atomic(out / "table.md", markdown)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_CSV_FIELDS)
    writer.writeheader()
    for rec in records:
        run = rec["run"]
        writer.writerow({
            **{k: rec[k] for k in ("table", "row", "label", "aligned", "seed", "key", "world", "device")},
            "mixer": (run["mixer"] or {}).get("kind", "none"), "scheme": (run["scheme"] or {}).get("kind", "none"),
            **{k: rec["result"][k] for k in _CSV_FIELDS if k in rec["result"]},
        })
    write_atomic(out / "runs.csv", buf.getvalue())
    deltas = [{"row": d.row, "label": d.label, "against": d.against, **d.delta.as_dict()}
              for d in table_deltas(cfg, planned, records)]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_DELTA_FIELDS)
    writer.writeheader()
    writer.writerows({"table": cfg.table, **d} for d in deltas)
    write_atomic(out / "deltas.csv", buf.getvalue())
    results = {"config": cfg.model_dump(mode="json"), "table": markdown, "runs": list(records), "deltas": deltas,
               "annotator": teacher, "base": base, "provenance": job}
    write_atomic(out / "results.json", json.dumps(results, indent=1))
    plot(out / "table.png", cfg, planned, records)


def _base_line(base: dict[str, Any]) -> str:
    """The finetune profile's base model under the table."""
    run, result = base["run"], base["result"]
    return (f"Fine-tuned from one base model: {run['model']['name']} trained with CutMix on {run['data']['source']} "
            f"at {run['data']['img_size']} px for {run['recipe']['epochs']:g} epochs ({result['steps']} steps, seed "
            f"{run['seed']}; top-1 {result['top1']:.2f}% on its own test images), then every cell from it.")
