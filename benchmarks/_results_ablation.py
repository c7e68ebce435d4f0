"""The ablation's tables in RESULTS.md: the summary kept of an ablation's output, its table and what the deltas say."""

from __future__ import annotations

import datetime
import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._provenance import provenance, provenance_line
from benchmarks._rows import ROW_IDS

__all__ = ["reading", "render_ablation", "summarize_ablation"]

_ABLATION_TABLE_NAME = {7: "table7", 8: "table8", "tokenlabel": "tokenlabel"}


def _ablation_records(summary: dict[str, Any]) -> tuple[Any, list[Any], list[dict[str, Any]]]:
    from benchmarks import ablation
    from benchmarks._ablation_config import AblationConfig

    cfg = AblationConfig.model_validate(summary["config"])
    planned = ablation.plan(cfg, int(summary["num_classes"]), str(summary["device_type"]))
    return cfg, planned, list(summary["runs"])


def render_ablation(summary: dict[str, Any]) -> str:
    """The ablation's table, rendered by the ablation's own ``render_markdown`` from the kept run records."""
    from benchmarks import ablation

    cfg, planned, records = _ablation_records(summary)
    lines = [provenance_line(summary["provenance"]), ""]
    done = {r["key"] for r in records}
    missing = [p for p in planned if p.key not in done]
    finished = sorted(float(r["finished"]) for r in records if r.get("finished") is not None)
    if finished:
        first, last = (datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
                       for t in (finished[0], finished[-1]))
        train = sum(float(r["result"]["train_seconds"]) for r in records)
        lines += [f"{len(records)} of {len(planned)} runs finished, the first at {first}, the last at {last}; "
                  f"{train / 60:.1f} min of training in all.", ""]
    if missing:
        lines += [f"Not finished: {', '.join(p.name for p in missing)} (shown as -).", ""]
    lines.append(ablation.render_markdown(cfg, planned, records, summary.get("annotator"), summary.get("base")).rstrip("\n"))
    lines += ["", reading(cfg, planned, records)]
    return "\n".join(lines)


def reading(cfg: Any, planned: Sequence[Any], records: Sequence[dict[str, Any]]) -> str:
    """What the deltas say, counted from them (never typed by hand): how many intervals lie above 0, below, across."""
    from benchmarks._ablation_stats import table_deltas

    deltas = table_deltas(cfg, planned, records)
    above = [d.label for d in deltas if d.delta.significant and d.delta.mean > 0]
    below = [d.label for d in deltas if d.delta.significant and d.delta.mean < 0]
    across = [d for d in deltas if d.delta.significant is False]
    if not deltas or all(d.delta.significant is None for d in deltas):
        return "Reading: one seed per cell, so no delta has an interval; run more seeds (--seeds 0-4)."
    text = (f"Reading: of {len(deltas)} delta{'' if len(deltas) == 1 else 's'}, {len(above)} {'has' if len(above) == 1 else 'have'} a 95% interval above 0"
            + (f" ({', '.join(above)})" if above else "") + f", {len(below)} below 0"
            + (f" ({', '.join(below)})" if below else "") + f" and {len(across)} span 0.")
    if len(deltas) > 1 and (above or below):
        text += (f" With {len(deltas)} intervals at 95% each, about {0.05 * len(deltas):.1f} would exclude 0 by chance "
                 "alone when nothing differs: one excluding interval is a lead to test with more seeds, not a result.")
    return text


def summarize_ablation(out: Path, *, command: str | None = None, same_machine: bool = False) -> tuple[str, dict[str, Any]]:
    """``(section name, summary)`` of an ablation output directory: its config, run records, annotator, provenance.

    ``results.json`` is read when the job finished; else the run files of the plan of ``command`` (a job
    still running or stopped). Output of a version that wrote no provenance needs ``command`` and
    ``same_machine`` (this machine ran it: cores, CPU and torch are taken from here, the date from the runs).
    """
    from benchmarks import ablation
    from benchmarks._ablation_config import AblationConfig

    results_file = out / "results.json"
    if results_file.is_file():
        results = json.loads(results_file.read_text())
        cfg = AblationConfig.model_validate(results["config"])
        records, prov, teacher = results["runs"], results.get("provenance"), results.get("annotator")
        base = results.get("base")
    else:
        if command is None:
            raise FileNotFoundError(f"no results.json in {out} (the job has not finished): pass --command "
                                    "'python benchmarks/ablation.py ...' (as it was run) to take its finished run files")
        cfg, _ = ablation.resolve_config(shlex.split(command)[2:])
        records, prov, teacher, base = [], None, None, None
    name = _section_name(cfg)  # before reading any run: a job RESULTS does not keep is refused first
    num_classes = 10 if cfg.data.source in ("cifar10", "imagenette") else None
    if num_classes is None:
        raise ValueError(f"--add-ablation knows the class count of cifar10 and imagenette only, not {cfg.data.source}")
    device_type = "cuda" if cfg.device.startswith("cuda") else "cpu"
    planned = ablation.plan(cfg, num_classes, device_type)
    if not records:
        by_key = {}
        for p in planned:
            path = out / "runs" / f"{p.key}.json"
            if path.is_file():
                by_key[p.key] = {"table": cfg.table, "row": p.cell.row, "label": p.cell.label,
                                 "aligned": p.cell.aligned, "seed": p.seed, **json.loads(path.read_text())}
        records = [by_key[p.key] for p in planned if p.key in by_key]
        if not records:
            raise FileNotFoundError(f"no finished run of {command!r} in {out / 'runs'}")
    if base is None and cfg.profile == "finetune":  # a job still running: its base model's run file
        base_file = out / "runs" / f"{planned[0].run.base}.json"
        base = json.loads(base_file.read_text()) if base_file.is_file() else None
    if prov is None:
        if command is None or not same_machine:
            raise ValueError(f"{out} has no provenance (written before the ablation recorded it): pass --command "
                             "'<the command that ran it>' and --same-machine when this machine ran it")
        last = max(float(r["finished"]) for r in records)
        prov = {**provenance(shlex.split(command)), "load_average": None,
                "date": datetime.datetime.fromtimestamp(last, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "recorded": "date of the last finished run; machine and torch recorded on the same machine afterwards"}
    keep = ("table", "row", "label", "aligned", "seed", "key", "result", "world", "device", "finished", "data_origin")
    summary = {
        "kind": "ablation",
        "provenance": prov,
        "config": cfg.model_dump(mode="json"),
        "num_classes": num_classes,
        "device_type": device_type,
        "runs": [{k: r[k] for k in keep if k in r} for r in records],
        "annotator": _trim_teacher(teacher),
        "base": {"run": base["run"], "result": base["result"]} if base else None,
    }
    return name, summary


def _section_name(cfg: Any) -> str:
    """The RESULTS section an ablation job's summary goes to.

    A fine-tuning job is its own table, and so is a from-scratch Table 7 job that leaves out some of the paper's rows
    (``--rows``, often with more seeds): neither replaces the full from-scratch table, which the README shows too.
    RESULTS keeps Table 8 and the token-labeling table whole only.
    """
    name = _ABLATION_TABLE_NAME[cfg.table]
    if cfg.profile == "finetune":
        return name + "-finetune"
    missing = [] if cfg.rows is None else [row for row in ROW_IDS[cfg.table] if row not in cfg.rows]
    if not missing:
        return name
    if cfg.table == 7:
        return name + "-rows"
    raise ValueError(f"RESULTS keeps the whole of table {cfg.table}; this job left out its rows {', '.join(missing)}. "
                     f"Run it without --rows (the rows it has already finished in its --out are not trained again)")


def _trim_teacher(teacher: dict[str, Any] | None) -> dict[str, Any] | None:
    if teacher is None:
        return None
    maps = teacher.get("score_maps")
    return {"run": teacher["run"], "result": teacher["result"],
            "score_maps": {k: v for k, v in maps.items() if k != "path"} if maps else None}
