"""The GPU suite's JSON (``benchmarks/gpu_suite.py``) as text: the suite's closing table and RESULTS' section.

Every figure is read from the JSON as measured: a ratio is the median of the paired per-round
ratios, ``[min, max]`` their range; a part cut short or failed says so instead of a figure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._gpu_timing import error_cell
from benchmarks._mixer_timing import PROFILED_CALLS
from benchmarks._variants import timm_step_note

__all__ = [
    "family_measured",
    "gpu_section",
    "merge_gpu_suites",
    "outcomes_of",
    "part_measured",
    "render_gpu_suite",
    "summarize_gpu_suite",
    "summary_table",
]


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
        if isinstance(row, dict) and "ms_median" not in row and "error" in row:  # a variant that failed: say so
            lines.append(f"| {name} | - | left out: {error_cell(row['error'])}{' | - | - | - | -' if memory else ''} |")
            continue
        if not isinstance(row, dict) or "ms_median" not in row:
            continue
        mem = f" | {row['peak_mb']:.0f} | {row.get('memory_ratio', float('nan')):.3f}" if memory else ""
        extra = f" | {row.get('graphs', '-')} | {row.get('graph_breaks', '-')}" if "graphs" in row else (" | - | -" if memory else "")
        lines.append(f"| {name} | {row['ms_median']:.2f} | {_ratio(row)}{mem}{extra} |")
    return lines


def outcomes_of(text: str) -> dict[str, Any]:
    """pytest -v output: its closing line (or the budget's ``TIMED OUT`` line, or else its last), the count of each
    outcome printed so far, and the failed or erroring tests by id (one line each, printed as they end: also where
    the run was cut off before its summary)."""
    lines = [line for line in text.splitlines() if line.strip()]
    kinds = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
    outcomes = set(re.findall(rf"\b({kinds}) +(tests/\S+)", text))  # xdist's order, and the -rfE summary's
    outcomes |= {(kind, test) for test, kind in re.findall(rf"(tests/\S+) +({kinds})\b", text)}  # without xdist
    counts = {kind: sum(1 for k, _ in outcomes if k == kind) for kind in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    failed = sorted({test for kind, test in outcomes if kind in ("FAILED", "ERROR")})
    # pytest's closing line, or the budget's; a plugin's warning can come after the closing line (pytest-benchmark under xdist)
    closing = [line for line in lines if re.fullmatch(r"=+ .* in [\d.]+s.* =+", line.strip())]
    cut = [line for line in lines if line.startswith("TIMED OUT")]
    return {"summary": (closing or cut or lines or [""])[-1], "counts": counts, "failed": failed}


def not_a_gpu_run(result: dict[str, Any]) -> str | None:
    """Why a suite JSON has no place in RESULTS' GPU section (``None``: it has one): a ``--dry-run`` (tiny shapes, the
    registry's 32 px models, two rounds of two steps) or a run on the CPU, whose figures would stand in the tables
    of DeiT-S and the families at batch 128 on a GPU. A JSON written before the suite recorded ``dry_run`` says
    its device (``"CPU"`` off a GPU)."""
    device = str(result.get("device", ""))
    if result.get("dry_run"):
        kind = "a dry run (--dry-run: tiny shapes, 32 px models, two rounds of two steps)"
    elif device == "CPU" or not device:
        kind = f"a run on {'the CPU' if device else 'no recorded device'}"
    else:
        return None
    return (f"this is {kind} of the GPU suite, not a GPU's measurement; RESULTS' GPU section takes only a run on a "
            "GPU: run python benchmarks/gpu_suite.py on the GPU, without --dry-run, and add that run's gpu_suite.json")


def summarize_gpu_suite(path: Path, note: str | None = None) -> tuple[str, dict[str, Any]]:
    """``benchmarks/results/gpu-suite.json`` from one or more suite JSONs: the first run whole, a later run's
    parts replacing the first's (each keeps its own provenance); ``--out`` shown as a user would type it."""
    result = json.loads(path.read_text())
    refusal = not_a_gpu_run(result)
    if refusal is not None:
        raise ValueError(f"{path}: {refusal}")
    tests, log = result.get("parts", {}).get("tests"), path.parent / "gpu_tests.log"
    if isinstance(tests, dict) and not _missing(tests) and log.is_file():
        tests.update(outcomes_of(log.read_text()))  # the log is the record: read by today's parser, not the run's
    prov = dict(result.get("provenance", {}))
    prov["command"] = re.sub(r"--out \S+", "--out runs/gpu", str(prov.get("command", "")))
    return "gpu-suite", {**result, "provenance": prov, "runs": [{"provenance": prov, "note": note or "",
                                                                "parts": sorted(result.get("parts", {}))}]}


def merge_gpu_suites(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """``first`` with ``later``'s measured parts in their place: DeiT-S mode by mode, the families family by family (a
    family ``later`` measured replaces its row, the others stay: each session's GPU minutes measure a few families,
    and together they cover more), each family row saying which run measured it (``run``, 1-based).

    A part ``later`` measured nothing in (its deadline came first, or it failed) keeps the earlier figures; a part
    that failed, whole or part way, says so in ``later``'s run record (``ended``: part -> why), which RESULTS prints
    beside that run, so an error neither wipes figures out nor goes unsaid."""
    runs = [*first.get("runs", []), *[dict(run) for run in later.get("runs", [])]]
    merged = {**first, "parts": dict(first["parts"]), "runs": runs}
    ended: dict[str, str] = {}
    for name, part in later["parts"].items():
        before = merged["parts"].get(name)
        if not isinstance(part, dict):
            merged["parts"][name] = part
        elif name == "families" and isinstance(before, dict):
            earlier = _with_runs(before, families_run(first))
            merged["parts"]["families"] = {**earlier, **{
                family: {**row, "run": len(runs)} for family, row in part.items()
                if isinstance(row, dict) and (family_measured(row) or family not in earlier)}}
        elif not part_measured(name, part):  # the deadline came first, or it failed: nothing to replace a figure with
            if "error" in part and not part_measured(name, before):
                merged["parts"][name] = part  # nothing earlier to keep: the part's own table says why
        elif name == "deit" and part_measured(name, before):
            merged["parts"]["deit"] = {**_figures(before), **_figures(part)}
        else:
            merged["parts"][name] = part
        if isinstance(part, dict) and "error" in part and merged["parts"].get(name) is not part:
            ended[name] = _missing(part) or ""  # an error the merged part does not carry itself: said beside the run
    if ended and runs:
        runs[-1]["ended"] = {**runs[-1].get("ended", {}), **ended}
    return merged


def part_measured(name: str, part: Any) -> bool:
    """Whether a GPU suite part holds figures: the families part a measured row (``family_measured``), any other part
    more than the deadline's skip, an error and its seconds."""
    if not isinstance(part, dict):
        return False
    if name == "families":
        return any(family_measured(row) for row in part.values())
    return not set(part) <= {"skipped", "seconds", "error"}


def _figures(part: Any) -> dict[str, Any]:
    """A part's figures: without its seconds and the skip or error that ended its run (a later run's merge says
    those in its run record)."""
    return {key: value for key, value in part.items() if key not in ("seconds", "skipped", "error")}


def families_run(summary: dict[str, Any]) -> int | None:
    """The run (1-based) that measured a summary's untagged family rows: the last that ran the families part (each
    merge before rows said their run replaced the part whole); ``None`` for a suite's own JSON (no runs)."""
    runs = summary.get("runs", [])
    return max((i for i, run in enumerate(runs, 1) if "families" in run.get("parts", [])), default=None)


def _with_runs(families: dict[str, Any], run: int | None) -> dict[str, Any]:
    """The family rows, each tagged with the run that measured it (``run`` where a row says none), ``seconds`` left out."""
    return {family: ({"run": run, **row} if run is not None else row) for family, row in families.items()
            if family != "seconds" and isinstance(row, dict)}


def family_measured(row: Any) -> bool:
    """Whether a GPU suite family row holds figures (TL-Align timed; not the deadline's skip, not an error)."""
    return isinstance(row, dict) and "tlalign" in row and _missing(row) is None


def render_gpu_suite(summary: dict[str, Any], provenance_line: Callable[[dict[str, Any]], str]) -> str:
    """RESULTS' section: every run's provenance (``report.provenance_line``) and note, then the tables."""
    lines = []
    for i, run in enumerate(summary.get("runs", []), 1):
        lines += [f"Run {i} (parts: {', '.join(run['parts'])}): " + provenance_line(run["provenance"]), ""]
        if run.get("note"):
            lines += [run["note"], ""]
        for part, why in run.get("ended", {}).items():
            lines += [f"Run {i}'s {part} part ended early ({why}); where it measured nothing, the tables keep the earlier "
                      "runs' figures.", ""]
    lines += ["Each figure: batch 128 (DeiT-S, the families, the mixers at 224 px), bf16 autocast, the median over "
              "interleaved rounds timed by CUDA events; a ratio is the median of the paired per-round ratios, "
              "[min, max] their range.", ""]
    return "\n".join(lines + gpu_section(summary, heading=False)[2:])


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
    if any(isinstance(deit.get(mode), dict) and "timm-cutmix" in deit[mode] for mode in ("eager", "compiled")):
        out += [f"`timm-cutmix`: {timm_step_note(compiled=True)}", ""]
    for mode in ("eager", "compiled"):
        if mode in deit:
            out += [f"{mode}:", "", "| variant | ms | ratio | peak MB | memory ratio | graphs | breaks |",
                    "| --- | --- | --- | --- | --- | --- | --- |", *_rows(deit[mode], memory=True), ""]
    mixers = parts.get("mixers", {})
    out += ["### Mixers (paired ratio to timm's `Mixup` in batch mode)", ""]
    if _missing(mixers):
        out += [_missing(mixers) or "", ""]
    else:
        # host ms (runs that timed it): until the calls returned, before the wait for the GPU; near ms, the mixer
        # waits on the host issuing it (Python and launches), not on the GPU's work
        host = any(isinstance(row, dict) and "host_ms_median" in row for row in mixers.values())
        if host:
            out += ["host ms: the time until a mixer's calls returned, before the wait for the GPU; near ms, the mixer waits "
                    "on the host issuing its work (Python and launches), not on the GPU.", ""]
        out += ["| mixer | ms | ratio to timm |" + (" host ms |" if host else ""), "| --- | --- | --- |" + (" --- |" if host else "")]
        for name, row in mixers.items():
            if isinstance(row, dict) and "error" in row and "ms_median" not in row:
                out.append(f"| {name} | left out: {error_cell(row['error'])} | - |" + (" - |" if host else ""))
            if isinstance(row, dict) and "ms_median" in row:
                host_cell = f" {row['host_ms_median']:.2f} |" if "host_ms_median" in row else " - |"
                out.append(f"| {name} | {row['ms_median']:.2f} | {row['paired_ratio']:.3f} "
                           f"[{row['paired_ratio_min']:.3f}, {row['paired_ratio_max']:.3f}] |" + (host_cell if host else ""))
        out.append("")
    tests = parts.get("tests", {})
    out += ["### GPU tests", "", _missing(tests) or f"`{tests.get('command', '?')}`: {tests.get('summary', '?')}", ""]
    if tests.get("counts"):
        out += [", ".join(f"{n} {kind.lower()}" for kind, n in tests["counts"].items()) + " (outcomes printed before the end)", ""]
    if tests.get("failed"):
        out += ["Failed: " + ", ".join(f"`{t}`" for t in tests["failed"]), ""]
    families = parts.get("families", {})
    modes = sorted({str(row.get("mode", "compiled")) for row in families.values() if isinstance(row, dict) and "model" in row})
    out += [f"### Every family's small model, {' and '.join(modes) or 'compiled'} (ratio of CutMix + TL-Align to "
            "CutMix + NoAlign)", ""]
    default_run = families_run(result)  # a summary of runs says which run measured each row
    by_run = default_run is not None
    out += ["| family | model | CutMix ms | TL-Align ms | ratio | memory ratio | graphs (TL-Align) | breaks |"
            + (" run |" if by_run else ""), "| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if by_run else "")]
    for family, row in families.items():
        if not isinstance(row, dict) or family == "seconds":
            continue
        run = f" {row.get('run', default_run)} |" if by_run else ""
        if not family_measured(row):
            out.append(f"| {family} | {row.get('model', '-')} | {_missing(row) or 'not measured'} | | | | | |{run}")
            continue
        c = row["cutmix"]
        # the device's route, then each route timed beside it (``--family-routes``: ``tlalign/<route>`` rows)
        for name in ["tlalign", *(k for k in row if k.startswith("tlalign/"))]:
            t = row[name]
            label = family if name == "tlalign" else f"{family} ({name.partition('/')[2]})"
            if not isinstance(t, dict) or "ms_median" not in t:
                out.append(f"| {label} | {row['model']} | {(_missing(t) if isinstance(t, dict) else None) or 'not timed'} | | | | | |{run}")
                continue
            out.append(f"| {label} | {row['model']} | {c['ms_median']:.2f} | {t['ms_median']:.2f} | {_ratio(t)} | "
                       f"{t['memory_ratio']:.3f} | {t.get('graphs', '-')} | {t.get('graph_breaks', '-')} |{run}")
    out.append("")
    return out + _kernel_rows(deit, families) + _memory_rows(deit, families) + _mixer_profile_rows(mixers)


def _mixer_profile_rows(mixers: dict[str, Any]) -> list[str]:
    """With ``--profile``: a mixer call's time beside its kernels' time and launches, the host's operators and runtime
    calls (self time) and the three that take most of it. What neither accounts for is Python."""
    rows = {name: row for name, row in mixers.items() if isinstance(row, dict) and "profile" in row and "ms_median" in row}
    if not rows:
        return []
    out = [f"### Where a mixer call's time goes (`--profile`: the profiler over {PROFILED_CALLS} calls)", "",
           "| mixer | call ms | kernel ms | launches | host calls ms | top host calls (ms a call) |",
           "| --- | --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        k = row["profile"]
        host = f"{k['host_ms_per_step']:.3f}" if "host_ms_per_step" in k else "-"
        top = ", ".join(f"{t['name'][:40]} {t['ms_per_step']:.3f}" for t in k.get("host_top", [])[:3]) or "-"
        out.append(f"| {name} | {row['ms_median']:.3f} | {k['per_step_ms']:.3f} | {k['launches_per_step']:.0f} | {host} | "
                   + top.replace("|", "\\|") + " |")
    return [*out, ""]


def _profiled_variants(deit: dict[str, Any], families: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(model, variant, row)`` of every variant the DeiT-S compiled pair and each family's pair timed (routes and
    timm's step included), in the summary's order."""
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for name, table in [("DeiT-S compiled", deit.get("compiled", {})), *(
            (f"{row.get('model', family)} {row.get('mode', 'compiled')}", row) for family, row in families.items()
            if isinstance(row, dict))]:
        for variant, row in (table.items() if isinstance(table, dict) else ()):
            if isinstance(row, dict):
                rows.append((name, variant, row))
    return rows


def _memory_rows(deit: dict[str, Any], families: dict[str, Any], top: int = 3) -> list[str]:
    """With ``--profile``: what one more step of each profiled variant adds at its peak, and the lines holding most of
    it there (``_memory_account``): where a memory ratio is over 1, the lines TL-Align adds."""
    rows = [(name, variant, row["memory_account"]) for name, variant, row in _profiled_variants(deit, families)
            if isinstance(row.get("memory_account"), dict)]
    if not rows:
        return []
    out = ["### Who holds a step's bytes at its peak (`--profile`: the allocator's history of one more step)", "",
           f"| model | variant | MB added at the peak | the {top} sites holding most there (MB) |", "| --- | --- | --- | --- |"]
    for name, variant, account in rows:
        if "error" in account:
            out.append(f"| {name} | {variant} | - | no account: {str(account['error'])[:120]} |".replace("\n", " "))
            continue
        held = ", ".join(f"`{site['site']}` {site['mb']:.1f}" for site in account["top"][:top]) or "-"
        out.append(f"| {name} | {variant} | {account['step_mb']:.1f} | " + held.replace("|", "\\|") + " |")
    return [*out, ""]


def _kernel_rows(deit: dict[str, Any], families: dict[str, Any]) -> list[str]:
    """With ``--profile``: each profiled step's time beside its kernels' time and launches. Where the step takes
    longer than its kernels, the GPU waited on the host for the difference (launches, library calls, Python)."""
    rows = [(name, variant, row) for name, variant, row in _profiled_variants(deit, families)
            if "kernels" in row and "ms_median" in row]
    if not rows:
        return []
    out = ["### Where a step's time goes (`--profile`: the profiler's kernel time and launches a step)", "",
           "| model | variant | step ms | kernel ms | launches | step - kernels ms | host calls ms |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, variant, row in rows:
        k = row["kernels"]
        host = f"{k['host_ms_per_step']:.2f}" if "host_ms_per_step" in k else "-"  # runs before the host profile: none
        out.append(f"| {name} | {variant} | {row['ms_median']:.2f} | {k['per_step_ms']:.2f} | {k['launches_per_step']:.0f} | "
                   f"{row['ms_median'] - k['per_step_ms']:.2f} | {host} |")
    return [*out, ""]
