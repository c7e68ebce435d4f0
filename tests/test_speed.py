"""The speed benchmark runs end to end at a tiny size and reports what it claims (no timing asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import _families, speed
from benchmarks._mixer_timing import select_mixers
from benchmarks._step_memory import allocator_peak
from benchmarks._training_step import TrainingSteps, build_model, token_stride


def test_speed_benchmark_end_to_end(tmp_path: Path) -> None:
    result = speed.main(
        [
            "--batch-size", "2", "--steps", "1", "--warmup", "1", "--repeats", "2",
            "--variants", "cutmix", "tlalign", "tlalign-widened",
            "--num-classes", "10", "--mixer-batch", "2", "--mixer-size", "32", "--mixer-patch", "4",
            "--mixer-calls", "1", "--mixer-repeats", "1", "--out", str(tmp_path),
        ]
    )
    steps = result["steps"]
    assert set(steps) == {"cutmix", "tlalign", "tlalign-widened"}
    assert steps["cutmix"]["time_ratio"] == 1.0 and steps["cutmix"]["memory_ratio"] == 1.0
    for s in steps.values():
        assert len(s["step_s_per_round"]) == 2 and all(t > 0 for t in s["step_s_per_round"])
        assert s["peak_mb"] > 0 and math.isfinite(s["time_ratio"])
        # Absolute peak: the model, AdamW state and batch (10 classes: ~5.4M params x 4 copies) plus the step.
        assert s["alloc_peak_mb"] > s["alloc_step_mb"] > 0 and s["alloc_peak_mb"] > 4 * 5.3e6 * 4 / 2**20
        assert 0 < sum(s["alloc_top_mb"].values()) <= s["alloc_step_mb"] + 1e-9
    assert steps["cutmix"]["alloc_ratio"] == 1.0 and steps["cutmix"]["alloc_step_ratio"] == 1.0
    # The fused forward keeps what plain attention keeps; autograd through the widened call keeps more.
    # Measured at this size: 18.538 MB, 18.539 MB (the labels), 20.253 MB.
    step_mb = {v: s["alloc_step_mb"] for v, s in steps.items()}
    assert step_mb["tlalign"] <= 1.001 * step_mb["cutmix"] and step_mb["tlalign-widened"] > 1.05 * step_mb["tlalign"]
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
    assert "| alloc peak MB | alloc ratio |" in next(tmp_path.glob("*.md")).read_text()


MB = 1_000_000


def test_allocator_peak_counts_live_bytes_not_allocated_bytes() -> None:
    held: list[torch.Tensor] = []

    def window() -> None:
        big = torch.ones(10 * MB, dtype=torch.uint8)
        del big
        held.append(torch.empty(4 * MB, dtype=torch.uint8))

    peak = allocator_peak(window)
    assert (peak.start_bytes, peak.peak_bytes, peak.step_bytes) == (0, 10 * MB, 10 * MB)  # not 14 MB
    assert peak.top == {"aten::ones > aten::empty": 10 * MB}  # who holds the bytes at the peak


def test_allocator_peak_counts_frees_of_what_before_allocated() -> None:
    held: list[torch.Tensor] = []

    def before() -> None:  # like the previous step's gradients, freed by the step
        held.append(torch.empty(6 * MB, dtype=torch.uint8))

    def window() -> None:
        held.clear()
        big = torch.empty(10 * MB, dtype=torch.uint8)
        del big
        held.append(torch.empty(4 * MB, dtype=torch.uint8))

    peak = allocator_peak(window, before)
    # Live bytes: 6 at the start, 0, 10, 0, 4: the peak is 10 MB, 4 MB above the start (10 if the free were missed).
    assert (peak.start_bytes, peak.peak_bytes, peak.step_bytes) == (6 * MB, 10 * MB, 4 * MB)


def test_mixer_selection_keeps_the_timm_references() -> None:
    names = ["ours CutMix", "ours MixUp (elem)", "timm CutMix (batch)", "timm MixUp (batch)", "kornia RandomCutMixV2"]
    assert select_mixers(names, None) == names
    assert select_mixers(names, ["OURS cutmix"]) == ["ours CutMix", "timm CutMix (batch)"]
    assert select_mixers(names, ["mixup (elem)", "kornia"]) == [
        "ours MixUp (elem)", "timm CutMix (batch)", "timm MixUp (batch)", "kornia RandomCutMixV2",
    ]
    with pytest.raises(SystemExit, match="matches none"):
        select_mixers(names, ["nothing"])


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


def test_a_mixer_that_fails_is_left_out_with_its_error_and_the_others_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixer that raises on this device costs its own row: the table says why and times the rest (the GPU suite's
    mixers part, which a single CUDA-only failure ended before)."""
    from benchmarks import _mixer_timing

    real = _mixer_timing.mixer_candidates

    def candidates(num_classes: int, patch: int) -> dict[str, Any]:
        def broken(x: torch.Tensor, y: torch.Tensor) -> None:
            raise RuntimeError("CUDA error: an illegal memory access | was encountered\nsecond line")

        return {**real(num_classes, patch), "ours CutMix (broken)": broken}

    monkeypatch.setattr(_mixer_timing, "mixer_candidates", candidates)
    result = speed.main(
        [
            "--only", "mixers", "--mixers", "ours CutMix", "--num-classes", "10", "--mixer-batch", "2",
            "--mixer-size", "32", "--mixer-patch", "4", "--mixer-calls", "1", "--mixer-repeats", "2",
            "--out", str(tmp_path),
        ]
    )
    mixers = result["mixers"]
    assert mixers["ours CutMix (broken)"] == {"error": "RuntimeError: CUDA error: an illegal memory access | was encountered"}
    assert all(len(s["s_per_repeat"]) == 2 for name, s in mixers.items() if name != "ours CutMix (broken)")
    table = next(tmp_path.glob("*.md")).read_text()
    assert "| ours CutMix (broken) | left out: RuntimeError: CUDA error: an illegal memory access \\| was encountered |" in table
    assert "| ours CutMix |" in table


@pytest.mark.parametrize("family", ["pvt_v2", "any"])  # pvt_v2: crashed before; any: NoAlign only
def test_speed_runs_every_family(tmp_path: Path, family: str) -> None:
    """``--model`` takes any supported family; a scheme that refuses the model is reported, not timed."""
    result = speed.main(
        [
            "--only", "steps", "--model", f"example:{family}", "--num-classes", "10", "--batch-size", "2",
            "--steps", "1", "--warmup", "1", "--repeats", "1", "--variants", "cutmix", "transmix", "tlalign",
            "--out", str(tmp_path),
        ]
    )
    expected_refused = {"transmix", "tlalign"} if family == "any" else {"transmix"}  # pooled: no class token
    assert set(result["refused"]) == expected_refused and set(result["steps"]) == {"cutmix", "tlalign"} - expected_refused
    assert ("no class token" if family != "any" else "works for any classifier") in result["refused"]["transmix"]
    for s in result["steps"].values():
        assert s["step_ms_median"] > 0 and s["alloc_peak_mb"] > 0
    report = next(tmp_path.glob("*.md")).read_text()
    assert "CutMix + TransMix: not measured, the scheme refuses this model" in report


def test_build_model_takes_timm_names_without_patch_embed_img_size() -> None:
    for name, stride in [("pvt_v2_b0", 4), ("convnext_atto", 4), ("mixer_s32_224", 32), ("resnet18", None)]:
        model, size = build_model(name, 10)
        assert size == 224 and token_stride(model) == stride
    with pytest.raises(SystemExit, match="example:NAME with NAME one of beit, byobnet"):
        build_model("example:nope", 10)


def test_per_family_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--families`` runs the step variants per family and writes one row each (tiny models here)."""
    monkeypatch.setattr(_families, "family_models", lambda: {"convnext": "example:convnext"})
    result = speed.main(
        [
            "--families", "convnext", "--num-classes", "10", "--batch-size", "2", "--steps", "1", "--warmup", "1",
            "--repeats", "1", "--variants", "cutmix", "tlalign", "--out", str(tmp_path),
        ]
    )
    row = result["families"]["convnext"]
    assert set(row["steps"]) == {"cutmix", "tlalign"} and row["steps"]["cutmix"]["time_ratio"] == 1.0
    report = next(tmp_path.glob("speed-families-*.md")).read_text()
    assert "| convnext | example:convnext (" in report and "| CutMix + TL-Align (fast) time |" in report


def test_label_profile_per_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--families --label-profile``: the forward's label work and the operators it adds, per family; a family whose
    TL-Align refuses the model says so; the report renders it as its own RESULTS section."""
    from benchmarks import report

    monkeypatch.setattr(_families, "family_models", lambda: {"byobnet": "example:byobnet", "any": "example:any"})
    result = speed.main(
        [
            "--families", "--label-profile", "--num-classes", "10", "--batch-size", "2", "--steps", "1", "--warmup",
            "1", "--repeats", "2", "--out", str(tmp_path),
        ]
    )
    lab = result["families"]["byobnet"]["labels"]
    assert lab["step_ms"] > 0 and set(lab["forward_ms"]) == {"cutmix", "tlalign"}
    assert lab["label_ms_min"] <= lab["label_ms"] <= lab["label_ms_max"]
    assert lab["label_share"] == pytest.approx(lab["label_ms"] / lab["step_ms"])
    assert len(lab["top_ops"]) == 4 and any(calls > 0 for _, _, calls in lab["top_ops"])  # label work adds operators
    assert "NoAlign" in result["families"]["any"]["labels"]["refused"]
    with pytest.raises(SystemExit, match="--label-profile profiles the per-family models: add --families"):
        speed.main(["--label-profile", "--out", str(tmp_path)])
    path = next(tmp_path.glob("speed-labels-*.json"))
    name, summary = report.summarize_speed(path)
    text = report.render_label_work(summary)
    assert name == "speed-labels-cpu" and "| byobnet | `example:byobnet` |" in text and "| any | `example:any` | refused |" in text


def test_cells_variant_is_the_same_step_on_a_densified_mask(tmp_path: Path) -> None:
    """``tlalign-cells`` (the route before BoxMask: token weights from cells) gives the fast path's loss
    to the bit on pixel boxes, and the per-pixel mask it builds shows in its allocations."""
    import argparse

    args = argparse.Namespace(device="cpu", model="example:vit", num_classes=10, batch_size=4, amp=False, pixel_boxes=True)
    bench = TrainingSteps.for_args(args, ["tlalign", "tlalign-cells"])
    losses = {}
    for v in ("tlalign", "tlalign-cells"):
        torch.manual_seed(3)
        mixed, lm = bench.mixer(bench.images, bench.labels, generator=torch.Generator().manual_seed(1))
        if v == "tlalign-cells":
            import dataclasses

            import mixlabels

            lm = dataclasses.replace(lm, mask=mixlabels.CellMask(lm.mask.dense()))
        assert lm.mask.shape[2:] == bench.images.shape[2:]  # pixel boxes: a per-pixel grid
        losses[v] = bench.adapted[v](mixed, lm).loss()
    assert torch.equal(losses["tlalign"], losses["tlalign-cells"])
    # the CLI's cells variant, on the same tiny model (the default model's steps: test_speed_benchmark_end_to_end)
    result = speed.main(["--only", "steps", "--model", "example:vit", "--pixel-boxes", "--num-classes", "10",
                         "--batch-size", "2", "--steps", "1",
                         "--warmup", "1", "--repeats", "1", "--variants", "cutmix", "tlalign", "tlalign-cells",
                         "--out", str(tmp_path)])
    assert set(result["steps"]) == {"cutmix", "tlalign", "tlalign-cells"}


def test_timm_cutmix_variant_is_a_timm_users_step(tmp_path: Path) -> None:
    """``timm-cutmix`` is the step a timm user runs without this library: timm's batch-mode ``Mixup`` mixes the batch
    in place (CutMix, smoothing 0.1), the bare model reads it and timm's ``SoftTargetCrossEntropy`` takes the targets.
    Its AdamW update equals that loop's, written out with timm's own objects, to the bit."""
    import copy

    import numpy as np
    from timm.data.mixup import Mixup
    from timm.loss import SoftTargetCrossEntropy

    bench = TrainingSteps("example:vit", num_classes=10, batch_size=4, device="cpu", variants=["cutmix", "timm-cutmix"])
    assert set(bench.adapted) == {"cutmix"}  # the bare model: no adapter
    model, images, labels = copy.deepcopy(bench.model), bench.images.clone(), bench.labels.clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    np.random.seed(5)  # timm's Mixup draws from numpy's global generator
    bench.step("timm-cutmix")
    np.random.seed(5)
    mixed, target = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode="batch", label_smoothing=0.1, num_classes=10)(images, labels)
    assert torch.equal(bench.images, mixed) and not torch.equal(mixed[0], mixed[-1])  # the shared batch, mixed in place
    assert target.shape == (4, 10) and int((target > 0.5).sum()) >= 1
    opt.zero_grad(set_to_none=True)
    SoftTargetCrossEntropy()(model(mixed), target).backward()
    opt.step()
    ours = dict(bench.model.named_parameters())
    assert all(torch.equal(p, ours[name]) for name, p in model.named_parameters())
    with pytest.raises(ValueError, match="even batch"):
        TrainingSteps("example:vit", num_classes=10, batch_size=3, device="cpu", variants=["timm-cutmix"])
    # the CLI's variant, its row in the table beside the baseline's
    result = speed.main(["--only", "steps", "--model", "example:vit", "--num-classes", "10", "--batch-size", "2",
                         "--steps", "1", "--warmup", "1", "--repeats", "1", "--variants", "cutmix", "timm-cutmix",
                         "--out", str(tmp_path)])
    assert set(result["steps"]) == {"cutmix", "timm-cutmix"} and math.isfinite(result["steps"]["timm-cutmix"]["time_ratio"])
    assert "| timm's Mixup (CutMix) + the bare model |" in next(tmp_path.glob("*.md")).read_text()


@pytest.mark.parametrize("returncode, words", [(-9, "out-of-memory killer"), (-11, "SIGSEGV"), (3, "exit status 3")])
def test_a_failed_memory_run_says_how_it_ended(monkeypatch: pytest.MonkeyPatch, returncode: int, words: str) -> None:
    """The memory worker runs in a subprocess: one the kernel kills for memory leaves no traceback, so the error
    must name the signal and the likely cause (seen: convmixer_768_32 at batch 8 on 24 GiB)."""
    import argparse
    import subprocess

    from benchmarks import _step_memory

    def killed(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr="profiler_start")

    monkeypatch.setattr(_step_memory.subprocess, "run", killed)
    args = argparse.Namespace(device="cpu", model="convmixer_768_32", batch_size=8, warmup=1, num_classes=1000, amp=False)
    with pytest.raises(RuntimeError, match=words) as err:
        _step_memory.measure_memory("cutmix", args, lambda _: None)
    assert "convmixer_768_32" in str(err.value)
