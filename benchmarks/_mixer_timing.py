"""Mixer timing: every mixer (its ``TokenLabelMap`` and image targets included) against timm's ``Mixup``.

Also kornia's ``RandomCutMixV2``/``RandomMixUpV2`` and torchvision's ``v2.CutMix``/``v2.MixUp``.
Ratios are paired: each repeat divides a mixer's time by its timm batch-mode reference's time in
that same repeat.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
from typing import Any, Callable, Sequence

import torch

from benchmarks._gpu_timing import working_calls
from benchmarks._interleave import interleaved_times, paired

__all__ = ["PROFILED", "PROFILED_CALLS", "TIMM_REFERENCE", "measure_mixers", "mixer_candidates", "reference_of", "select_mixers"]


def mixer_candidates(num_classes: int, patch: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], Any]]:
    """Every mixer to time, each a callable ``(images, labels) -> anything`` producing image targets."""
    import kornia.augmentation as K
    import torchvision.transforms.v2 as T
    from timm.data.mixup import Mixup

    from mixlabels import strategies

    def ours(mixer: Any) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        def call(x: torch.Tensor, y: torch.Tensor) -> Any:
            mixed, lm = mixer(x, y)
            return mixed, lm.image_targets()

        return call

    def timm_fn(**kw: Any) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        fn = Mixup(num_classes=num_classes, label_smoothing=0.1, **kw)  # type: ignore[no-untyped-call]

        def call(x: torch.Tensor, y: torch.Tensor) -> Any:
            return fn(x.clone(), y)  # timm mixes in place: clone so every call sees fresh input

        return call

    kcut = K.RandomCutMixV2(data_keys=["input", "class"])
    kmix = K.RandomMixUpV2(data_keys=["input", "class"])
    tcut = T.CutMix(num_classes=num_classes)
    tmix = T.MixUp(num_classes=num_classes)
    c, ls = num_classes, 0.1
    return {
        "ours CutMix": ours(strategies.CutMix(c, label_smoothing=ls)),
        "ours MixUp": ours(strategies.MixUp(c, label_smoothing=ls)),
        "ours RandomPatchMix": ours(strategies.RandomPatchMix(c, cell_size=patch, label_smoothing=ls)),
        "ours BlockwiseMix": ours(strategies.BlockwiseMix(c, cell_size=patch, label_smoothing=ls)),
        "ours MixToken": ours(strategies.MixToken(c, patch_size=patch, label_smoothing=ls)),
        "ours FMix": ours(strategies.FMix(c, label_smoothing=ls)),
        "ours FMix (patch cells)": ours(strategies.FMix(c, cell_size=patch, label_smoothing=ls)),
        "ours ResizeMix": ours(strategies.ResizeMix(c, label_smoothing=ls)),
        "ours SaliencyMix": ours(strategies.SaliencyMix(c, label_smoothing=ls)),
        "ours GridMix": ours(strategies.GridMix(c, cell_sizes=(patch, 2 * patch), label_smoothing=ls)),
        "ours TokenMix": ours(strategies.TokenMix(c, patch_size=patch, label_smoothing=ls)),
        "ours CutMix (elem)": ours(strategies.CutMix(c, mode="elem", label_smoothing=ls)),
        "ours MixUp (elem)": ours(strategies.MixUp(c, mode="elem", label_smoothing=ls)),
        "timm CutMix (batch)": timm_fn(mixup_alpha=0.0, cutmix_alpha=1.0, mode="batch"),
        "timm MixUp (batch)": timm_fn(mixup_alpha=0.8, cutmix_alpha=0.0, mode="batch"),
        "timm CutMix (elem)": timm_fn(mixup_alpha=0.0, cutmix_alpha=1.0, mode="elem"),
        "timm MixUp (elem)": timm_fn(mixup_alpha=0.8, cutmix_alpha=0.0, mode="elem"),
        "kornia RandomCutMixV2": lambda x, y: kcut(x, y),
        "kornia RandomMixUpV2": lambda x, y: kmix(x, y),
        "torchvision v2.CutMix": lambda x, y: tcut(x, y),
        "torchvision v2.MixUp": lambda x, y: tmix(x, y),
    }


TIMM_REFERENCE = {"CutMix": "timm CutMix (batch)", "MixUp": "timm MixUp (batch)"}
PROFILED = ("ours CutMix", "ours MixUp", "timm CutMix (batch)", "timm MixUp (batch)")  # ``--profile``: the batch-mode pairs
PROFILED_CALLS = 20


def reference_of(name: str) -> str:
    """The timm batch-mode mixer a mixer is compared with: MixUp with MixUp, anything else with CutMix."""
    return TIMM_REFERENCE["MixUp" if "MixUp" in name else "CutMix"]


def select_mixers(names: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
    """The mixers whose name contains one of ``wanted`` (case-insensitive), with their timm references."""
    if not wanted:
        return list(names)
    keep = {n for n in names if any(w.lower() in n.lower() for w in wanted)}
    if not keep:
        raise SystemExit(f"--mixers {list(wanted)} matches none of: {', '.join(names)}")
    keep |= {reference_of(n) for n in keep}  # a ratio needs its reference timed in the same repeats
    return [n for n in names if n in keep]


def measure_mixers(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    device = torch.device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.rand(args.mixer_batch, 3, args.mixer_size, args.mixer_size, generator=gen).to(device)
    y = torch.randint(0, args.num_classes, (args.mixer_batch,), generator=gen).to(device)
    candidates = mixer_candidates(args.num_classes, args.mixer_patch)
    fns = {k: candidates[k] for k in select_mixers(list(candidates), args.mixers)}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    # a mixer that fails on this device (or whose timm reference does) is left out with its error, not the table
    every: dict[str, Callable[[], object]] = {name: partial(fn, x, y) for name, fn in fns.items()}
    calls, errors = working_calls(every, progress)
    for name in list(calls):
        if reference_of(name) not in calls:
            del calls[name]
            errors[name] = f"its reference {reference_of(name)!r} failed: {errors.get(reference_of(name), 'not selected')}"
    host: dict[str, list[float]] = {}  # until the calls returned, before the wait for the device: the host's share
    times = interleaved_times(
        calls, rounds=args.mixer_repeats,
        per_block=args.mixer_calls, warmup=2, sync=sync, progress=progress, label="mixers: repeat", host=host,
    )  # fmt: skip
    summary: dict[str, Any] = {}
    for name in fns:  # the candidates' order, a failed one in its place
        if name in errors:
            summary[name] = {"error": errors[name]}
            continue
        ts = times[name]
        summary[name] = {
            "ms_median": 1000 * statistics.median(ts),
            "ms_min": 1000 * min(ts),
            "ms_max": 1000 * max(ts),
            "s_per_repeat": ts,
            "host_ms_median": 1000 * statistics.median(host[name]),
        }
    profiled = [name for name in getattr(args, "profile_mixers", ()) if name in calls]
    if profiled:  # where a call's time goes: its kernels and the host's calls
        from benchmarks._gpu_steps import kernel_table  # it builds training steps: imported only to profile

        for name in profiled:
            summary[name]["profile"] = kernel_table(calls[name], device, steps=PROFILED_CALLS)
    for name, s in summary.items():
        if "error" in s:
            continue
        ref = reference_of(name)
        s["ratio_to_timm_batch"] = s["ms_median"] / summary[ref]["ms_median"]
        # Paired per repeat: both ran within one repeat, so load that comes and goes hits both.
        s["paired_ratio"], s["paired_ratio_min"], s["paired_ratio_max"] = paired(times[name], times[ref])
    return summary

