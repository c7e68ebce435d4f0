"""What produced a result: when, on which machine, with which torch, by which command.

Every benchmark writes this next to its figures (``"provenance"`` in its JSON), so a
table generated from the JSON (``python -m benchmarks.report``) can say where its
numbers come from without anyone typing it by hand.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["provenance", "finish", "cpu_model", "current_command", "later_notes", "later_runs", "provenance_line"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: platform's answer is the best there is
    return platform.processor() or platform.machine() or "unknown"


def provenance(command: list[str] | None = None, *, device: str = "cpu") -> dict[str, Any]:
    """Date (UTC), command, machine (cores, CPU model and torch's CPU kernels, GPU), torch and Python versions, load average.

    Args:
        command: the command line (default: ``sys.argv`` with the script's path shortened to its name).
        device: the device the benchmark ran on; a CUDA device adds its name and CUDA's version.
    """
    argv = command if command is not None else ["python", _script(sys.argv[0]), *sys.argv[1:]]
    load = _load_average()
    gpu = None
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(argv),
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        # torch's CPU kernels (AVX2, AVX512, ...): one model name has come with either on this project's machines,
        # and times and last bits differ between them
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu,
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": load,
    }


def finish(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` (from ``provenance``) with the time the job ended and the load average then.

    The load average at both ends tells whether other work shared the cores while timings were taken.
    """
    load = _load_average()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {**record, "finished": now, "load_average_end": load}


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not every platform has a load average
        return []


def _script(path: str) -> str:
    """``benchmarks/speed.py`` for a script under the repository, else the path as given."""
    p = Path(path)
    return f"benchmarks/{p.name}" if p.parent.name == "benchmarks" else path


# A script renamed since a summary recorded its command: RESULTS shows the command under the present name.
RENAMED_SCRIPTS = {"benchmarks/analysis.py": "benchmarks/alignment_analysis.py"}


def current_command(command: str) -> str:
    """``command`` with every renamed script (``RENAMED_SCRIPTS``) under its present name, so it can be run again,
    and its paths as a user types them (``user_path``)."""
    for old, new in RENAMED_SCRIPTS.items():
        command = command.replace(old, new)
    return " ".join(user_path(word) for word in command.split(" "))


def user_path(word: str) -> str:
    """An absolute path of the machine that ran a benchmark, as a user of a checkout types it, whatever the
    machine: the shared data beside the checkout as ``../shared/...`` (the data's default), any other (a scratch
    output directory such as ``/tmp/x/speed``) as ``runs/<its name>``, where the benchmarks' outputs go by
    default. Other words as they are."""
    if not word.startswith("/"):
        return word
    if "/shared/" in word:
        return "../shared/" + word.split("/shared/", 1)[1]
    return f"runs/{Path(word).name}"


def _when(p: dict[str, Any]) -> str:
    return str(p.get("date") or "unknown")


def provenance_line(p: dict[str, Any]) -> str:
    """Command, date, machine and torch version of one measurement, as one markdown paragraph.

    ``p`` is a record of ``provenance`` (finished by ``finish``), as a benchmark's JSON keeps it.
    """
    gpu = p.get("gpu") or "no GPU"
    kernels = f", {p['cpu_kernels']} kernels" if p.get("cpu_kernels") else ""  # not recorded before 2026-11-29
    machine = f"{p.get('cores', '?')} CPU cores ({p.get('cpu', 'unknown CPU')}{kernels}), {gpu}"
    load, end = p.get("load_average"), p.get("load_average_end")
    extra = (f"; load average {load[0]:.2f} at the start" if load else "") + (
        f"{',' if load else '; load average'} {end[0]:.2f} at the end" if end else "")
    recorded = f" ({p['recorded']})" if p.get("recorded") else ""
    busy = max([*(load or [0.0])[:1], *(end or [0.0])[:1]])
    if busy > float(p.get("cores") or 1):
        recorded += (". The load average exceeded the core count: other work shared the cores, so times are slower "
                     "and noisier than on an idle machine")
    command = str(p.get("command", "unknown"))
    renamed = [old for old in RENAMED_SCRIPTS if old in command]
    if renamed:
        recorded += f"; run as `{'`, `'.join(renamed)}`, the script's name then"
    return (f"Command: `{current_command(command)}`  \n"
            f"Date: {_when(p)}{' to ' + str(p['finished']) if p.get('finished') else ''}; machine: {machine}; "
            f"torch {p.get('torch', '?')}{extra}{recorded}")


def later_runs(summary: dict[str, Any]) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], str]]:
    """A per-family table's rows measured after the summary's own run (a row's own ``provenance``): their provenances,
    and each row's mark, " [*1]", " [*2]", ... in the order the rows name them ("" for a row of the summary's run)."""
    later = list({json.dumps(r["provenance"], sort_keys=True): r["provenance"] for r in summary["families"].values()
                  if r.get("provenance") not in (None, summary["provenance"])}.values())
    marks = {json.dumps(p, sort_keys=True): f" [*{i}]" for i, p in enumerate(later, 1)}
    return later, lambda row: marks.get(json.dumps(row.get("provenance"), sort_keys=True), "")


def later_notes(later: list[dict[str, Any]]) -> list[str]:
    """The footnotes of ``later_runs``' marks: each later run's command, date and machine."""
    notes: list[str] = []
    for i, p in enumerate(later, 1):
        notes += ["", f"[*{i}] measured in a later run: " + provenance_line(p).replace("  \n", " ")]
    return notes
