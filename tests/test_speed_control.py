"""The A/A control and the page-fault count of ``speed.py --families``, and what ``--malloc keep`` does to glibc."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import _families, _malloc, speed
from benchmarks._interleave import interleaved_times

REPO = Path(__file__).resolve().parent.parent


def test_interleaved_counts_are_the_counter_rise_per_call() -> None:
    """Each round's count is what the counter rose by during the entry's block, divided by the calls in it."""
    total = [0]

    def bump(by: int) -> None:
        total[0] += by

    counts: dict[str, list[float]] = {}
    times = interleaved_times({"a": lambda: bump(3), "b": lambda: bump(10)}, rounds=3, per_block=2, warmup=1,
                              sync=lambda: None, progress=lambda _: None, label="r", counter=lambda: total[0],
                              counts=counts)
    assert counts == {"a": [3.0] * 3, "b": [10.0] * 3} and all(len(t) == 3 for t in times.values())
    absent: dict[str, list[float]] = {}  # a counter that has nothing to say (no getrusage) leaves the lists empty
    interleaved_times({"a": lambda: None}, rounds=2, per_block=1, warmup=0, sync=lambda: None,
                      progress=lambda _: None, label="r", counter=lambda: None, counts=absent)
    assert absent == {"a": []}


_WORK = """
import sys
sys.path.insert(0, {repo!r})
import torch
from benchmarks._malloc import keep_heap, minor_faults
if sys.argv[1] == "keep":
    keep_heap()
def work():  # 40 MB tensors: over glibc's largest mmap threshold (32 MB), so mapped afresh by default
    x = torch.empty(10_000_000); x.fill_(1.0); y = x * 2; del x; z = y + 1; del y, z
rises = []
for _ in range(12):
    before = minor_faults(); work(); rises.append(minor_faults() - before)
print(rises)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
def test_keep_heap_stops_the_faults_a_step_pays_to_glibc() -> None:
    """The default malloc maps each 40 MB block afresh (about 9.8 thousand faults a block, every call); with the heap
    kept, once the heap has grown to what a call needs, the calls reuse pages already faulted in. Measured: about 29
    thousand a call by default; kept, 0 from the third to fifth call in most runs (the heap's layout decides when, and now and then a later call
    still grows it by a block)."""
    script = textwrap.dedent(_WORK.format(repo=str(REPO)))
    rises = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True).stdout
        rises[mode] = [int(n) for n in out.strip().strip("[]").split(",")]
    assert min(rises["default"][2:]) > 2 * 9_765  # at least two of the three blocks faulted in, every call
    warm = sorted(rises["keep"][-6:])
    # Warmed up, most calls fault nothing (Python's own small objects at most); a call that finds the heap's free
    # blocks split where it needs one whole extends the heap once more (seen once in CI: one block, 9766 faults).
    assert warm[3] < 200 and sum(warm) < sum(rises["default"][-6:]) / 3, rises["keep"]


def test_keep_heap_refuses_loudly_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_malloc.sys, "platform", "win32")
    with pytest.raises(RuntimeError, match="--malloc keep needs glibc's mallopt .*--malloc default"):
        _malloc.keep_heap()


def test_families_with_the_control_and_the_kept_heap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--variants cutmix cutmix-again tlalign --malloc keep``: the control is timed like any variant (its ratio to
    the baseline is the run's noise), faults a step are recorded per variant, the timing process keeps its heap
    (the call is stubbed here: it is process-wide, and the test above runs it in a process of its own), and the
    report files the run in its own RESULTS section with the faults and the malloc setting shown."""
    from benchmarks import report

    kept: list[bool] = []
    monkeypatch.setattr(speed, "keep_heap", lambda: kept.append(True))
    monkeypatch.setattr(_families, "family_models", lambda: {"convnext": "example:convnext"})
    result = speed.main(["--families", "convnext", "--num-classes", "10", "--batch-size", "2", "--steps", "1",
                         "--warmup", "1", "--repeats", "2", "--variants", "cutmix", "cutmix-again", "tlalign",
                         "--malloc", "keep", "--out", str(tmp_path)])
    assert kept == [True]
    steps = result["families"]["convnext"]["steps"]
    assert set(steps) == {"cutmix", "cutmix-again", "tlalign"}
    control = steps["cutmix-again"]
    assert control["time_ratio_min"] <= control["time_ratio"] <= control["time_ratio_max"]
    # the control is the baseline's step: the same allocations to the byte (memory runs in fresh processes)
    assert control["alloc_step_ratio"] == pytest.approx(1.0, abs=1e-6)
    for s in steps.values():
        assert 0 <= s["faults_per_step"] <= s["faults_per_step_max"]
    printed = next(tmp_path.glob("speed-families-*.md")).read_text()
    assert "| CutMix + NoAlign again (A/A control) time |" in printed and "malloc: kept heap" in printed
    name, summary = report.summarize_speed(next(tmp_path.glob("speed-families-*.json")))
    assert name == "speed-control-cpu" and summary["config"]["malloc"] == "keep"
    text = report.render_families(summary)
    assert "page faults a step |" in text and "malloc: kept heap (`--malloc keep`" in text
    row = next(line for line in text.splitlines() if line.startswith("| convnext"))
    assert row.count(" / ") == 2  # three variants' faults, baseline first
    other = {**summary, "config": {**summary["config"], "malloc": "default"}}
    with pytest.raises(ValueError, match="different --malloc settings"):
        report.merge_speed([(name, summary), (name, other)])


def test_a_table_of_rows_without_faults_shows_no_fault_column() -> None:
    """Rows measured before faults were counted (the committed tables) render as they did."""
    import json

    from benchmarks import report

    summary = json.loads((report.RESULTS_DIR / "speed-families-cpu.json").read_text())
    for row in summary["families"].values():
        for s in row["steps"].values():
            s.pop("faults_per_step", None)
    assert "page faults" not in report.render_families(summary)


def test_every_report_of_a_run_says_how_its_malloc_was_set() -> None:
    """A single-model run, a label profile and its mixers time in a process ``--malloc keep`` changes too: their
    printed reports and RESULTS tables state the setting the run recorded; a summary of a run from before the
    option (no setting recorded, glibc's default) renders as it did."""
    import json

    from benchmarks import report
    from benchmarks._results_speed import render_mixers
    from benchmarks._speed_tables import format_label_families, format_report

    kept = "malloc: kept heap (`--malloc keep`"
    steps = json.loads((report.RESULTS_DIR / "speed-cpu.json").read_text())
    labels = json.loads((report.RESULTS_DIR / "speed-labels-cpu.json").read_text())
    renders = [report.render_steps, render_mixers]
    for summary, render in [(steps, r) for r in renders] + [(labels, report.render_label_work)]:
        before = {**summary, "config": {k: v for k, v in summary["config"].items() if k != "malloc"}}
        assert "malloc:" not in render(before)
        keep = {**summary, "config": {**summary["config"], "malloc": "keep"}}
        assert kept in render(keep)
        default = {**summary, "config": {**summary["config"], "malloc": "default"}}
        assert "malloc: glibc's default" in render(default)
    head = {"device": "cpu", "command": "speed.py"}
    assert kept in format_report({**head, **steps, "config": {**steps["config"], "malloc": "keep"}})
    printed = format_label_families({**head, **labels, "config": {**labels["config"], "malloc": "keep"}})
    assert kept in printed
    family = next(iter(labels["families"]))
    assert any(line.startswith(f"| {family} |") for line in printed.splitlines())  # the progress line's row


def test_printed_and_results_family_rows_hold_the_same_cells() -> None:
    """``format_families`` (printed) and ``render_families`` (RESULTS) build a family's cells with one function:
    the same figures after the model cell, a refused variant and the faults included."""
    import json

    from benchmarks import report
    from benchmarks._speed_tables import format_families

    summary = json.loads((report.RESULTS_DIR / "speed-control-cpu.json").read_text())
    family, row = next(iter(summary["families"].items()))
    variants = [v for v in summary["config"]["variants"] if v != "cutmix"]
    refused = {**row, "steps": {k: v for k, v in row["steps"].items() if k != variants[-1]}}
    for r in (row, refused):
        one = {**summary, "families": {family: r}}
        printed = next(line for line in format_families({**one, "device": "cpu", "command": ""}).splitlines()
                       if line.startswith(f"| {family} |"))
        committed = next(line for line in report.render_families(one).splitlines() if line.startswith(f"| {family}"))
        assert printed.split(" | ")[2:] == committed.split(" | ")[2:], (printed, committed)
    assert "refused | - | -" in printed and printed.count(" / ") == 2
