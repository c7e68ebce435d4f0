"""benchmarks/RESULTS.md is generated from benchmarks/results/*.json, and each table says where it comes from."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from benchmarks import ablation, report
from benchmarks._ablation_config import AblationConfig
from benchmarks._provenance import current_command

TINY = ["--rows", "cutmix", "--seeds", "0,1", "--embed-dim", "16", "--depth", "2", "--heads", "2", "--max-steps", "2"]
WHOLE = TINY[2:]  # the same runs for every row of the table
PROVENANCE = {"date": "2030-01-02 03:04 UTC", "command": "python benchmarks/ablation.py --rows cutmix", "cores": 7,
              "cpu": "Test CPU 9000", "gpu": None, "device": "cpu", "torch": "9.9.9", "python": "3.11.0",
              "load_average": [0.5, 0.4, 0.3]}


def test_results_md_is_generated_from_the_summaries() -> None:
    assert report.RESULTS_MD.read_text() == report.render(), (
        "benchmarks/RESULTS.md is out of date: run python -m benchmarks.report"
    )
    assert report.main(["--check"]) == 0


def test_every_committed_summary_states_command_date_machine_and_torch() -> None:
    summaries = sorted(report.RESULTS_DIR.glob("*.json"))
    assert summaries, "benchmarks/results/ holds no summary"
    for path in summaries:
        prov = json.loads(path.read_text())["provenance"]
        for field in ("command", "date", "cores", "cpu", "torch"):
            assert prov.get(field), f"{path.name}: provenance lacks {field}"
        assert f"Command: `{current_command(prov['command'])}`" in report.RESULTS_MD.read_text()


def test_recorded_commands_show_paths_as_a_user_types_them() -> None:
    """A summary keeps the command as it ran (this machine's absolute paths); RESULTS and the README show it with
    paths relative to the checkout, or a scratch output directory as ``runs/<name>``."""
    ran = "python benchmarks/ablation.py --out /tmp/wt15/table8 --data-root /work/shared/data --seeds 0-4"
    assert current_command(ran) == "python benchmarks/ablation.py --out runs/table8 --data-root ../shared/data --seeds 0-4"
    assert current_command("python benchmarks/x.py --out /home/me/mixlabels/runs/a") == "python benchmarks/x.py --out runs/a"
    for text in (report.RESULTS_MD.read_text(), report.README.read_text()):
        commands = [line for line in text.splitlines() if line.startswith("Command: `")]
        assert commands
        assert not [c for c in commands if " /" in c], "a command shows an absolute path of the machine that ran it"


def test_a_renamed_script_is_shown_by_its_present_name_and_its_recorded_one() -> None:
    line = report.provenance_line({**PROVENANCE, "command": "python benchmarks/analysis.py --sharpen 30"})
    assert line.startswith("Command: `python benchmarks/alignment_analysis.py --sharpen 30`")
    assert "run as `benchmarks/analysis.py`, the script's name then" in line
    assert "run as" not in report.provenance_line(PROVENANCE)


def test_a_record_names_the_cpu_kernels_torch_ran() -> None:
    """One CPU model name has come with AVX2 and with AVX-512 kernels on this project's machines (times and last bits
    differ): a record keeps torch's CPU capability and the line names it; an older record without it reads as before."""
    import torch

    from benchmarks._provenance import provenance

    record = provenance(["python", "x.py"])
    assert record["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert f"({record['cpu']}, {record['cpu_kernels']} kernels)" in report.provenance_line(record)
    assert "kernels" not in report.provenance_line(PROVENANCE)


def _fake_ablation(out: Path, top1: dict[tuple[bool, int], float], args: Sequence[str] = TINY) -> AblationConfig:
    """An ablation output directory as a finished job leaves it (results.json), with the given top-1 per run (by
    aligned and seed, whatever the row)."""
    cfg, _ = ablation.resolve_config([*args, "--out", str(out)])
    records = []
    for p in ablation.plan(cfg, 10, "cpu"):
        result = {"top1": top1[(p.cell.aligned, p.seed)], "correct": 1, "evaluated": 64, "train_loss": 2.0, "steps": 2,
                  "train_seconds": 30.0, "eval_seconds": 1.0, "images_per_second": 9.0}
        records.append({"table": 7, "row": p.cell.row, "label": p.cell.label, "aligned": p.cell.aligned,
                        "seed": p.seed, "key": p.key, "run": p.run.model_dump(mode="json"), "result": result,
                        "world": 1, "device": "cpu", "finished": 1.9e9, "data_origin": None})
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps({"config": cfg.model_dump(mode="json"), "runs": records,
                                                  "annotator": None, "provenance": PROVENANCE}))
    return cfg


def _report_files(tmp_path: Path) -> tuple[Path, Path, Path, list[str]]:
    """Where ``report.main`` writes in a test: the summaries' directory, RESULTS.md, a copy of the README, and the
    flags that point it there."""
    results, md, readme = tmp_path / "results", tmp_path / "RESULTS.md", tmp_path / "README.md"
    readme.write_text(report.README.read_text())
    return results, md, readme, ["--results-dir", str(results), "--output", str(md), "--readme", str(readme)]


def test_add_ablation_renders_the_runs_with_their_provenance(tmp_path: Path) -> None:
    top1 = {(False, 0): 20.0, (False, 1): 23.0, (True, 0): 21.0, (True, 1): 25.0}
    _fake_ablation(tmp_path / "out", top1, WHOLE)  # every row of Table 7 (the README's table)
    results, md, readme, paths = _report_files(tmp_path)
    assert report.main(["--add-ablation", str(tmp_path / "out"), *paths]) == 0
    summary = json.loads((results / "table7.json").read_text())
    assert "run" not in summary["runs"][0]  # trimmed: the full run configs stay in the job's own output
    text = md.read_text()
    base = f"{statistics.fmean([20.0, 23.0]):.2f} ± {statistics.stdev([20.0, 23.0]):.2f}"
    aligned = f"{statistics.fmean([21.0, 25.0]):.2f} ± {statistics.stdev([21.0, 25.0]):.2f}"
    # the paired delta: mean 1.5 of the differences (1, 2), 95% t interval 1.5 -+ t(0.975, 1) * sd / sqrt(2)
    half = 12.706204736174698 * statistics.stdev([1.0, 2.0]) / 2**0.5
    delta = f"+1.50 [{1.5 - half:+.2f}, {1.5 + half:+.2f}], 2/2 > 0, no significant difference"
    assert f"| × | ✓ | × | × | {base} | {aligned} | {delta} |" in text
    assert f"Command: `{PROVENANCE['command']}`" in text
    assert "Date: 2030-01-02 03:04 UTC; machine: 7 CPU cores (Test CPU 9000), no GPU; torch 9.9.9" in text
    assert "18 of 18 runs finished" in text
    assert "Reading: of 4 deltas, 0 have a 95% interval above 0, 0 below 0 and 4 span 0." in text
    # the other sections say that they are not measured and how to measure them
    assert "Not measured for this version. Run `python benchmarks/ablation.py --table 8`" in text
    assert f"| × | ✓ | × | × | {base} | {aligned} | {delta} |" in readme.read_text()  # the README's one table
    assert report.main(["--check", *paths]) == 0
    md.write_text(text.replace(base, "99.99 ± 0.00"))
    assert report.main(["--check", *paths]) == 1
    md.write_text(text)
    readme.write_text(readme.read_text().replace(base, "99.99 ± 0.00"))
    assert report.main(["--check", *paths]) == 1


def test_a_job_of_some_rows_is_its_own_section_and_leaves_the_full_table(tmp_path: Path) -> None:
    full = {(False, 0): 20.0, (False, 1): 23.0, (True, 0): 21.0, (True, 1): 25.0}
    _fake_ablation(tmp_path / "full", full, WHOLE)
    _fake_ablation(tmp_path / "some", {key: top1 + 1.0 for key, top1 in full.items()})  # TINY: the CutMix row alone
    results, md, readme, paths = _report_files(tmp_path)
    assert report.main(["--add-ablation", str(tmp_path / "full"), *paths]) == 0
    assert report.main(["--add-ablation", str(tmp_path / "some"), *paths]) == 0
    assert sorted(p.name for p in results.iterdir()) == ["table7-rows.json", "table7.json"]
    text, shown = md.read_text(), readme.read_text()
    full_row, some_row = "| × | ✓ | × | × | 21.50 ± 2.12 | 23.00 ± 2.83 |", "| × | ✓ | × | × | 22.50 ± 2.12 | 24.00 ± 2.83 |"
    section = text.split("## Table 7: some rows with more seeds (CPU default)", 1)[1].split("\n## ", 1)[0]
    assert some_row in section and "4 of 4 runs finished" in section
    assert full_row in text.split("## Table 7: some rows", 1)[0]  # the full table stays, before it
    assert full_row in shown and some_row not in shown  # and the README shows the full table alone
    cfg, _ = ablation.resolve_config(["--table", "8", "--rows", "none,tl-align", "--out", str(tmp_path / "t8")])
    with pytest.raises(ValueError, match="whole of table 8.*layer-last.*without --rows"):
        report.summarize_ablation(tmp_path / "t8", command="python benchmarks/ablation.py --table 8 --rows none,tl-align",
                                  same_machine=True)


def test_output_without_provenance_needs_the_command_and_the_machine(tmp_path: Path) -> None:
    _fake_ablation(tmp_path / "out", {(a, s): 10.0 for a in (False, True) for s in (0, 1)})
    blob = json.loads((tmp_path / "out" / "results.json").read_text())
    del blob["provenance"]
    (tmp_path / "out" / "results.json").write_text(json.dumps(blob))
    with pytest.raises(ValueError, match="--command .* --same-machine"):
        report.summarize_ablation(tmp_path / "out")
    command = "python benchmarks/ablation.py " + " ".join(TINY)
    name, summary = report.summarize_ablation(tmp_path / "out", command=command, same_machine=True)
    assert name == "table7-rows" and summary["provenance"]["command"] == command  # TINY runs one row
    assert summary["provenance"]["date"] == "2030-03-17 17:46 UTC"  # the last run's time stamp, not now
    assert "recorded" in summary["provenance"]


def test_add_speed_keeps_the_tables_and_drops_the_arrays(tmp_path: Path) -> None:
    row = {"img_s": 50.0, "step_ms_median": 1280.0, "step_ms_min": 1200.0, "step_ms_max": 1300.0, "peak_mb": 1600.0,
           "step_mb": 500.0, "alloc_peak_mb": 679.9, "alloc_step_mb": 594.4, "alloc_top_mb": [["aten::mm", 1.0]],
           "step_s_per_round": [1.2, 1.3], "time_ratio": 1.0, "time_ratio_min": 1.0, "time_ratio_max": 1.0,
           "memory_ratio": 1.0, "step_memory_ratio": 1.0, "alloc_ratio": 1.0, "alloc_step_ratio": 1.0}
    config = {"device": "cpu", "model": "tiny", "batch_size": 64, "repeats": 6, "steps": 4}
    speed = {"device": "CPU", "command": "speed.py", "config": config, "steps": {"cutmix": row}}
    (tmp_path / "old.json").write_text(json.dumps(speed))
    with pytest.raises(ValueError, match="no provenance"):
        report.summarize_speed(tmp_path / "old.json")
    (tmp_path / "new.json").write_text(json.dumps({**speed, "provenance": PROVENANCE}))
    name, summary = report.summarize_speed(tmp_path / "new.json")
    assert name == "speed-cpu" and "step_s_per_round" not in summary["steps"]["cutmix"]
    text = report.render_steps(summary)
    assert "| CutMix + NoAlign | 50.0 | 1280.0 [1200.0, 1300.0] | 1.000 [1.000, 1.000] | 679.9 | 1.0000 |" in text


def test_a_summary_no_section_shows_is_refused(tmp_path: Path) -> None:
    (tmp_path / "table9.json").write_text("{}")
    with pytest.raises(ValueError, match="table9.*the sections are table7"):
        report.render(tmp_path)


def test_add_analysis_keeps_the_errors_and_the_rmse(tmp_path: Path) -> None:
    errors = {"cutmix": [0.1, 0.2, 0.3, 0.4], "tl_align": [0.05, 0.1, 0.15, 0.2]}
    numbers: dict[str, Any] = {"config": {"sharpen": 30.0, "checkpoint": None}, "model": {"name": "deit_small_patch16_224"},
               "initialisation": "random init", "grid": [14, 14], "classes": ["a", "b"], "rmse": 0.25,
               "per_block_sample0": {"mean_abs_error_vs_similarity": errors, "class_token": {"cutmix": [0.5] * 4}},
               "rmse_by_size": [{"label": "tiny-like", "kind": "size", "rmse": 0.125, "dim": 192}],
               "provenance": PROVENANCE}
    (tmp_path / "analysis.json").write_text(json.dumps(numbers))
    name, summary = report.summarize_analysis(tmp_path / "analysis.json")
    assert name == "analysis-sharpened" and "class_token" not in json.dumps(summary)
    text = report.render_analysis(summary)
    assert "| scheme | after block 1 | after block 2 | after block 3 | after block 4 |" in text
    assert "| TL-Align | 0.050 | 0.100 | 0.150 | 0.200 |" in text and "| tiny-like | 0.1250 |" in text
    numbers["config"]["sharpen"] = 1.0
    (tmp_path / "analysis.json").write_text(json.dumps(numbers))
    with pytest.raises(ValueError, match="--sharpen"):
        report.summarize_analysis(tmp_path / "analysis.json")


def _fake_analysis(path: Path, checkpoint: str | None, rmse: float, command: str) -> Path:
    errors = {"cutmix": [0.3, 0.4], "tl_align": [0.2, 0.25]}
    numbers = {"config": {"sharpen": 1.0, "checkpoint": checkpoint}, "model": {"name": "deit_tiny_patch16_224"},
               "initialisation": "trained", "grid": [8, 8], "classes": ["a"] * 64, "rmse": rmse,
               "per_block_sample0": {"mean_abs_error_vs_similarity": errors},
               "rmse_by_size": [{"label": "analysed model", "kind": "main", "rmse": rmse}],
               "provenance": {**PROVENANCE, "command": command}}
    path.write_text(json.dumps(numbers))
    return path


def test_add_rmse_compares_trained_checkpoints_row_by_row(tmp_path: Path) -> None:
    scratch = _fake_analysis(tmp_path / "a.json", "s.pth", 0.0125, "analysis.py --checkpoint s.pth")
    tuned = _fake_analysis(tmp_path / "b.json", "t.pth", 0.0625, "analysis.py --checkpoint t.pth")
    name, summary = report.summarize_rmse([("from scratch", scratch), ("fine-tuned", tuned)])
    assert name == "analysis-finetune" and [r["label"] for r in summary["rows"]] == ["from scratch", "fine-tuned"]
    text = report.render_rmse(summary)
    assert "| from scratch | 64 | 0.0125 | 0.400 / 0.250 | `analysis.py --checkpoint s.pth` |" in text
    assert "| fine-tuned | 64 | 0.0625 | 0.400 / 0.250 | `analysis.py --checkpoint t.pth` |" in text
    random_init = _fake_analysis(tmp_path / "c.json", None, 0.01, "analysis.py")
    with pytest.raises(ValueError, match="--sharpen"):  # a random-init, unsharpened run shows nothing
        report.summarize_rmse([("random", random_init)])
    results, md, readme, paths = _report_files(tmp_path)
    assert report.main(["--add-rmse", f"scratch={scratch}", *paths]) == 0
    assert (results / "analysis-finetune.json").is_file() and "| scratch | 64 | 0.0125 |" in md.read_text()
    assert report.main(["--add-rmse", str(scratch), *paths]) == 2  # no LABEL=


def test_a_finetune_job_is_its_own_section_with_its_base_model(tmp_path: Path) -> None:
    cfg, _ = ablation.resolve_config([*TINY, "--profile", "finetune", "--out", str(tmp_path / "out")])
    planned = ablation.plan(cfg, 10, "cpu")
    base_run = ablation.base_run(cfg, 10, "cpu")
    base = {"run": base_run.model_dump(mode="json"),
            "result": {"top1": 55.5, "steps": 1176, "train_seconds": 60.0}}
    records = [{"table": 7, "row": p.cell.row, "label": p.cell.label, "aligned": p.cell.aligned, "seed": p.seed,
                "key": p.key, "result": {"top1": 30.0 + p.seed, "train_seconds": 10.0, "steps": 2}, "finished": 1.9e9}
               for p in planned]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.json").write_text(json.dumps({
        "config": cfg.model_dump(mode="json"), "runs": records, "annotator": None, "base": base,
        "provenance": PROVENANCE}))
    name, summary = report.summarize_ablation(tmp_path / "out")
    assert name == "table7-finetune" and summary["base"]["result"]["top1"] == 55.5
    text = report.render_ablation(summary)
    assert "Fine-tuned from one base model" in text and "top-1 55.50% on its own test images" in text


def test_add_speed_of_a_families_run_is_its_own_section(tmp_path: Path) -> None:
    row = {"img_s": 4.0, "step_ms_median": 500.0, "step_ms_min": 490.0, "step_ms_max": 510.0, "peak_mb": 900.0,
           "step_mb": 100.0, "alloc_peak_mb": 300.0, "alloc_step_mb": 120.0, "step_s_per_round": [0.5, 0.5]}
    aligned = {**row, "time_ratio": 1.025, "time_ratio_min": 1.01, "time_ratio_max": 1.04, "alloc_ratio": 1.0,
               "alloc_step_ratio": 1.0005}
    config = {"device": "cpu", "variants": ["cutmix", "tlalign"], "batch_size": 8, "repeats": 5, "steps": 2}
    families = {"swin": {"model": "swin_tiny_patch4_window7_224", "steps": {"cutmix": row, "tlalign": aligned},
                         "refused": {}}}
    (tmp_path / "f.json").write_text(json.dumps({"device": "CPU", "command": "speed.py --families", "config": config,
                                                 "provenance": PROVENANCE, "families": families}))
    name, summary = report.summarize_speed(tmp_path / "f.json")
    assert name == "speed-families-cpu" and "step_s_per_round" not in json.dumps(summary)
    text = report.render_families(summary)
    assert "| swin | `swin_tiny_patch4_window7_224` (500) | 1.025 [1.010, 1.040] | 1.0000 | 1.0005 |" in text


def test_the_reading_counts_intervals_above_and_below_zero(tmp_path: Path) -> None:
    top1 = {(False, 0): 20.0, (False, 1): 23.0, (True, 0): 21.0, (True, 1): 24.1}  # differences 1.0, 1.1
    cfg = _fake_ablation(tmp_path / "out", top1)
    records = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    text = report.reading(cfg, ablation.plan(cfg, 10, "cpu"), records)
    assert text.startswith("Reading: of 1 delta, 1 has a 95% interval above 0 (") and "0 below 0 and 0 span 0." in text


def test_several_families_runs_make_one_table_later_rows_replacing_earlier(tmp_path: Path) -> None:
    row = {"img_s": 4.0, "step_ms_median": 500.0, "step_ms_min": 490.0, "step_ms_max": 510.0, "peak_mb": 900.0,
           "step_mb": 100.0, "alloc_peak_mb": 300.0, "alloc_step_mb": 120.0}
    config = {"device": "cpu", "variants": ["cutmix", "tlalign"], "batch_size": 8, "repeats": 3, "steps": 2}

    def run(name: str, ratios: dict[str, float], date: str) -> Path:
        families = {f: {"model": f"{f}_model", "refused": {}, "steps": {"cutmix": row, "tlalign": {
            **row, "time_ratio": r, "time_ratio_min": r, "time_ratio_max": r, "alloc_ratio": 1.0,
            "alloc_step_ratio": 1.0}}} for f, r in ratios.items()}
        (tmp_path / name).write_text(json.dumps({"config": config, "families": families,
                                                 "provenance": {**PROVENANCE, "date": date}}))
        return tmp_path / name

    first = run("a.json", {"vit": 1.02, "beit": 1.5}, "2030-01-02 03:04 UTC")
    again = run("b.json", {"beit": 1.01}, "2030-01-02 05:06 UTC")
    name, summary = report.merge_speed([report.summarize_speed(first), report.summarize_speed(again)])
    text = report.render_families(summary)
    assert name == "speed-families-cpu" and list(summary["families"]) == ["vit", "beit"]
    assert "| vit | `vit_model` (500) | 1.020 [1.020, 1.020] |" in text
    assert "| beit [*1] | `beit_model` (500) | 1.010 [1.010, 1.010] |" in text and "1.500" not in text
    assert "[*1] measured in a later run: Command:" in text and "2030-01-02 05:06 UTC" in text
    # the committed summary passed again with a new run: every row keeps the run that measured it, each its own mark
    (tmp_path / "committed.json").write_text(json.dumps(summary))
    third = run("c.json", {"gmlp": 1.04}, "2030-01-03 07:08 UTC")
    _, merged = report.merge_speed([report.summarize_speed(tmp_path / "committed.json"), report.summarize_speed(third)])
    text = report.render_families(merged)
    assert "| vit | `vit_model`" in text and "| beit [*1] | `beit_model`" in text and "| gmlp [*2] | `gmlp_model`" in text
    assert "[*1] measured in a later run" in text and "2030-01-02 05:06 UTC" in text
    assert "[*2] measured in a later run" in text and "2030-01-03 07:08 UTC" in text
    with pytest.raises(ValueError, match="combines several speed.py --families runs"):
        report.merge_speed([report.summarize_speed(first), ("speed-cpu", {})])


def _op_count_run(path: Path, counts: dict[str, int], date: str, batch_size: int = 2) -> Path:
    """An ``op_count.py`` JSON of ``counts`` (family: TL-Align's operators against NoAlign's 100)."""
    families = {f: {"model": f"{f}_model", "cutmix": 100, "tlalign": n, "ratio": n / 100, "cutmix_kernels": 50,
                    "tlalign_kernels": n // 2, "kernel_ratio": n / 100, "top_added": [["view", 3]],
                    "cutmix_ops": {"add": 1}, "tlalign_ops": {"add": 2}} for f, n in counts.items()}
    path.write_text(json.dumps({"provenance": {**PROVENANCE, "date": date}, "batch_size": batch_size, "families": families}))
    return path


def test_a_run_of_a_few_families_adds_to_the_op_count_table_and_alone_is_refused(
    tmp_path: Path, report_copy: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """op_count.py --families resnet given alone would have replaced the 65-family table with one row: refused, naming
    the rows it would drop and the fix (nothing written); given after the committed summary, its row replaces
    resnet's, marked with its run, every other row kept; --replace takes it whole."""
    args = report_copy
    committed = tmp_path / "results" / "op-count.json"
    before = committed.read_text()
    families = list(json.loads(before)["families"])
    assert len(families) > 10 and "resnet" in families
    run = _op_count_run(tmp_path / "op_count.json", {"resnet": 120}, "2030-01-05 06:07 UTC")
    assert report.main([*args, "--add-op-count", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{len(families) - 1} rows would be dropped" in err and families[0] in err
    assert f"--add-op-count {committed} <the run's JSON files>" in err and "--replace" in err
    assert committed.read_text() == before and not (tmp_path / "RESULTS.md").exists()

    assert report.main([*args, "--add-op-count", str(committed), str(run)]) == 0
    merged = json.loads(committed.read_text())["families"]
    assert list(merged) == families and merged["resnet"]["tlalign"] == 120
    table = json.loads(before)
    assert all({k: v for k, v in merged[f].items() if k != "provenance"} == table["families"][f]
               and merged[f]["provenance"] == table["provenance"] for f in families if f != "resnet")
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| resnet [*1] | resnet_model | 100 | 120 | 1.200 |" in text
    assert "[*1] measured in a later run: Command:" in text and "2030-01-05 06:07 UTC" in text
    assert f"| {families[0]} | " in text  # the others unmarked, as their run counted them

    assert report.main([*args, "--replace", "--add-op-count", str(run)]) == 0
    assert list(json.loads(committed.read_text())["families"]) == ["resnet"]


def test_op_count_runs_of_different_kinds_or_batches_do_not_combine(tmp_path: Path) -> None:
    from benchmarks._results_op_count import merge_op_counts, summarize_op_count

    one = summarize_op_count(_op_count_run(tmp_path / "a.json", {"vit": 110}, "2030-01-05 06:07 UTC"))
    other = summarize_op_count(_op_count_run(tmp_path / "b.json", {"vit": 110}, "2030-01-05 06:07 UTC", batch_size=4))
    with pytest.raises(ValueError, match="batches of 2 and 4"):
        merge_op_counts([one, other])
    whole = summarize_op_count(report.RESULTS_DIR / "op-count-whole.json")  # a committed summary says its kind by name
    assert whole[0] == "op-count-whole"
    with pytest.raises(ValueError, match="runs of one kind"):
        merge_op_counts([whole, one])


def test_a_mixers_op_count_is_its_own_section(tmp_path: Path, report_copy: list[str]) -> None:
    """``op_count.py --mixers`` (a real count, small batch) goes to its own section, with its batch and image size, the
    CUDA path's host operators said once; one run makes the table (two are refused). Batch-mode MixUp launches fewer
    CUDA kernels than timm's (a scalar blend and a matmul for the targets, where timm scales and adds twice)."""
    from benchmarks import op_count
    from benchmarks._results_op_count import merge_op_counts, summarize_op_count

    counted = op_count.main(["--mixers", "MixUp", "--batch-size", "4", "--size", "32", "--patch", "4", "--out", str(tmp_path / "run")])
    assert set(counted["mixers"]) == {"ours MixUp", "ours MixUp (elem)", "timm MixUp (batch)", "timm MixUp (elem)"}
    mixup = counted["mixers"]["ours MixUp"]
    assert mixup["cuda_syncs"] == 0 and mixup["cuda_h2d"] == 1 and mixup["cuda_kernel_ratio"] < 1.0
    run = tmp_path / "run" / "op_count_mixers.json"
    assert report.main([*report_copy, "--add-op-count", str(run)]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    section = text.split("## Operators a mixer call dispatches (CPU, and a CUDA batch's path)")[1].split("\n## ")[0]
    assert "One call on a batch of 4x3x32x32" in section and "| ours MixUp | " in section
    assert section.count("Host operators on the CUDA path:") == 1 and "(every one of ours)" in section
    with pytest.raises(ValueError, match="one op_count.py --mixers JSON"):
        merge_op_counts([summarize_op_count(run), summarize_op_count(run)])


def test_a_speed_run_of_a_few_families_alone_is_refused(
    tmp_path: Path, report_copy: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The same for speed.py --families: its JSON alone would have replaced the committed table's rows."""
    args = report_copy
    committed = tmp_path / "results" / "speed-control-cpu.json"
    summary = json.loads(committed.read_text())
    family, row = next(iter(summary["families"].items()))
    run = tmp_path / "speed-families-cpu-x.json"
    run.write_text(json.dumps({"device": "CPU", "command": "speed.py --families", "config": summary["config"],
                               "provenance": {**PROVENANCE, "date": "2030-01-06 01:02 UTC"},
                               "families": {family: {k: v for k, v in row.items() if k != "provenance"}}}))
    assert report.main([*args, "--add-speed", str(run)]) == 2
    assert "rows would be dropped" in capsys.readouterr().err and committed.read_text() == json.dumps(summary, indent=1) + "\n"
    assert report.main([*args, "--add-speed", str(committed), str(run)]) == 0
    assert len(json.loads(committed.read_text())["families"]) == len(summary["families"])


@pytest.mark.parametrize(("key", "value", "flag"), [("batch_size", 16, "--batch-size"), ("steps", 4, "--steps"),
                                                   ("threads", 1, "--threads")])
def test_families_runs_of_other_settings_do_not_share_a_table(key: str, value: int, flag: str, tmp_path: Path) -> None:
    """A table says one batch size, step count and thread count for all its rows: a run of another is refused (a
    batch-16 row would have read as batch 8's); more rounds are only more precision: merged, the header says a
    marked row's rounds are its run's."""
    row = {"img_s": 4.0, "step_ms_median": 500.0, "step_ms_min": 490.0, "step_ms_max": 510.0, "peak_mb": 900.0,
           "step_mb": 100.0, "alloc_peak_mb": 300.0, "alloc_step_mb": 120.0}
    aligned = {**row, "time_ratio": 1.02, "time_ratio_min": 1.0, "time_ratio_max": 1.05, "alloc_ratio": 1.0,
               "alloc_step_ratio": 1.0}
    config = {"device": "cpu", "variants": ["cutmix", "tlalign"], "batch_size": 8, "repeats": 3, "steps": 2, "threads": 2}

    def run(name: str, family: str, cfg: dict[str, Any]) -> Path:
        families = {family: {"model": f"{family}_model", "refused": {}, "steps": {"cutmix": row, "tlalign": aligned}}}
        (tmp_path / name).write_text(json.dumps({"config": cfg, "families": families, "provenance": {
            **PROVENANCE, "date": name}}))
        return tmp_path / name

    first = report.summarize_speed(run("a.json", "vit", config))
    with pytest.raises(ValueError, match=f"timed with {flag} {config[key]} and {value}"):
        report.merge_speed([first, report.summarize_speed(run("b.json", "beit", {**config, key: value}))])
    _, merged = report.merge_speed([first, report.summarize_speed(run("c.json", "beit", {**config, "repeats": 20}))])
    text = report.render_families(merged)
    assert "3 interleaved rounds of 2 steps (a row marked [*n]: its run's rounds" in text and "| beit [*1] |" in text
    assert "(a row marked" not in report.render_families(first[1])  # one run: no marked row, no such words
