"""The speed benchmark runs end to end at a tiny size and reports what it claims (no timing asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import speed


def test_speed_benchmark_end_to_end(tmp_path: Path) -> None:
    result = speed.main(
        [
            "--batch-size", "2", "--steps", "1", "--warmup", "1", "--repeats", "2",
            "--variants", "cutmix", "tlalign",
            "--num-classes", "10", "--mixer-batch", "2", "--mixer-size", "32", "--mixer-patch", "4",
            "--mixer-calls", "1", "--mixer-repeats", "1", "--out", str(tmp_path),
        ]
    )
    steps = result["steps"]
    assert set(steps) == {"cutmix", "tlalign"}
    assert steps["cutmix"]["time_ratio"] == 1.0 and steps["cutmix"]["memory_ratio"] == 1.0
    for s in steps.values():
        assert len(s["step_s_per_round"]) == 2 and all(t > 0 for t in s["step_s_per_round"])
        assert s["peak_mb"] > 0 and math.isfinite(s["time_ratio"])
    mixers = result["mixers"]
    assert {"ours CutMix", "timm CutMix (batch)", "kornia RandomCutMixV2", "torchvision v2.MixUp"} <= set(mixers)
    assert mixers["timm CutMix (batch)"]["ratio_to_timm_batch"] == 1.0
    assert mixers["timm MixUp (batch)"]["paired_ratio"] == 1.0  # each repeat divided by itself
    for s in mixers.values():
        assert len(s["s_per_repeat"]) == 1 and s["paired_ratio_min"] <= s["paired_ratio"] <= s["paired_ratio_max"]
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".md"]
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["steps"]["tlalign"]["time_ratio"] == steps["tlalign"]["time_ratio"]
    assert "| CutMix + TL-Align (fast) |" in next(tmp_path.glob("*.md")).read_text()


def test_mixer_selection_keeps_the_timm_references() -> None:
    names = ["ours CutMix", "ours MixUp (elem)", "timm CutMix (batch)", "timm MixUp (batch)", "kornia RandomCutMixV2"]
    assert speed.select_mixers(names, None) == names
    assert speed.select_mixers(names, ["OURS cutmix"]) == ["ours CutMix", "timm CutMix (batch)"]
    assert speed.select_mixers(names, ["mixup (elem)", "kornia"]) == [
        "ours MixUp (elem)", "timm CutMix (batch)", "timm MixUp (batch)", "kornia RandomCutMixV2",
    ]
    with pytest.raises(SystemExit, match="matches none"):
        speed.select_mixers(names, ["nothing"])


def test_only_the_selected_mixers_are_timed(tmp_path: Path) -> None:
    result = speed.main(
        [
            "--only", "mixers", "--mixers", "ours CutMix", "--num-classes", "10", "--mixer-batch", "2",
            "--mixer-size", "32", "--mixer-patch", "4", "--mixer-calls", "1", "--mixer-repeats", "2",
            "--out", str(tmp_path),
        ]
    )
    mixers = result["mixers"]
    assert set(mixers) == {"ours CutMix", "ours CutMix (elem)", "timm CutMix (batch)"}
    assert all(len(s["s_per_repeat"]) == 2 for s in mixers.values())
    assert "| ours CutMix |" in next(tmp_path.glob("*.md")).read_text()
