"""The GPU suite's machinery on the CPU (its dry run), and the operator count.

The suite runs where device time is scarce, so what can fail on any machine is checked here: every
part writes its figures or says why not, the deadline stops it between units of work, and the
report renders what it wrote.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import _compile_whole, _mixer_ops, _training_step, gpu_suite, op_count
from benchmarks._results_op_count import render_whole, summarize_op_count
from benchmarks._gpu_steps import Steps
from benchmarks.gpu_report import summary_table
from mixlabels.backbones import ROUTES, _attention


def test_dry_run_routes_every_route_against_plain_sdpa(tmp_path: Path) -> None:
    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "routes", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert saved["parts"].keys() == {"routes"} and saved["provenance"]["finished"]
    for table in result["parts"]["routes"].values():
        if isinstance(table, dict):
            assert set(table) == {"plain SDPA (no labels)", *ROUTES}
            assert table["plain SDPA (no labels)"]["ratio"] == 1.0
            assert all(len(row["ms_per_round"]) == 2 and row["ms_median"] > 0 for row in table.values())
    assert "| separate |" in summary_table(result)


def test_route_shapes_time_a_models_own_attention_shapes(tmp_path: Path) -> None:
    """--route-shapes: the routes part times the shapes given (a trailing m: with a mask) instead of its own, every
    route against plain SDPA; a malformed shape is refused by name, with the form it takes."""
    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "routes", "--route-shapes", "2x2x9x8", "3x1x5x16m",
                             "--out", str(tmp_path)])
    tables = {name: table for name, table in result["parts"]["routes"].items() if isinstance(table, dict)}
    assert list(tables) == ["2 x 2 heads x 9 tokens x 8", "3 x 1 heads x 5 tokens x 16, mask"]
    for table in tables.values():
        assert set(table) == {"plain SDPA (no labels)", *ROUTES} and all(row["ms_median"] > 0 for row in table.values())
    for bad in ("2x2x9", "2x2x9x0", "2x2x9x8q"):
        with pytest.raises(SystemExit):
            gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "routes", "--route-shapes", bad, "--out", str(tmp_path)])


def test_a_route_that_fails_is_left_out_and_said_and_the_others_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate route a GPU refuses (a raw kernel this cuDNN or torch does not take) costs its own row, not the
    part: the routes and DeiT-S tables time the others and name the error."""
    import mixlabels.backbones._attention as attention

    def refuse(*args: object) -> None:
        raise RuntimeError("cuDNN Frontend error: no engine for these head dims")

    monkeypatch.setattr(attention, "_wider_v_kernel", refuse)
    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "routes", "--out", str(tmp_path)])
    tables = [table for table in result["parts"]["routes"].values() if isinstance(table, dict)]
    assert len(tables) == 2
    for table in tables:
        assert table["wider-v"] == {"error": "RuntimeError: cuDNN Frontend error: no engine for these head dims"}
        assert all(row["ms_median"] > 0 for name, row in table.items() if name != "wider-v")
    assert "| wider-v | - | left out: RuntimeError: cuDNN Frontend error: no engine for these head dims |" in summary_table(result)


def test_a_mixer_left_out_is_a_row_saying_why() -> None:
    timm = {"ms_median": 2.0, "paired_ratio": 1.0, "paired_ratio_min": 1.0, "paired_ratio_max": 1.0}
    result = {"parts": {"mixers": {"ours FMix": {"error": "RuntimeError: boom | bang\nmore"}, "timm CutMix (batch)": timm}}}
    table = summary_table(result)
    assert "| ours FMix | left out: RuntimeError: boom \\| bang | - |" in table
    assert "| timm CutMix (batch) | 2.00 | 1.000 [1.000, 1.000] |" in table


def test_a_spent_deadline_skips_every_part_and_says_so(tmp_path: Path) -> None:
    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--budget-s", "0", "--out", str(tmp_path)])
    assert {name: part.get("skipped") for name, part in result["parts"].items()} == dict.fromkeys(gpu_suite.PARTS, "deadline")
    assert "skipped: deadline" in summary_table(result)


def test_mixer_rows_give_the_hosts_share_where_a_run_timed_it() -> None:
    """The mixers' timing keeps, per round, the time until the calls returned before the wait for the device (a sync
    that waits is counted in the full time only), and the GPU table shows it beside each mixer's time; a summary from
    before has no such column."""
    from benchmarks._interleave import interleaved_times
    from benchmarks.gpu_report import gpu_section

    host: dict[str, list[float]] = {}
    times = interleaved_times({"a": lambda: None}, rounds=2, per_block=2, warmup=0, sync=lambda: time.sleep(0.02),
                              progress=lambda message: None, label="t", host=host)
    assert len(host["a"]) == 2 and all(h < 0.005 < t for h, t in zip(host["a"], times["a"]))

    def row(ms: float, **more: float) -> dict[str, float]:
        return {"ms_median": ms, "paired_ratio": 3.5, "paired_ratio_min": 1.0, "paired_ratio_max": 4.0, **more}

    mixers = {"ours CutMix": row(0.59, host_ms_median=0.55), "timm CutMix (batch)": row(0.16, host_ms_median=0.04),
              "ours FMix": {"error": "RuntimeError: x"}}
    text = "\n".join(gpu_section({"parts": {"mixers": mixers}}))
    assert "| mixer | ms | ratio to timm | host ms |" in text and "| ours CutMix | 0.59 | 3.500 [1.000, 4.000] | 0.55 |" in text
    assert "| ours FMix | left out: RuntimeError: x | - | - |" in text
    old = "\n".join(gpu_section({"parts": {"mixers": {k: {key: v for key, v in r.items() if key != "host_ms_median"}
                                                      for k, r in mixers.items()}}}))
    assert "| mixer | ms | ratio to timm |\n" in old and "host ms" not in old


def test_profile_says_where_a_batch_mode_mixer_calls_time_goes(tmp_path: Path) -> None:
    """--profile on the mixers part: a call of batch-mode CutMix and MixUp, ours and timm's, profiled after the timing
    (the CPU's operators here; on a GPU its kernels and the host's calls), and a table of them in the summary."""
    from benchmarks._mixer_timing import PROFILED

    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "mixers", "--profile", "--rounds", "1", "--steps",
                             "1", "--batch-size", "2", "--out", str(tmp_path)])
    mixers = result["parts"]["mixers"]
    assert {name for name, row in mixers.items() if isinstance(row, dict) and "profile" in row} == set(PROFILED)
    for name in PROFILED:
        table = mixers[name]["profile"]
        assert table["per_step_ms"] > 0 and table["launches_per_step"] >= len(table["top"]) > 0
    text = summary_table(result)
    assert "### Where a mixer call's time goes" in text and "| ours MixUp | " in text.split("### Where a mixer call's")[1]
    plain = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "mixers", "--rounds", "1", "--steps", "1",
                            "--batch-size", "2", "--out", str(tmp_path / "plain")])
    assert not any(isinstance(row, dict) and "profile" in row for row in plain["parts"]["mixers"].values())
    assert "Where a mixer call's time goes" not in summary_table(plain)


def test_op_count_counts_what_the_label_path_adds() -> None:
    row = op_count.count_step("example:vit")
    assert row["tlalign"] > row["cutmix"] > 0 and row["added"] == row["tlalign"] - row["cutmix"]
    assert row["tlalign_kernels"] < row["tlalign"]  # views are counted apart
    assert sum(row["tlalign_ops"].values()) == row["tlalign"]
    assert row["top_added"] and all(n > 0 for _, n in row["top_added"])


def test_op_counter_counts_as_computing_only_what_launches_a_kernel() -> None:
    """``OpCounter.kernels``: a product and a copy compute; views, ``_unsafe_view`` (what ``reshape`` of a fresh
    product dispatches: a view autograd does not track) and allocations (``empty``) launch nothing on a GPU. Every
    operator is counted by name either way."""
    from benchmarks._op_counter import OpCounter

    a, b = torch.randn(2, 3, 4), torch.randn(4, 5)
    with OpCounter() as counter:
        product = a @ b  # 3-d @ 2-d: a view, mm, _unsafe_view
        product.permute(0, 2, 1).contiguous()  # a view and a copy
        torch.empty(3)
    assert counter.ops["mm"] == 1 and counter.ops["_unsafe_view"] == 1 and counter.ops["empty"] == 1, counter.ops
    assert counter.kernels == 2, counter.ops  # mm and the copy's clone
    assert sum(counter.ops.values()) > counter.kernels + 3


def test_compiled_calls_count_generated_kernels_and_extern_operators() -> None:
    """A compiled conv, relu and sum: one extern convolution a call, the rest generated kernels (inductor)."""
    from benchmarks._compiled_count import count_compiled_calls, is_aten_operator

    weight = torch.randn(4, 3, 3, 3)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(x, weight, padding=1).relu().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(compiled(x), f(x))
    counted = count_compiled_calls(lambda: compiled(x) and None, steps=3)
    assert counted["extern"] == {"convolution": 1.0}
    assert counted["kernels"] >= 1 and counted["launches"] == counted["kernels"] + 1
    assert is_aten_operator("mm") and not is_aten_operator("is_grad_enabled") and not is_aten_operator("empty_strided")



def test_op_count_whole_finds_one_graph_equal_to_eager_and_renders_it(tmp_path: Path) -> None:
    result = op_count.main(["--whole", "--example", "--families", "vit", "--out", str(tmp_path)])
    row = result["families"]["vit"]
    assert row["whole"] and (row["graphs"], row["graph_breaks"]) == (1, 0), row
    assert all(row[k] <= _compile_whole.TOLERANCE for k in ("target", "logits", "loss", "grad"))
    name, summary = summarize_op_count(tmp_path / "op_count_whole.json")
    assert name == "op-count-whole"
    table = render_whole(summary)
    assert "| vit | example:vit | yes | 1 | 0 |" in table and "1 of 1 families compile whole" in table


def test_op_count_whole_catches_a_graph_break(monkeypatch: pytest.MonkeyPatch) -> None:
    head_mean = _attention._head_mean

    def breaking(y: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return head_mean(y)

    monkeypatch.setattr(_attention, "_head_mean", breaking)
    row = _compile_whole.compiles_whole("example:vit")
    assert not row["whole"] and "graph_break" in row["error"].lower().replace(" ", "_"), row
    assert "| vit | example:vit | no: " in render_whole({"provenance": {}, "families": {"vit": row}})


def test_op_count_whole_catches_a_compiled_value_that_differs_from_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    head_mean = _attention._head_mean

    def off_when_compiled(y: torch.Tensor) -> torch.Tensor:
        out = head_mean(y)
        return out.roll(1, dims=-1) if torch.compiler.is_compiling() else out  # sources swapped

    monkeypatch.setattr(_attention, "_head_mean", off_when_compiled)
    row = _compile_whole.compiles_whole("example:vit")
    assert (row["graphs"], row["graph_breaks"]) == (1, 0) and row["target"] > _compile_whole.TOLERANCE
    assert not row["whole"]


@pytest.mark.slow
def test_op_count_compiled_counts_each_label_conv_route() -> None:
    row = op_count.count_compiled_step("resnet18", steps=1)
    assert set(row["ratios"]) == {"tlalign/conv", "tlalign/shifted"}
    base, conv, shifted = row["cutmix"], row["tlalign/conv"], row["tlalign/shifted"]
    assert shifted["extern"]["convolution"] == base["extern"]["convolution"]  # no label convolution left
    assert conv["extern"]["convolution"] > base["extern"]["convolution"]
    assert base["launches"] < shifted["launches"] < conv["launches"]


def test_speed_gpu_suite_and_op_count_build_their_steps_with_one_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    """speed.py's step timing, the GPU suite's Steps and op_count's count_step all set up ``TrainingSteps``."""
    built: list[str] = []
    init = _training_step.TrainingSteps.__init__

    def recording(self: _training_step.TrainingSteps, model_name: str, **kw: Any) -> None:
        built.append(model_name)
        init(self, model_name, **kw)

    monkeypatch.setattr(_training_step.TrainingSteps, "__init__", recording)
    speed_args = argparse.Namespace(device="cpu", model="example:vit", num_classes=10, batch_size=2, amp=False)
    assert isinstance(_training_step.TrainingSteps.for_args(speed_args, ["cutmix"]), _training_step.TrainingSteps)
    suite_steps = Steps("example:vit", argparse.Namespace(device="cpu", num_classes=1000, batch_size=2))
    assert isinstance(suite_steps, _training_step.TrainingSteps) and set(suite_steps.adapted) == {"cutmix", "tlalign"}
    op_count.count_step("example:vit")
    assert built == ["example:vit"] * 3


def test_mixers_on_the_cuda_path_launch_no_more_kernels_than_timm_and_never_sync() -> None:
    """Issue 28, counted on fake CUDA tensors: params drawn on the host, sent in at most two copies (pixels, map)."""
    ours = ["ours CutMix", "ours MixUp", "ours RandomPatchMix", "ours BlockwiseMix", "ours MixToken", "ours TokenMix"]
    rows = _mixer_ops.count_mixers(batch_size=8, size=32, num_classes=10, patch=4, names=ours)
    for name in ours:
        row = rows[name]
        assert row["cuda_error"] is None and row["cuda_syncs"] == 0, (name, row["cuda_sync_sites"], row["cuda_error"])
        assert row["cuda_h2d"] <= 2 and row["cuda_kernel_ratio"] <= 1.0, (name, row["cuda_ops"])
    assert rows["timm CutMix (batch)"]["cuda_kernels"] > 0 and "| ours CutMix |" in _mixer_ops.format_mixers(rows)


def test_every_mixer_runs_at_the_dry_runs_size() -> None:
    """The dry run times the mixers at 128 px: every candidate (BlockwiseMix's 16 cells need an 8x8 grid) runs there,
    so that the dry run tries the mixers part instead of stopping on its first error, as it did at 64 px."""
    from benchmarks._mixer_timing import mixer_candidates

    size = gpu_suite.DRY_RUN_MIXER_SIZE
    x, y = torch.rand(2, 3, size, size), torch.tensor([0, 1])
    for name, call in mixer_candidates(10, 16).items():
        call(x, y)  # raises on a configuration the size cannot hold


def test_test_outcomes_name_the_failures_also_of_a_run_cut_off() -> None:
    """The suite's tests part runs pytest -v: each outcome is a line as it ends (xdist puts it before the id, a
    plain run after), the -rfE summary repeats failures (counted once); a run the budget cut off has no summary
    line, and its failures are still named."""
    cut_off = (
        "[gw0] [  1%] PASSED tests/test_a.py::test_x[1] \n"
        "[gw1] [  2%] FAILED tests/test_a.py::test_y[bf16-a] \n"
        "tests/test_b.py::test_z SKIPPED (needs a GPU)                 [ 50%]\n"
        "tests/test_b.py::test_w ERROR                                  [ 75%]\n"
        "\nTIMED OUT after 120 s"
    )
    got = gpu_suite.outcomes_of(cut_off)
    assert got["counts"] == {"PASSED": 1, "FAILED": 1, "ERROR": 1, "SKIPPED": 1}
    assert got["failed"] == ["tests/test_a.py::test_y[bf16-a]", "tests/test_b.py::test_w"]
    assert got["summary"] == "TIMED OUT after 120 s"
    closing = "========== 1 failed, 1 passed, 1 skipped, 1 error in 3.10s (0:00:03) =========="
    finished = gpu_suite.outcomes_of(cut_off.replace("TIMED OUT after 120 s", "") + "\nFAILED tests/test_a.py::test_y[bf16-a] - "
                                     f"RuntimeError: lerp\n{closing}\n  warner(PytestBenchmarkWarning(text))\n")
    assert finished["counts"]["FAILED"] == 1 and finished["summary"] == closing  # not a plugin's warning printed after it
    summary = {"parts": {"tests": {"command": "pytest", **got}}}
    assert "Failed: `tests/test_a.py::test_y[bf16-a]`, `tests/test_b.py::test_w`" in summary_table(summary)


def test_profile_adds_each_variants_kernel_table(tmp_path: Path) -> None:
    """--profile: after the timing, each variant's step says where its time goes (the CPU's operators here)."""
    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "families", "--families", "vit", "--family-mode",
                             "eager", "--profile", "--rounds", "1", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    for variant in ("cutmix", "tlalign"):
        table = result["parts"]["families"]["vit"][variant]["kernels"]
        assert table["per_step_ms"] > 0 and table["launches_per_step"] >= len(table["top"]) > 0
        times = [row["ms_per_step"] for row in table["top"]]
        assert times == sorted(times, reverse=True) and sum(times) <= table["per_step_ms"] + 1e-9


def test_profile_adds_each_variants_memory_account(tmp_path: Path) -> None:
    """--profile: each variant's step also says what one more step adds at its peak and which operators (on a GPU,
    lines) hold it there, largest first. (The sites may hold more than the step adds: the step frees blocks from
    before it, the last step's gradients, which count against its peak: ``test_peak_owners_replays_a_trace``.)"""
    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "families", "--families", "vit", "--family-mode",
                             "eager", "--profile", "--rounds", "1", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    for variant in ("cutmix", "tlalign"):
        account = result["parts"]["families"]["vit"][variant]["memory_account"]
        held = [site["mb"] for site in account["top"]]
        assert account["step_mb"] > 0 and held and held == sorted(held, reverse=True)
        assert any("aten::" in site["site"] for site in account["top"])  # the CPU's: by operator
    text = summary_table(result)
    assert "### Who holds a step's bytes at its peak" in text
    top = result["parts"]["families"]["vit"]["tlalign"]["memory_account"]["top"][0]
    assert "| example:vit eager | tlalign | " in text and f"`{top['site']}` {top['mb']:.1f}" in text


def test_peak_owners_replays_a_trace() -> None:
    """The replay of an allocator trace: the peak is the most bytes allocated and not yet freed (a free of a block
    from before the trace lowers it), only completed frees count, and the sites are those of the blocks live at the
    peak, by the innermost frame of the library or timm (else the innermost frame)."""
    from benchmarks._memory_account import peak_owners

    lib = [{"filename": "/site/torch/nn/functional.py", "line": 9, "name": "pad"},
           {"filename": "/repo/mixlabels/backbones/_attention.py", "line": 317, "name": "_widen"},
           {"filename": "/site/timm/models/vision_transformer.py", "line": 90, "name": "forward"}]
    torch_only = [{"filename": "/site/torch/optim/adamw.py", "line": 5, "name": "step"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": lib},
        {"action": "free_completed", "addr": 99, "size": 40, "frames": []},  # allocated before the trace
        {"action": "alloc", "addr": 2, "size": 30, "frames": torch_only},
        {"action": "free_requested", "addr": 2, "size": 30, "frames": torch_only},  # not reusable yet
        {"action": "alloc", "addr": 3, "size": 50, "frames": lib},  # the peak: 100 - 40 + 30 + 50 = 140
        {"action": "free_completed", "addr": 2, "size": 30, "frames": torch_only},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": lib},
        {"action": "alloc", "addr": 4, "size": 90, "frames": torch_only},  # 20 + 90 = 110 < 140
    ]
    assert peak_owners(trace) == (140, {"_attention.py:317 _widen": 150, "adamw.py:5 step": 30})
    assert peak_owners(trace, top=1) == (140, {"_attention.py:317 _widen": 150})
    assert peak_owners([]) == (0, {})


def test_family_routes_reach_the_compiled_pair_and_a_step_takes_either_kind_of_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--family-routes label-convs=conv: each family's compiled pair times TL-Align by that route too; a step takes
    an attention route or a compiled label conv route, and refuses anything else by name."""
    from benchmarks import _gpu_steps

    seen: list[Any] = []

    def pair(steps: Any, args: Any, deadline: Any, log: Any, routes: Any = ()) -> dict[str, Any]:
        seen.append(list(routes))
        for route in routes:
            steps.call("tlalign", route)()  # eager here: the route's context is entered and left
        return {}

    monkeypatch.setattr(gpu_suite, "compiled_pair", pair)
    gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "families", "--families", "resnet", "--family-routes",
                    "label-convs=conv", "widened", "--out", str(tmp_path)])
    assert seen == [["label-convs=conv", "widened"]]
    steps = _gpu_steps.Steps("example:resnet", argparse.Namespace(device="cpu", num_classes=10, batch_size=2))
    with pytest.raises(ValueError, match="label-convs=shifted"):
        steps.call("tlalign", "fused")()
    with pytest.raises(ValueError, match="'shifted' or 'conv'"):
        steps.call("tlalign", "label-convs=fused")()


@pytest.mark.parametrize(("family", "route"), [("inception_next", "joins=walk"), ("convnext", "matrices=cpu"),
                                              ("resnet", "residuals=lerp"), ("resnet", "plans=off")])
def test_eager_family_routes_are_timed_beside_the_devices_route_and_reported(family: str, route: str, tmp_path: Path) -> None:
    """--family-mode eager --family-routes joins=walk (and the other eager fallbacks): each family's eager pair times
    TL-Align by that route too (a GPU's fused joins against the branch walk, its 14x14 label matrices against the
    CPU's depthwise convs there, its folded residuals against the lerp, its grid plans against building grid by
    grid), and the report gives it a row of its own beside the device's."""
    from benchmarks.gpu_report import gpu_section

    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "families", "--families", family,
                             "--family-mode", "eager", "--family-routes", route, "--rounds", "1", "--steps", "1",
                             "--warmup", "0", "--out", str(tmp_path)])
    row = result["parts"]["families"][family]
    assert row["mode"] == "eager" and row[f"tlalign/{route}"]["ms_median"] > 0 and "ratio" in row[f"tlalign/{route}"]
    text = "\n".join(gpu_section(result))
    assert f"| {family} | example:{family} |" in text
    assert f"| {family} ({route}) | example:{family} |" in text


def test_report_appends_a_run_onto_the_summary_in_results(tmp_path: Path, report_copy: list[str]) -> None:
    """report --append --add-gpu-suite: the earlier runs stay (their raw JSONs may be gone), the new run's parts
    replace theirs (its families join theirs), the parts it did not measure stay; without an earlier summary it refuses."""
    from benchmarks import report

    results = tmp_path / "results"
    earlier = json.loads((results / "gpu-suite.json").read_text())
    gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "families", "--families", "vit", "--rounds", "1",
                    "--steps", "1", "--warmup", "0", "--out", str(tmp_path / "run")])
    _as_if_on_a_gpu(tmp_path / "run" / "gpu_suite.json")
    args = [*report_copy, "--add-gpu-suite", str(tmp_path / "run" / "gpu_suite.json"), "--note", "the new run"]
    assert report.main(["--append", *args]) == 0
    merged = json.loads((results / "gpu-suite.json").read_text())
    assert merged["runs"][:-1] == earlier["runs"] and merged["runs"][-1]["note"] == "the new run"
    before = {f for f in earlier["parts"]["families"] if f != "seconds"}
    assert set(merged["parts"]["families"]) == before | {"vit"} and merged["parts"]["families"]["vit"]["run"] == len(merged["runs"])
    assert merged["parts"]["routes"] == earlier["parts"]["routes"]
    assert "the new run" in (tmp_path / "RESULTS.md").read_text()
    (results / "gpu-suite.json").unlink()
    assert report.main(["--append", *args]) == 2


def _as_if_on_a_gpu(path: Path) -> None:
    """A dry run's JSON relabelled as a GPU's run (the merge is what a test of it checks; a dry run itself is refused)."""
    result = json.loads(path.read_text())
    path.write_text(json.dumps({**result, "device": "NVIDIA H100 80GB HBM3", "dry_run": False}))


@pytest.mark.parametrize("kind", ["dry run", "cpu run", "old cpu json"])
def test_report_refuses_a_run_that_was_not_on_a_gpu(
    kind: str, tmp_path: Path, report_copy: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """report --add-gpu-suite of a --dry-run's JSON (or of a run on the CPU, or of a JSON from before the suite said
    ``dry_run``, whose device reads CPU) exits 2 naming why, and writes nothing: its tiny figures would have replaced
    the H100's tables in RESULTS' GPU section (the dry run is what a session runs to prepare the GPU call)."""
    from benchmarks import report

    results, output = tmp_path / "results", tmp_path / "RESULTS.md"
    output.write_text("before\n")
    before = {p.name: p.read_bytes() for p in results.iterdir()}
    run = tmp_path / "run"
    gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "routes", "--rounds", "1", "--steps", "1", "--out", str(run)])
    result = json.loads((run / "gpu_suite.json").read_text())
    assert result["dry_run"] is True and result["device"] == "CPU"
    if kind == "cpu run":  # --device cpu without --dry-run (its full shapes take minutes on the CPU: the JSON says so)
        result["dry_run"] = False
    elif kind == "old cpu json":
        del result["dry_run"]
    (run / "gpu_suite.json").write_text(json.dumps(result))
    args = [*report_copy, "--add-gpu-suite", str(run / "gpu_suite.json")]
    for mode in ([], ["--append"]):
        assert report.main([*mode, *args]) == 2
        err = capsys.readouterr().err
        assert ("a dry run" if kind == "dry run" else "a run on the CPU") in err and "without --dry-run" in err
    assert {p.name: p.read_bytes() for p in results.iterdir()} == before and output.read_text() == "before\n"
    _as_if_on_a_gpu(run / "gpu_suite.json")
    assert report.main(["--append", *args]) == 0  # the same figures, said to be a GPU's, are taken: it reads the run's kind


def test_report_refuses_a_run_that_would_drop_the_earlier_runs_parts(
    tmp_path: Path, report_copy: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """report --add-gpu-suite without --append, of a run that measured fewer parts than the committed summary holds (a
    run that reached its deadline, or ran --parts families alone): exit 2 naming the parts it would drop and --append,
    nothing written; --append merges it, --replace takes it alone."""
    import shutil

    from benchmarks import report

    results, output = tmp_path / "results", tmp_path / "RESULTS.md"
    committed = json.loads((results / "gpu-suite.json").read_text())
    assert all(part in committed["parts"] for part in ("routes", "deit", "mixers", "families"))
    gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "routes", "--rounds", "1", "--steps", "1", "--out", str(tmp_path / "run")])
    _as_if_on_a_gpu(tmp_path / "run" / "gpu_suite.json")
    args = [*report_copy, "--add-gpu-suite", str(tmp_path / "run" / "gpu_suite.json")]
    assert report.main(args) == 2
    err = capsys.readouterr().err
    assert "did not measure deit, mixers" in err and "add --append" in err and not output.exists()
    assert json.loads((results / "gpu-suite.json").read_text()) == committed
    assert report.main(["--append", *args]) == 0
    merged = json.loads((results / "gpu-suite.json").read_text())
    assert merged["parts"]["deit"] == committed["parts"]["deit"] and merged["parts"]["routes"] != committed["parts"]["routes"]
    assert report.main(["--replace", *args]) == 0
    assert set(json.loads((results / "gpu-suite.json").read_text())["parts"]) == {"routes"}
    # every part measured again, but other families: the earlier runs' family rows would go
    shutil.copy(report.RESULTS_DIR / "gpu-suite.json", results / "gpu-suite.json")
    resnet = committed["parts"]["families"]["resnet"]
    run = {**committed, "runs": [], "device": "NVIDIA H100 80GB HBM3", "dry_run": False,
           "parts": {**committed["parts"], "families": {"vit": {**resnet, "model": "vit_small"}}}}
    (tmp_path / "run" / "gpu_suite.json").write_text(json.dumps(run))
    assert report.main(args) == 2
    err = capsys.readouterr().err
    assert "did not measure family resnet, family convnext" in err and "pvt_v2" not in err  # pvt_v2: a skipped row
    assert report.main(["--append", *args]) == 0
    assert {"resnet", "convnext", "vit"} <= set(json.loads((results / "gpu-suite.json").read_text())["parts"]["families"])


def test_a_part_the_deadline_skipped_keeps_the_earlier_runs_figures() -> None:
    """A later run that reached its deadline before a part measured nothing there: merging it keeps the earlier
    figures of that part, and still replaces the parts it did measure."""
    from benchmarks.gpu_report import merge_gpu_suites

    earlier = {"parts": {"deit": {"eager": {"cutmix": {"ms_median": 1.0}}}, "tests": {"summary": "1 passed"}}, "runs": [{"n": 1}]}
    later = {"parts": {"deit": {"skipped": "deadline", "seconds": 0.1}, "tests": {"summary": "2 passed"}}, "runs": [{"n": 2}]}
    merged = merge_gpu_suites(earlier, later)
    assert merged["parts"]["deit"] == earlier["parts"]["deit"] and merged["parts"]["tests"] == {"summary": "2 passed"}
    assert merged["runs"] == [{"n": 1}, {"n": 2}]


def test_a_part_that_failed_keeps_the_earlier_figures_and_the_run_says_so() -> None:
    """A later run's part that ended in an error replaces no figure it did not measure: a part with nothing measured
    keeps the earlier one whole, DeiT-S keeps the modes the run did not reach, the families the rows; what it did
    measure merges. The error is said beside that run in RESULTS, and an earlier run's error does not stay on a part
    a later run measured cleanly. A failed part with nothing earlier is kept with its error (its table says it)."""
    from benchmarks.gpu_report import merge_gpu_suites, render_gpu_suite

    def ms(value: float) -> dict[str, Any]:
        return {"ms_median": value, "ratio": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "peak_mb": 1.0, "memory_ratio": 1.0,
                "graphs": 1, "graph_breaks": 0}

    timed = {"model": "m", "cutmix": ms(10.0), "tlalign": ms(12.0)}
    earlier = {"parts": {"routes": {"DeiT-S": {"plain": ms(1.0)}},
                         "deit": {"eager": {"cutmix": ms(1.0)}, "compiled": {"cutmix": ms(2.0)},
                                  "error": "RuntimeError: run 1's own"},
                         "families": {"resnet": timed, "pvt_v2": timed}},
               "runs": [{"parts": ["deit", "families", "routes"], "provenance": {}}]}
    later = {"parts": {"routes": {"error": "RuntimeError: cuDNN said no", "seconds": 1.0},
                       "deit": {"eager": {"cutmix": ms(3.0)}, "error": "OutOfMemoryError: compiled", "seconds": 2.0},
                       "families": {"resnet": {**timed, "model": "r2"}, "error": "KeyError: 'pvt_v2'", "seconds": 3.0},
                       "mixers": {"error": "ImportError: timm", "seconds": 0.5}},
             "runs": [{"parts": ["deit", "families", "mixers", "routes"], "provenance": {}}]}
    merged = merge_gpu_suites(earlier, later)
    parts = merged["parts"]
    assert parts["routes"] == earlier["parts"]["routes"]
    assert parts["deit"] == {"eager": {"cutmix": ms(3.0)}, "compiled": {"cutmix": ms(2.0)}}
    assert parts["families"]["resnet"]["model"] == "r2" and parts["families"]["pvt_v2"]["model"] == "m"
    assert parts["mixers"] == later["parts"]["mixers"]  # nothing earlier: the error stands in the part
    assert merged["runs"][1]["ended"] == {"routes": "error: RuntimeError: cuDNN said no",
                                          "deit": "error: OutOfMemoryError: compiled", "families": "error: KeyError: 'pvt_v2'"}
    assert "ended" not in later["runs"][0]  # the run given is not changed
    text = render_gpu_suite(merged, lambda provenance: "provenance")
    assert "Run 2's routes part ended early (error: RuntimeError: cuDNN said no)" in text
    assert "Run 2's families part ended early (error: KeyError: 'pvt_v2')" in text
    assert "Run 1's" not in text and "run 1's own" not in text


def test_unmeasured_families_come_first_and_an_unknown_family_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--unmeasured-first: the families without a measured row of that mode in the committed summary go first (so a
    lent GPU's few minutes add families, not remeasure resnet), the measured after them, each list in its order; a
    family the summary skipped (pvt_v2: the deadline) counts as unmeasured. A misspelt family stops the suite before
    it starts, naming the families there are."""
    measured = gpu_suite.measured_families(gpu_suite.SUMMARY, "compiled")
    assert {"resnet", "convnext"} <= measured and "pvt_v2" not in measured and "vit" not in measured
    assert not gpu_suite.measured_families(gpu_suite.SUMMARY, "eager") & {"resnet", "convnext"}
    order: list[str] = []

    def pair(steps: Any, args: Any, deadline: Any, log: Any, routes: Any = ()) -> dict[str, Any]:
        order.append(str(steps.model))
        return {}

    monkeypatch.setattr(gpu_suite, "compiled_pair", pair)
    monkeypatch.setattr(gpu_suite, "Steps", lambda model, args: argparse.Namespace(model=model))
    gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "families", "--families", "resnet", "vit", "convnext",
                    "pvt_v2", "--unmeasured-first", "--out", str(tmp_path)])
    assert order == ["example:vit", "example:pvt_v2", "example:resnet", "example:convnext"]
    order.clear()
    gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "families", "--families", "resnet", "vit", "--out", str(tmp_path)])
    assert order == ["example:resnet", "example:vit"]  # without the flag: as given
    with pytest.raises(SystemExit):
        gpu_suite.main(["--dry-run", "--families", "resnet", "convnxt", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "no aligning family is named convnxt" in err and "convnext" in err


def test_a_later_run_adds_its_families_to_the_earlier_runs_rows() -> None:
    """Families merge row by row: a family the later run measured replaces its row, one it did not measure (or reached
    its deadline on) keeps the earlier figures, a new one is added; every row says which run measured it, and the
    table shows it (the rows of a summary from before the tags: the last run that ran the families part)."""
    from benchmarks.gpu_report import gpu_section, merge_gpu_suites

    def row(ms: float) -> dict[str, Any]:
        timed = {"ms_median": ms, "ratio": ms / 10, "ratio_min": 1.0, "ratio_max": 1.2, "memory_ratio": 1.0, "graphs": 1,
                 "graph_breaks": 0}
        return {"model": "m", "cutmix": {**timed, "ms_median": 10.0}, "tlalign": timed}

    earlier = {"parts": {"families": {"resnet": row(15.0), "pvt_v2": row(13.0), "seconds": 9.0}},
               "runs": [{"parts": ["families"]}, {"parts": ["deit"]}]}
    later = {"parts": {"families": {"resnet": row(12.0), "pvt_v2": {"model": "m", "skipped": "deadline"},
                                    "convnext": row(11.0), "eva": {"model": "m", "skipped": "deadline"}, "seconds": 5.0}},
             "runs": [{"parts": ["families"]}]}
    merged = merge_gpu_suites(earlier, later)
    families = merged["parts"]["families"]
    assert set(families) == {"resnet", "pvt_v2", "convnext", "eva"}
    assert families["resnet"]["tlalign"]["ms_median"] == 12.0 and families["resnet"]["run"] == 3
    assert families["pvt_v2"]["tlalign"]["ms_median"] == 13.0 and families["pvt_v2"]["run"] == 1  # not the skip
    assert families["convnext"]["run"] == 3 and families["eva"] == {"model": "m", "skipped": "deadline", "run": 3}
    text = "\n".join(gpu_section(merged))
    assert "| pvt_v2 | m | 10.00 | 13.00 | 1.300 [1.000, 1.200] | 1.000 | 1 | 0 | 1 |" in text
    assert "| resnet | m | 10.00 | 12.00 |" in text and text.count(" | 3 |") == 3
    assert "| family | model | CutMix ms | TL-Align ms | ratio | memory ratio | graphs (TL-Align) | breaks | run |" in text
    assert "| run |" not in "\n".join(gpu_section({"parts": later["parts"]}))  # a suite's own JSON: one run, no column


def test_profiled_steps_show_the_time_the_kernels_do_not_account_for() -> None:
    """With --profile, the summary sets each profiled step beside its kernel time and launches, and their
    difference (the GPU waiting on the host); a run without profiles adds no such table."""
    def row(ms: float, kernel_ms: float, launches: int) -> dict[str, Any]:
        return {"ms_median": ms, "ratio": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "peak_mb": 1.0, "memory_ratio": 1.0,
                "kernels": {"per_step_ms": kernel_ms, "launches_per_step": launches, "top": []}}

    result = {"parts": {"deit": {"compiled": {"cutmix": row(27.9, 18.6, 816), "tlalign": row(29.3, 18.9, 866)}},
                        "families": {"resnet": {"model": "resnet18", "cutmix": row(13.25, 9.72, 395),
                                                "tlalign": row(19.48, 10.40, 529), "seconds": 1.0}}}}
    text = summary_table(result)
    assert "| DeiT-S compiled | tlalign | 29.30 | 18.90 | 866 | 10.40 | - |" in text
    assert "| resnet18 compiled | cutmix | 13.25 | 9.72 | 395 | 3.53 | - |" in text
    result["parts"]["families"]["resnet"]["mode"] = "eager"  # type: ignore[index]  # an eager run's rows say so
    assert "| resnet18 eager | cutmix | 13.25 |" in summary_table(result) and "resnet18 compiled" not in summary_table(result)
    result["parts"]["deit"]["compiled"]["cutmix"]["kernels"]["host_ms_per_step"] = 25.5  # type: ignore[index]
    assert "| DeiT-S compiled | cutmix | 27.90 | 18.60 | 816 | 9.30 | 25.50 |" in summary_table(result)
    for table in (result["parts"]["deit"]["compiled"], result["parts"]["families"]["resnet"]):
        for variant in ("cutmix", "tlalign"):
            del table[variant]["kernels"]  # type: ignore[index]
    assert "Where a step's time goes" not in summary_table(result)


def test_deit_times_timms_own_step_beside_ours_eager_and_compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deit part times timm's own step (``timm-cutmix``: timm's ``Mixup``, the bare model, compiled as timm's
    ``--torchcompile`` compiles it) beside CutMix + NoAlign in both modes, and the report shows its rows (the timing's
    and, with ``--profile``, the kernel table's). (Compiled by
    dynamo with the eager backend here: the graphs and breaks are dynamo's; inductor's CPU compile is not the point.)"""
    from functools import partial

    from benchmarks.gpu_report import gpu_section

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "deit", "--profile", "--out", str(tmp_path)])
    deit = result["parts"]["deit"]
    for mode in ("eager", "compiled"):
        row = deit[mode]["timm-cutmix"]
        assert row["ms_median"] > 0 and row["ratio_min"] <= row["ratio"] <= row["ratio_max"], (mode, row)
        assert deit[mode]["cutmix"]["ratio"] == 1.0
    assert deit["compiled"]["timm-cutmix"]["graphs"] == 1 and deit["compiled"]["timm-cutmix"]["graph_breaks"] == 0
    text = "\n".join(gpu_section({**result, "device": "NVIDIA H100 80GB HBM3", "dry_run": False}))
    assert sum(line.startswith("| timm-cutmix |") for line in text.splitlines()) == 2  # the eager and compiled tables
    assert "`timm-cutmix`: timm's own step" in text
    assert "| DeiT-S compiled | timm-cutmix |" in text  # --profile: every profiled variant's kernel row, timm's too
    # --no-timm-step: one compile fewer, where a GPU's minutes are short
    without = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "deit", "--deit-compiled-only", "--no-timm-step",
                              "--out", str(tmp_path / "without")])
    assert set(without["parts"]["deit"]["compiled"]) >= {"cutmix", "tlalign"}
    assert "timm-cutmix" not in without["parts"]["deit"]["compiled"]
    eager = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "deit", "--deit-eager-only", "--out", str(tmp_path / "eager")])
    assert "compiled" not in eager["parts"]["deit"] and "timm-cutmix" in eager["parts"]["deit"]["eager"]
    with pytest.raises(SystemExit):  # one or the other
        gpu_suite.main(["--device", "cpu", "--dry-run", "--deit-eager-only", "--deit-compiled-only", "--out", str(tmp_path)])
