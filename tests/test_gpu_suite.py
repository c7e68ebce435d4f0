"""The GPU suite's machinery on the CPU (its dry run), and the operator count.

The suite runs where device time is scarce, so what can fail on any machine is checked here: every
part writes its figures or says why not, the deadline stops it between units of work, and the
report renders what it wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import _mixer_ops, _training_step, gpu_suite, op_count
from benchmarks._gpu_steps import Steps
from benchmarks.gpu_report import summary_table


def test_dry_run_routes_every_route_against_plain_sdpa(tmp_path: Path) -> None:
    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--parts", "routes", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert saved["parts"].keys() == {"routes"} and saved["provenance"]["finished"]
    for table in result["parts"]["routes"].values():
        if isinstance(table, dict):
            assert set(table) == {"plain SDPA (no labels)", "widened", "separate", "explicit", "widened-autograd"}
            assert table["plain SDPA (no labels)"]["ratio"] == 1.0
            assert all(len(row["ms_per_round"]) == 2 and row["ms_median"] > 0 for row in table.values())
    assert "| separate |" in summary_table(result)


def test_a_spent_deadline_skips_every_part_and_says_so(tmp_path: Path) -> None:
    result = gpu_suite.main(["--device", "cpu", "--dry-run", "--budget-s", "0", "--out", str(tmp_path)])
    assert {name: part.get("skipped") for name, part in result["parts"].items()} == dict.fromkeys(gpu_suite.PARTS, "deadline")
    assert "skipped: deadline" in summary_table(result)


def test_op_count_counts_what_the_label_path_adds() -> None:
    row = op_count.count_step("example:vit")
    assert row["tlalign"] > row["cutmix"] > 0 and row["added"] == row["tlalign"] - row["cutmix"]
    assert row["tlalign_kernels"] < row["tlalign"]  # views are counted apart
    assert sum(row["tlalign_ops"].values()) == row["tlalign"]
    assert row["top_added"] and all(n > 0 for _, n in row["top_added"])


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
