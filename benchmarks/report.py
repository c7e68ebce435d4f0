"""``benchmarks/RESULTS.md``, generated from the benchmarks' JSON summaries in ``benchmarks/results/``.

Every measured figure of the project's documents comes from here, so none is typed by hand::

    python -m benchmarks.report                                   # rewrite benchmarks/RESULTS.md
    python -m benchmarks.report --check                           # exit 1 when RESULTS.md is out of date
    python -m benchmarks.report --add-ablation runs/ablation/table7-cifar10-deit_tiny_patch16_224
    python -m benchmarks.report --add-speed runs/speed/speed-cpu-20261123-181500.json
    python -m benchmarks.report --add-speed benchmarks/results/speed-control-cpu.json runs/speed/speed-families-cpu-<stamp>.json
    python -m benchmarks.report --add-op-count benchmarks/results/op-count.json runs/op_count/op_count.json
    python -m benchmarks.report --add-analysis runs/analysis-sharpened/analysis.json
    python -m benchmarks.report --add-rmse scratch=runs/a0/analysis.json fine-tuned=runs/a1/analysis.json

``--add-ablation`` and ``--add-speed`` copy a trimmed summary of a benchmark's output
(no checkpoints, no per-step arrays) into ``benchmarks/results/<section>.json`` and
regenerate the file. Every table states the command, date, machine and torch version
that produced it (the ``provenance`` the benchmarks write, ``benchmarks/_provenance.py``);
a section without a summary says so and names the command that measures it.
``tests/test_results.py`` fails when RESULTS.md and the summaries drift apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python benchmarks/report.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._provenance import provenance_line
from benchmarks._results_ablation import reading, render_ablation, summarize_ablation
from benchmarks._results_analysis import render_analysis, render_rmse, summarize_analysis, summarize_rmse
from benchmarks._results_op_count import merge_op_counts, summarize_op_count
from benchmarks._results_sections import README, RESULTS_DIR, RESULTS_MD, SECTIONS, render, render_readme
from benchmarks._results_speed import (
    merge_speed, render_families, render_label_work, render_steps, summarize_speed,
)
from benchmarks.gpu_report import family_measured, merge_gpu_suites, part_measured, summarize_gpu_suite

# the command, and what the tests and other tools read of RESULTS: each lives in a _results_* module
__all__ = ["README", "RESULTS_DIR", "RESULTS_MD", "SECTIONS", "main", "merge_speed", "provenance_line", "reading",
           "render", "render_ablation", "render_analysis", "render_families", "render_label_work", "render_readme",
           "render_rmse", "render_steps", "summarize_ablation", "summarize_analysis", "summarize_rmse",
           "summarize_speed"]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when RESULTS.md differs from what the summaries give")
    p.add_argument("--add-ablation", type=Path, metavar="DIR", help="an ablation output directory (--out)")
    p.add_argument("--add-speed", type=Path, nargs="+", metavar="FILE",
                   help="a speed.py JSON (runs/speed/speed-<device>-*.json); several --families JSONs make one table, "
                   "a later file's rows replacing an earlier one's")
    p.add_argument("--add-analysis", type=Path, metavar="FILE", help="an alignment_analysis.py JSON (<out>/analysis.json)")
    p.add_argument("--add-rmse", nargs="+", metavar="LABEL=FILE",
                   help="alignment_analysis.py JSONs of trained checkpoints, each with a row label: the RMSE comparison")
    p.add_argument("--add-op-count", type=Path, nargs="+", metavar="FILE",
                   help="an op_count.py JSON (runs/op_count/op_count.json; --compiled: op_count_compiled.json; --whole: "
                   "op_count_whole.json); several of one kind make one table, a later file's rows replacing an earlier one's")
    p.add_argument("--replace", action="store_true",
                   help="let a per-family table's new run replace the committed table whole, dropping the families it "
                   "did not measure (without it that is refused: give the committed summary first to add to it)")
    p.add_argument("--add-gpu-suite", type=Path, nargs="+", metavar="FILE",
                   help="gpu_suite.py JSONs (runs/gpu/gpu_suite.json); a later file's parts replace an earlier one's")
    p.add_argument("--append", action="store_true",
                   help="--add-gpu-suite: merge onto the summary already in benchmarks/results (its earlier runs kept, "
                   "the parts the new files measured replaced), for when the earlier runs' JSONs are gone")
    p.add_argument("--note", action="append", default=[],
                   help="--add-gpu-suite: a note on each file's run, in order (what it measured, what it missed)")
    p.add_argument("--command", help="--add-ablation: the command that ran it, when its output does not record it")
    p.add_argument("--same-machine", action="store_true",
                   help="--add-ablation of output without provenance: this machine ran it (take cores, CPU, torch here)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help=argparse.SUPPRESS)
    p.add_argument("--output", type=Path, default=RESULTS_MD, help=argparse.SUPPRESS)
    p.add_argument("--readme", type=Path, default=README, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        added: list[tuple[str, dict[str, Any]]] = []
        if args.add_ablation is not None:
            added.append(summarize_ablation(args.add_ablation, command=args.command, same_machine=args.same_machine))
        if args.add_speed is not None:
            added.append(merge_speed([summarize_speed(path) for path in args.add_speed]))
        if args.add_analysis is not None:
            added.append(summarize_analysis(args.add_analysis))
        if args.add_rmse is not None:
            bad = [item for item in args.add_rmse if "=" not in item]
            if bad:
                raise ValueError(f"--add-rmse takes LABEL=FILE pairs, got {', '.join(bad)}")
            added.append(summarize_rmse([(label, Path(file)) for label, file in (i.split("=", 1) for i in args.add_rmse)]))
        if args.add_op_count is not None:
            added.append(merge_op_counts([summarize_op_count(path) for path in args.add_op_count]))
        if args.add_gpu_suite is not None:
            notes = args.note + [""] * len(args.add_gpu_suite)
            suites = [summarize_gpu_suite(path, note)[1] for path, note in zip(args.add_gpu_suite, notes)]
            existing = args.results_dir / "gpu-suite.json"
            if args.append and not existing.is_file():
                raise FileNotFoundError(f"--append: no earlier GPU suite summary at {existing}")
            merged = json.loads(existing.read_text()) if args.append else suites.pop(0)
            for later in suites:
                merged = merge_gpu_suites(merged, later)
            added.append(("gpu-suite", merged))
        for name, summary in added:
            if not args.replace:
                _refuse_dropped_rows(name, summary, args.results_dir)
        for name, summary in added:
            args.results_dir.mkdir(parents=True, exist_ok=True)
            (args.results_dir / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
            print(f"written: {args.results_dir / f'{name}.json'}")
        text = render(args.results_dir)
        readme = args.readme.read_text()
        new_readme = render_readme(readme, args.results_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    if args.check:
        current = args.output.read_text() if args.output.is_file() else ""
        stale = [str(path) for path, old, new in ((args.output, current, text), (args.readme, readme, new_readme))
                 if old != new]
        if stale:
            print(f"{' and '.join(stale)} out of date: run python -m benchmarks.report", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    args.readme.write_text(new_readme)
    print(f"written: {args.output}, the results section of {args.readme}")
    return 0


def _refuse_dropped_rows(name: str, summary: dict[str, Any], results_dir: Path) -> None:
    """Raise where a per-family table's new summary lacks families its committed summary has: a run of a few families
    (``speed.py --families a b``, ``op_count.py --families a``) given alone would replace the whole table and drop
    every other family's row. The fix, in the message: the committed summary first, then the run (its rows replace
    theirs, the others stay, each marked with the run that measured it), or ``--replace``."""
    committed = results_dir / f"{name}.json"
    if name == "gpu-suite" and committed.is_file():
        _refuse_dropped_parts(summary, json.loads(committed.read_text()), committed)
    new = summary.get("families")
    if not committed.is_file() or not isinstance(new, dict):
        return
    old = json.loads(committed.read_text()).get("families")
    dropped = [family for family in (old if isinstance(old, dict) else {}) if family not in new]
    if not dropped:
        return
    flag = "--add-op-count" if name.startswith("op-count") else "--add-speed"
    shown = ", ".join(dropped[:8]) + (f" and {len(dropped) - 8} more" if len(dropped) > 8 else "")
    raise ValueError(
        f"{name}: the run measured {len(new)} of the {len(old)} families in {committed}, so {len(dropped)} rows would be "
        f"dropped ({shown}); to add the run to the table, give the committed summary first: {flag} {committed} "
        "<the run's JSON files>; to replace the table whole, add --replace")


def _refuse_dropped_parts(summary: dict[str, Any], committed: dict[str, Any], path: Path) -> None:
    """Raise where a GPU suite run added without ``--append`` would drop figures the committed summary holds: a part
    (a DeiT-S mode, a family's row) earlier runs measured and this run did not (it reached its deadline first, or ran
    other parts or families)."""
    old, new = committed.get("parts", {}), summary.get("parts", {})
    dropped = [part for part, figures in old.items()
               if part_measured(part, figures) and not part_measured(part, new.get(part))]
    if part_measured("deit", old.get("deit")) and part_measured("deit", new.get("deit")):
        dropped += [f"deit {mode}" for mode in ("eager", "compiled") if mode in old["deit"] and mode not in new["deit"]]
    if part_measured("families", old.get("families")) and part_measured("families", new.get("families")):
        dropped += [f"family {family}" for family, row in old["families"].items()
                    if family_measured(row) and not family_measured(new["families"].get(family))]
    if dropped:
        raise ValueError(
            f"gpu-suite: the run did not measure {', '.join(dropped)}, which {path} holds from earlier runs, and would "
            "drop them; add --append to merge the run onto them (its parts replace theirs, the others stay), or "
            "--replace to take the run alone")


if __name__ == "__main__":
    sys.exit(main())
