"""The cost of alignment and of mixing, side by side, in one run.

Two measurements, each printed as absolute figures and as ratios measured in the
same run (the machine is noisy: variants are interleaved and repeated, and the
median and spread over repeats are reported):

1. **Training steps** (the paper's Table 2): img/s and peak memory of a full
   training step (mixing, forward, loss, backward, AdamW) for: no mixing;
   CutMix + NoAlign; + TransMix; + TL-Align (fast path: compact labels fused
   into attention); + TL-Align through autograd over the widened attention call
   (the route of devices without a fused kernel for it, e.g. MPS);
   + TL-Align reference path (explicit attention matrices and
   dense class labels, the official implementation's approach). Every variant
   runs in its own subprocess so that CPU peak memory is that process's peak
   RSS; on CUDA it is ``torch.cuda.max_memory_allocated``. RSS (glibc arenas,
   pages) swings by a few percent between processes, so on CPU the peak of live
   bytes in torch's CPU allocator is reported too (``alloc peak MB``, the
   counterpart of ``max_memory_allocated``): the profiler's allocation events of
   a fresh model, optimizer and batch and of its steps, replayed in time order.
2. **Mixers**: time per batch of every mixer (building its ``TokenLabelMap`` and
   the image targets included) against timm's ``Mixup`` (batch and elem
   modes), kornia's ``RandomCutMixV2``/``RandomMixUpV2`` and torchvision's
   ``v2.CutMix``/``v2.MixUp``. Ratios are paired: each repeat divides a mixer's
   time by its timm batch-mode reference's time in that same repeat. On CPU a
   batch-sized buffer is page-faulted afresh on each call or reused, as glibc's
   adaptive mmap threshold happens to stand, so times swing between processes;
   ``MALLOC_MMAP_THRESHOLD_=131072`` (always fault) or ``MALLOC_MMAP_MAX_=0``
   (never) fixes the regime for both sides.

3. **Where the label work goes** (``--families --label-profile``): per family, the
   forward pass with TL-Align against the forward with NoAlign (no grad, train mode,
   interleaved rounds), their difference (the label work: labels carry no gradient,
   so the backward does the same work), its share of a CutMix + NoAlign training
   step, and the operators that add the most time (``torch.profiler`` self CPU time,
   TL-Align's forward minus NoAlign's).

Usage::

    python benchmarks/speed.py                       # CPU, tiny ViT, quick
    python benchmarks/speed.py --model deit_small_patch16_224 --batch-size 16
    python benchmarks/speed.py --model pvt_v2_b0 --batch-size 8     # any supported family, its default input size
    python benchmarks/speed.py --model example:swin --num-classes 10  # the registry's tiny 32 px model of a family
    python benchmarks/speed.py --device cuda --model deit_small_patch16_224 --batch-size 128
    python benchmarks/speed.py --only mixers --mixers "ours CutMix" --mixer-batch 64   # one pair, more repeats
    python benchmarks/speed.py --families --label-profile --batch-size 8 --threads 2  # where the label time goes
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import gc
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks._provenance import finish, provenance
from benchmarks.report import LABEL_WORK_HEADER, label_work_row

STEP_VARIANTS = ("none", "cutmix", "transmix", "tlalign", "tlalign-widened", "tlalign-reference", "tlalign-cells")
DEFAULT_VARIANTS = STEP_VARIANTS[:-1]  # tlalign-cells measures a past route: asked for by name
BASELINE = "cutmix"
LABELS = {
    "none": "no mixing",
    "cutmix": "CutMix + NoAlign",
    "transmix": "CutMix + TransMix",
    "tlalign": "CutMix + TL-Align (fast)",
    "tlalign-widened": "CutMix + TL-Align (widened autograd)",
    "tlalign-reference": "CutMix + TL-Align (reference)",
    "tlalign-cells": "CutMix + TL-Align (box mask densified to cells)",
}


# --------------------------------------------------------------------------- models


def build_model(name: str, num_classes: int) -> tuple[torch.nn.Module, int]:
    """A random-init timm model and its input size: ``tiny``, ``example:FAMILY`` (the registry's tiny
    32 px test model of a family, 10 classes) or any timm name at its default input size."""
    import timm

    if name == "tiny":  # DeiT-Ti's widths (192 dims, 3 heads, 12 blocks) on 32 px images, patch 4: 64 tokens
        model = timm.create_model(
            "deit_tiny_patch16_224", pretrained=False, num_classes=num_classes, img_size=32, patch_size=4
        )
        return model, 32
    if name.startswith("example:"):
        from mixlabels.backbones import FAMILIES

        families = {f.name: f for f in FAMILIES}
        family = families.get(name.removeprefix("example:"))
        if family is None:
            raise SystemExit(f"--model {name}: no such family; choose example:NAME with NAME one of {', '.join(families)}")
        if num_classes != 10:
            raise SystemExit(f"--model {name} is built with 10 classes (the registry's example); pass --num-classes 10")
        return family.example(), 32
    model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    # Every timm model states its default input in its pretrained config (not every family has patch_embed.img_size).
    cfg: Any = getattr(model, "pretrained_cfg", None)
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    if not size:
        raise SystemExit(f"timm model {name} states no default input_size in its pretrained_cfg")
    return model, int(size[-1])


def token_stride(model: torch.nn.Module) -> int | None:
    """Pixels per token of the first token grid (to snap CutMix boxes to it, as the official TL-Align
    code does): the stride of the patch-embedding or stem convolution; ``None`` (pixel boxes) when there is none."""
    for attr in ("patch_embed", "stem"):
        first = getattr(model, attr, None)
        if isinstance(first, torch.nn.Module):
            convs = [mod for mod in first.modules() if isinstance(mod, torch.nn.Conv2d)]
            if convs:
                return int(convs[0].stride[0])
    return None


# One small model per aligning family (its smallest timm variant, default input size): the per-family table.
FAMILY_MODELS = {
    "vit": "deit_tiny_patch16_224",
    "swin": "swin_tiny_patch4_window7_224",
    "pvt_v2": "pvt_v2_b0",
    "cait": "cait_xxs24_224",
    "mlp_mixer": "mixer_s32_224",
    "convnext": "convnext_atto",
    "metaformer": "poolformerv2_s12",
    "vit_relpos": "vit_relpos_small_patch16_224",
    "beit": "beit_base_patch16_224",
    "eva": "eva02_tiny_patch14_224",
    "swinv2": "swinv2_tiny_window8_256",
    "swinv2_cr": "swinv2_cr_tiny_224",
    "davit": "davit_tiny",
    "gcvit": "gcvit_xxtiny",
    "efficientvit_mit": "efficientvit_b0",
    "mvitv2": "mvitv2_tiny",
    "efficientvit_msra": "efficientvit_m0",
    "hiera": "hiera_tiny_224",
    "resmlp": "resmlp_12_224",
    "gmlp": "gmlp_ti16_224",
    "crossvit": "crossvit_tiny_240",
    "tnt": "tnt_s_patch16_224",
    "maxxvit": "maxvit_pico_rw_256",
    "twins": "twins_svt_small",
    "nest": "nest_tiny_jx",
    "focalnet": "focalnet_tiny_srf",
    "xcit": "xcit_nano_12_p16_224",
    "resnet": "resnet18",
    "efficientnet": "efficientnet_b0",
    "levit": "levit_128s",
    "mobilenetv3": "mobilenetv3_small_100",
    "mobilenetv4": "mobilenetv4_conv_small",
    "efficientformer": "efficientformer_l1",
    "volo": "volo_d1_224",
    "fastvit": "fastvit_t8",
    "regnet": "regnety_002",
    "byobnet": "mobilevit_xxs",
    "efficientformer_v2": "efficientformerv2_s0",
}


def describe_device(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


# --------------------------------------------------------------------------- training steps


class StepBench:
    """Every step variant over ONE model and optimizer, so variants can be interleaved step by step.

    The adapters share the model's parameters, so switching variant between steps
    changes nothing about the work a step does; only the timings are interleaved.
    """

    def __init__(self, args: argparse.Namespace, variants: Sequence[str]) -> None:
        import mixlabels
        from mixlabels.backbones import adapt
        from mixlabels.backbones._attention import widened_autograd
        from mixlabels.strategies import CutMix

        torch.manual_seed(0)
        self.device = torch.device(args.device)
        model, size = build_model(args.model, args.num_classes)
        self.model = model.to(self.device).train()
        patch = token_stride(model)
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.images = torch.randn(args.batch_size, 3, size, size, generator=gen).to(self.device)
        self.labels = torch.randint(0, args.num_classes, (args.batch_size,), generator=gen).to(self.device)
        # Boxes snapped to the token grid, as the official TL-Align code does, or on pixels (timm's CutMix).
        pixel_boxes = bool(getattr(args, "pixel_boxes", False))
        self.mixer = CutMix(num_classes=args.num_classes, label_smoothing=0.1, patch_size=None if pixel_boxes else patch)
        schemes: dict[str, Any] = {
            "cutmix": mixlabels.NoAlign(),
            "transmix": mixlabels.TransMix(),
            "tlalign": mixlabels.TLAlign(),
            "tlalign-widened": mixlabels.TLAlign(),
            "tlalign-reference": mixlabels.TLAlign(),
            "tlalign-cells": mixlabels.TLAlign(),
        }
        self.adapted: dict[str, Any] = {}
        self.refused: dict[str, str] = {}  # variant -> why adapt refuses the model (the 'any' family: NoAlign only)
        for v in variants:
            if v != "none":
                try:
                    self.adapted[v] = adapt(model, schemes[v], reference=v == "tlalign-reference")
                except TypeError as err:
                    self.refused[v] = str(err).splitlines()[0]
        self.routes: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
            v: widened_autograd if v == "tlalign-widened" else contextlib.nullcontext for v in variants
        }
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
        self.amp = self.device.type == "cuda" and bool(args.amp)

    def step(self, variant: str) -> None:
        """One full training step: mix, forward, loss, backward, AdamW."""
        import mixlabels

        with self.routes[variant](), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            if variant == "none":
                loss = F.cross_entropy(self.model(self.images), self.labels, label_smoothing=0.1)
            else:
                mixed, label_map = self.mixer(self.images, self.labels)
                if variant == "tlalign-cells":  # the route before mask types: token weights from a cell mask
                    label_map = dataclasses.replace(label_map, mask=mixlabels.CellMask(label_map.mask.dense()))
                loss = self.adapted[variant](mixed, label_map).loss()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def interleaved_times(
    calls: dict[str, Callable[[], object]],
    *,
    rounds: int,
    per_block: int,
    warmup: int,
    sync: Callable[[], None],
    progress: Callable[[str], None],
    label: str,
) -> dict[str, list[float]]:
    """Seconds per call of every entry, per round: each round runs every entry's block of
    ``per_block`` calls back to back, in an order rotated by one each round, so that load
    that comes and goes hits every entry alike (pair the rounds for ratios)."""
    for call in calls.values():  # warm-up: kernels, allocator, autotuning
        for _ in range(warmup):
            call()
    sync()
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        progress(f"{label} {r + 1}/{rounds}")
        for name in order:
            t0 = time.perf_counter()
            for _ in range(per_block):
                calls[name]()
            sync()
            times[name].append((time.perf_counter() - t0) / per_block)
        order = order[1:] + order[:1]
    return times


def paired(times: Sequence[float], reference: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max of the per-round ratios ``times / reference`` (same round: same machine load)."""
    ratios = [t / r for t, r in zip(times, reference)]
    return statistics.median(ratios), min(ratios), max(ratios)


def measure_steps(
    args: argparse.Namespace, progress: Callable[[str], None], refused: dict[str, str] | None = None
) -> dict[str, Any]:
    """Step time of every variant, interleaved: ``repeats`` rounds, each running every variant's
    block of ``steps`` steps back to back in a rotating order; ratios are paired per round.

    A variant whose scheme refuses the model (TransMix on a pooled family) is left out and its
    reason put in ``refused``."""
    bench = StepBench(args, list(args.variants))
    why = dict(bench.refused)
    for v in args.variants:
        if v not in why:
            try:  # pooled families refuse TransMix when the forward starts
                bench.step(v)
            except ValueError as err:
                why[v] = str(err).splitlines()[0]
    variants = [v for v in args.variants if v not in why]
    for v, reason in why.items():
        progress(f"{LABELS[v]}: refused: {reason}")
    if refused is not None:
        refused.update(why)
    times = interleaved_times(
        {v: partial(bench.step, v) for v in variants}, rounds=args.repeats, per_block=args.steps,
        warmup=args.warmup, sync=bench.sync, progress=progress, label="steps: round",
    )  # fmt: skip
    memory = {v: measure_memory(v, args, progress) for v in variants}
    summary: dict[str, Any] = {}
    for v, ts in times.items():
        summary[v] = {
            "img_s": args.batch_size / statistics.median(ts),
            "step_ms_median": 1000 * statistics.median(ts),
            "step_ms_min": 1000 * min(ts),
            "step_ms_max": 1000 * max(ts),
            **memory[v],
            "step_s_per_round": ts,
        }
    if BASELINE in summary:
        base = summary[BASELINE]
        for v, s in summary.items():
            s["time_ratio"], s["time_ratio_min"], s["time_ratio_max"] = paired(times[v], times[BASELINE])
            s["memory_ratio"] = s["peak_mb"] / base["peak_mb"]
            s["step_memory_ratio"] = s["step_mb"] / base["step_mb"] if base["step_mb"] > 0 else float("nan")
            s["alloc_ratio"] = s["alloc_peak_mb"] / base["alloc_peak_mb"]
            s["alloc_step_ratio"] = s["alloc_step_mb"] / base["alloc_step_mb"]
    return summary


def _proc_status_mb(field: str) -> float:
    """A memory field of ``/proc/self/status`` (Linux), MB: ``VmRSS`` now, ``VmHWM`` the peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}; CPU peak memory needs Linux")


def _reset_peak_rss() -> None:
    """Reset the process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


ALLOCATOR_DEVICES = frozenset({"cpu", "mkldnn", "ideep"})  # what torch's profiler counts as CPU memory
WINDOW = "speed.allocator_peak.window"


@dataclass(frozen=True)
class AllocPeak:
    """Live bytes of torch's CPU allocator around a window of code, replayed from profiler events.

    Only blocks allocated while the profiler ran are known to it: ``start_bytes`` counts
    those still live when the window starts, not what was allocated before profiling.
    """

    start_bytes: int  # live when the window starts
    peak_bytes: int  # the most live at once during the window (>= start_bytes)
    top: dict[str, int]  # bytes allocated in the window and live at its peak, by allocating op, largest first

    @property
    def step_bytes(self) -> int:
        """What the window adds at its peak on top of what was live when it started."""
        return self.peak_bytes - self.start_bytes


@dataclass(frozen=True)
class _Alloc:
    time_ns: int
    ptr: int
    size: int  # negative: a free
    op: str


def _op_label(event: torch._C._profiler._ProfilerEvent) -> str:
    """``outermost op > innermost op`` of an allocation (ops inside the window annotation only)."""
    names: list[str] = []
    parent = event.parent
    while parent is not None and parent.name != WINDOW:
        names.append(parent.name)
        parent = parent.parent
    if not names:
        return "(no op)"
    return names[-1] if len(names) == 1 else f"{names[-1]} > {names[0]}"


def allocator_peak(window: Callable[[], None], before: Callable[[], None] = lambda: None, top: int = 8) -> AllocPeak:
    """Peak live bytes of torch's CPU allocator while ``window`` runs (what ``max_memory_allocated`` is on CUDA).

    Both callables run under ``torch.profiler`` with ``profile_memory=True``; its allocation
    events (size, negative for a free, and a timestamp) are replayed in time order. The
    profiler does not report the free of a block allocated before it started, so whatever
    ``window`` may free (the previous step's gradients and activations) has to be allocated
    by ``before``, under the profiler too.

    Args:
        window: the code whose peak is wanted, e.g. one training step.
        before: run first, e.g. building the model and a warm-up step.
        top: how many allocating ops to keep in ``AllocPeak.top``.

    Returns:
        An ``AllocPeak``; e.g. a window that allocates 10 MB, frees it and allocates 4 MB
        has ``step_bytes == 10_000_000``.
    """
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=False) as prof:
        before()
        with record_function(WINDOW):
            window()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("the profiler recorded nothing")
    allocs: list[_Alloc] = []
    span: tuple[int, int] | None = None
    stack = list(results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.TorchOp and event.name == WINDOW:
            span = (event.start_time_ns, event.end_time_ns)
        elif event.tag == _EventType.Allocation:
            fields = event.extra_fields
            assert isinstance(fields, torch._C._profiler._ExtraFields_Allocation)
            if fields.device.type in ALLOCATOR_DEVICES:
                allocs.append(_Alloc(event.start_time_ns, fields.ptr, fields.alloc_size, _op_label(event)))
    if span is None:
        raise RuntimeError(f"the profiler recorded no {WINDOW!r} annotation")
    allocs.sort(key=lambda a: a.time_ns)
    start = sum(a.size for a in allocs if a.time_ns < span[0])
    inside = [a for a in allocs if span[0] <= a.time_ns <= span[1]]
    live, peak, at_peak = start, start, 0
    for i, a in enumerate(inside, 1):
        live += a.size
        if live > peak:
            peak, at_peak = live, i
    owners: dict[int, _Alloc] = {}  # replayed again up to the peak: who holds the bytes there
    for a in inside[:at_peak]:
        if a.size > 0:
            owners[a.ptr] = a
        else:
            owners.pop(a.ptr, None)
    by_op: Counter[str] = Counter()
    for a in owners.values():
        by_op[a.op] += a.size
    return AllocPeak(start_bytes=start, peak_bytes=peak, top=dict(by_op.most_common(top)))


def memory_worker(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: peak memory of ``args.warmup`` training steps of one variant.

    ``peak_mb`` is the peak during the training steps: the process's peak RSS (CPU;
    reset after set-up, so imports and model building do not count) or
    ``max_memory_allocated`` (CUDA). ``step_mb`` is what the steps add on top of the
    model, optimizer state and batch already in memory: the part alignment can change.

    ``alloc_peak_mb`` and ``alloc_step_mb`` are the same two figures counted in live
    bytes of torch's allocator instead of pages (on CUDA they are ``peak_mb`` and
    ``step_mb``). On CPU they come from ``allocator_peak`` over a second, fresh
    model, optimizer and batch, built, set up and warmed up under the profiler (so
    that every block they hold is known to it) once the RSS figures are taken (the
    profiler's own buffers would count in RSS); ``alloc_top_mb`` says which ops hold
    the step's bytes at the peak. In this process rather than the parent: the
    parent's model carries every variant's adapter.
    """
    bench = StepBench(args, [variant])
    bench.step(variant)  # creates the optimizer state, so it counts as set-up
    bench.sync()
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)
        before = torch.cuda.memory_allocated(bench.device) / 2**20
    else:
        gc.collect()
        before = _proc_status_mb("VmRSS")
        _reset_peak_rss()
    for _ in range(max(1, args.warmup)):
        bench.step(variant)
    bench.sync()
    if bench.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(bench.device) / 2**20
    else:
        peak = _proc_status_mb("VmHWM")
    result: dict[str, Any] = {"peak_mb": peak, "step_mb": max(0.0, peak - before)}
    if bench.device.type == "cuda":
        return result | {"alloc_peak_mb": result["peak_mb"], "alloc_step_mb": result["step_mb"], "alloc_top_mb": {}}
    del bench
    gc.collect()
    fresh: list[StepBench] = []

    def set_up() -> None:
        fresh.append(StepBench(args, [variant]))
        for _ in range(1 + max(1, args.warmup)):  # optimizer state, then warm-up
            fresh[0].step(variant)

    alloc = allocator_peak(lambda: fresh[0].step(variant), set_up)
    return result | {
        "alloc_peak_mb": alloc.peak_bytes / 2**20,
        "alloc_step_mb": alloc.step_bytes / 2**20,
        "alloc_top_mb": {op: n / 2**20 for op, n in alloc.top.items()},
    }


def measure_memory(variant: str, args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run ``memory_worker`` for one variant in its own subprocess (a clean peak RSS)."""
    progress(f"memory: {LABELS[variant]}")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--device", args.device,
           "--model", args.model, "--batch-size", str(args.batch_size), "--warmup", str(args.warmup),
           "--num-classes", str(args.num_classes), "--threads", str(torch.get_num_threads())]
    if getattr(args, "pixel_boxes", False):
        cmd.append("--pixel-boxes")
    if not args.amp:
        cmd.append("--no-amp")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the memory run of {variant} failed:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


# --------------------------------------------------------------------------- mixers


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

    times = interleaved_times(
        {name: partial(fn, x, y) for name, fn in fns.items()}, rounds=args.mixer_repeats,
        per_block=args.mixer_calls, warmup=2, sync=sync, progress=progress, label="mixers: repeat",
    )  # fmt: skip
    summary: dict[str, Any] = {}
    for name, ts in times.items():
        summary[name] = {
            "ms_median": 1000 * statistics.median(ts),
            "ms_min": 1000 * min(ts),
            "ms_max": 1000 * max(ts),
            "s_per_repeat": ts,
        }
    for name, s in summary.items():
        ref = reference_of(name)
        s["ratio_to_timm_batch"] = s["ms_median"] / summary[ref]["ms_median"]
        # Paired per repeat: both ran within one repeat, so load that comes and goes hits both.
        s["paired_ratio"], s["paired_ratio_min"], s["paired_ratio_max"] = paired(times[name], times[ref])
    return summary


# --------------------------------------------------------------------------- per family


def measure_families(args: argparse.Namespace, progress: Callable[[str], None],
                     save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``measure_steps`` on ``FAMILY_MODELS[f]`` for every family asked for, one after the other;
    ``save(rows)`` after each (a run cut short keeps the families it measured)."""
    rows: dict[str, Any] = {}
    for family in _family_names(args):
        progress(f"family {family}: {FAMILY_MODELS[family]}")
        fam_args = argparse.Namespace(**{**vars(args), "model": FAMILY_MODELS[family]})
        refused: dict[str, str] = {}
        rows[family] = {"model": FAMILY_MODELS[family], "steps": measure_steps(fam_args, progress, refused), "refused": refused}
        # Each family's row as soon as it is measured: a long run cut short still says something.
        progress(format_families({**result_head(args), "families": {family: rows[family]}}).splitlines()[-1])
        if save is not None:
            save(rows)
    return rows


def _op_times(call: Callable[[], object], iters: int) -> dict[str, tuple[float, int]]:
    """Self CPU ms and calls per ``call`` of every operator it runs (``torch.profiler``), over ``iters`` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            call()
    return {e.key: (e.self_cpu_time_total / 1000 / iters, e.count // iters) for e in prof.key_averages()}


def measure_label_work(args: argparse.Namespace, progress: Callable[[str], None], top: int = 4) -> dict[str, Any]:
    """The label work of TL-Align on ``args.model``: forward with TL-Align minus forward with NoAlign (no grad, train
    mode, one CutMix batch, interleaved rounds), its share of a CutMix + NoAlign training step, and the ``top``
    operators by added self CPU time (median over ``args.repeats`` interleaved profiles: the model's own operators
    swing by several percent between profiles, which a single difference would read as label work), with the calls
    they add."""
    bench = StepBench(args, ["cutmix", "tlalign"])
    if "tlalign" in bench.refused:
        return {"refused": bench.refused["tlalign"]}
    mixed, label_map = bench.mixer(bench.images, bench.labels)

    def forward(variant: str) -> None:
        with torch.no_grad(), torch.autocast(bench.device.type, dtype=torch.bfloat16, enabled=bench.amp):
            bench.adapted[variant](mixed, label_map)

    steps = interleaved_times({"step": partial(bench.step, "cutmix")}, rounds=args.repeats, per_block=args.steps,
                              warmup=args.warmup, sync=bench.sync, progress=progress, label="CutMix steps: round")
    fwd = interleaved_times({v: partial(forward, v) for v in ("cutmix", "tlalign")}, rounds=args.repeats,
                            per_block=args.steps, warmup=args.warmup, sync=bench.sync, progress=progress,
                            label="forwards: round")
    diffs = [1000 * (t - c) for t, c in zip(fwd["tlalign"], fwd["cutmix"])]
    profiles: dict[str, list[dict[str, tuple[float, int]]]] = {"cutmix": [], "tlalign": []}
    for r in range(args.repeats):
        progress(f"profiles: round {r + 1}/{args.repeats}")
        for v in ("cutmix", "tlalign") if r % 2 == 0 else ("tlalign", "cutmix"):
            profiles[v].append(_op_times(partial(forward, v), args.steps))
    keys = {k for p in profiles["tlalign"] + profiles["cutmix"] for k in p}

    def added(key: str) -> tuple[float, int]:
        ms = statistics.median(t.get(key, (0.0, 0))[0] - c.get(key, (0.0, 0))[0]
                               for t, c in zip(profiles["tlalign"], profiles["cutmix"]))
        return ms, profiles["tlalign"][0].get(key, (0.0, 0))[1] - profiles["cutmix"][0].get(key, (0.0, 0))[1]

    ranked = sorted(((*added(k), k) for k in keys), reverse=True)
    step_ms = 1000 * statistics.median(steps["step"])
    label_ms = statistics.median(diffs)
    return {
        "step_ms": step_ms,
        "forward_ms": {v: 1000 * statistics.median(ts) for v, ts in fwd.items()},
        "label_ms": label_ms, "label_ms_min": min(diffs), "label_ms_max": max(diffs),
        "label_share": label_ms / step_ms,
        "top_ops": [[name, ms, calls] for ms, calls, name in ranked[:top]],
    }


def measure_label_families(args: argparse.Namespace, progress: Callable[[str], None],
                           save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``measure_label_work`` for every family asked for (``save(rows)`` after each, as ``measure_families``)."""
    rows: dict[str, Any] = {}
    for family in _family_names(args):
        progress(f"family {family}: {FAMILY_MODELS[family]}")
        fam_args = argparse.Namespace(**{**vars(args), "model": FAMILY_MODELS[family]})
        rows[family] = {"model": FAMILY_MODELS[family], "labels": measure_label_work(fam_args, progress)}
        progress(format_label_families({**result_head(args), "families": {family: rows[family]}}).splitlines()[-1])
        if save is not None:
            save(rows)
    return rows


def format_label_families(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"device: {result['device']}", f"command: {result['command']}", "",
        f"Per family: batch {cfg['batch_size']}, default input size; forward ms (no grad, train mode, median of "
        f"{cfg['repeats']} interleaved rounds of {cfg['steps']}); label work = TL-Align forward - NoAlign forward "
        "(median [min, max] of the paired rounds), its share of the CutMix + NoAlign training step; the operators "
        "adding the most self CPU time (profiler, TL-Align minus NoAlign, median of the paired profiles; the calls "
        "each adds per forward)",
        "",
        *LABEL_WORK_HEADER,
    ]
    lines += [label_work_row(family, row) for family, row in result["families"].items()]
    return "\n".join(lines)


def _family_names(args: argparse.Namespace) -> list[str]:
    unknown = [f for f in args.families or () if f not in FAMILY_MODELS]
    if unknown:
        raise SystemExit(f"--families {' '.join(unknown)}: unknown; choose from {', '.join(FAMILY_MODELS)}")
    return list(args.families or FAMILY_MODELS)


def result_head(args: argparse.Namespace) -> dict[str, Any]:
    """What ``format_families`` reads besides the rows."""
    return {"device": describe_device(args.device), "command": "", "config": {"variants": args.variants,
            "batch_size": args.batch_size, "repeats": args.repeats, "steps": args.steps}}


def format_families(result: dict[str, Any]) -> str:
    cfg = result["config"]
    variants = [v for v in cfg["variants"] if v != BASELINE]
    lines = [
        f"device: {result['device']}", f"command: {result['command']}", "",
        f"Per family: batch {cfg['batch_size']}, default input size, {cfg['repeats']} interleaved repeats x "
        f"{cfg['steps']} steps; time = paired per-repeat ratio to {LABELS[BASELINE]} (median [min, max]); "
        "alloc peak = ratio of the allocator's peak live bytes (model, optimizer state, batch and step); "
        "alloc step = ratio of what the step adds on top",
        "",
        "| family | model | " + " | ".join(f"{LABELS[v]} time | alloc peak | alloc step" for v in variants) + " |",
        "| --- | --- |" + " ---: | ---: | ---: |" * len(variants),
    ]
    for family, row in result["families"].items():
        cells = []
        for v in variants:
            s = row["steps"].get(v)
            if s is None:
                cells.append("refused | - | -")
                continue
            cells.append(
                f"{s['time_ratio']:.3f} [{s['time_ratio_min']:.3f}, {s['time_ratio_max']:.3f}] | "
                f"{s['alloc_ratio']:.4f} | {s['alloc_step_ratio']:.4f}"
            )
        base = row["steps"][BASELINE]
        lines.append(f"| {family} | {row['model']} ({base['step_ms_median']:.0f} ms) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- report


def format_report(result: dict[str, Any]) -> str:
    lines = [f"device: {result['device']}", f"command: {result['command']}", ""]
    if "steps" in result:
        cfg = result["config"]
        lines += [
            f"Training step, {cfg['model']}, batch {cfg['batch_size']}, {cfg['repeats']} interleaved repeats "
            f"x {cfg['steps']} steps (median; ratio = paired per-repeat ratio to {LABELS[BASELINE]}, median [min, max])",
            "",
            "| variant | img/s | step ms (median [min, max]) | time ratio | peak MB | memory ratio "
            "| step MB | step memory ratio | alloc peak MB | alloc ratio | alloc step MB | alloc step ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for v, s in result["steps"].items():
            ratio = (
                f"{s['time_ratio']:.3f} [{s['time_ratio_min']:.3f}, {s['time_ratio_max']:.3f}]"
                if "time_ratio" in s
                else "-"
            )
            mem = f"{s['memory_ratio']:.3f}" if "memory_ratio" in s else "-"
            step_mem = f"{s['step_memory_ratio']:.3f}" if "step_memory_ratio" in s else "-"
            alloc = f"{s['alloc_ratio']:.4f}" if "alloc_ratio" in s else "-"
            alloc_step = f"{s['alloc_step_ratio']:.4f}" if "alloc_step_ratio" in s else "-"
            lines.append(
                f"| {LABELS[v]} | {s['img_s']:.1f} | {s['step_ms_median']:.1f} [{s['step_ms_min']:.1f}, "
                f"{s['step_ms_max']:.1f}] | {ratio} | {s['peak_mb']:.0f} | {mem} | {s['step_mb']:.0f} | {step_mem} "
                f"| {s['alloc_peak_mb']:.1f} | {alloc} | {s['alloc_step_mb']:.1f} | {alloc_step} |"
            )
        lines += [
            "",
            "peak MB: peak RSS during the training steps (CPU; the peak is reset after imports and set-up) or "
            "max_memory_allocated (CUDA), one fresh process per variant; step MB: what the steps add on top of the "
            "model, optimizer state and batch. alloc peak MB / alloc step MB: the same in live bytes of torch's "
            "CPU allocator (torch.profiler allocation events replayed in time order; on CUDA the same as peak MB / "
            "step MB).",
        ]
        lines += [f"{LABELS[v]}: not measured, the scheme refuses this model: {why}" for v, why in result.get("refused", {}).items()]
        lines.append("")
    if "mixers" in result:
        cfg = result["config"]
        lines += [
            f"Mixer cost per batch of {cfg['mixer_batch']}x3x{cfg['mixer_size']}x{cfg['mixer_size']} "
            f"(targets included; {cfg['mixer_repeats']} interleaved repeats of {cfg['mixer_calls']} calls; "
            "paired ratio = per-repeat ratio to timm's batch mode of the same kind, median [min, max])",
            "",
            "| mixer | ms (median [min, max]) | paired ratio to timm batch mode | ratio of medians |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, s in result["mixers"].items():
            lines.append(
                f"| {name} | {s['ms_median']:.2f} [{s['ms_min']:.2f}, {s['ms_max']:.2f}] | {s['paired_ratio']:.2f} "
                f"[{s['paired_ratio_min']:.2f}, {s['paired_ratio_max']:.2f}] | {s['ratio_to_timm_batch']:.2f} |"
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast on cuda)")
    p.add_argument(
        "--model", default="tiny",
        help="'tiny' (32 px ViT of the CPU ablation), 'example:FAMILY' (a family's tiny test model) or a timm model name",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of every variant")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=STEP_VARIANTS,
                   help="step variants (tlalign-cells: TL-Align with the CutMix boxes densified to a cell mask, "
                   "the route every map took before BoxMask; with --pixel-boxes a per-pixel mask each step)")
    p.add_argument("--pixel-boxes", action="store_true",
                   help="CutMix boxes on pixels (timm's CutMix) instead of snapped to the token grid")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="fp32 on cuda")
    p.add_argument("--mixer-batch", type=int, default=128)
    p.add_argument("--mixer-size", type=int, default=224)
    p.add_argument("--mixer-patch", type=int, default=16)
    p.add_argument("--mixer-calls", type=int, default=5)
    p.add_argument("--mixer-repeats", type=int, default=7)
    p.add_argument(
        "--mixers", nargs="+", default=None, metavar="NAME",
        help="time only the mixers whose name contains one of these (case-insensitive), plus their timm references",
    )
    p.add_argument("--only", choices=["steps", "mixers"], default=None)
    p.add_argument(
        "--families", nargs="*", default=None, metavar="FAMILY",
        help="the per-family table: the step variants on one small model per family (all when none named)",
    )
    p.add_argument("--label-profile", action="store_true",
                   help="with --families: where the label work goes (forward TL-Align - NoAlign, top operators)")
    p.add_argument("--out", type=Path, default=Path("runs/speed"))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--worker", choices=STEP_VARIANTS, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.worker is not None:
        print(json.dumps(memory_worker(args.worker, args)), flush=True)
        return {}
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device")

    def progress(msg: str) -> None:
        print(f"[speed] {msg}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "device": describe_device(args.device),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
        "provenance": provenance(device=args.device),
    }
    if args.label_profile and args.families is None:
        raise SystemExit("--label-profile profiles the per-family models: add --families (all) or --families NAME ...")
    if args.families is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        kind = "labels" if args.label_profile else "families"
        path = args.out / f"speed-{kind}-{args.device}-{stamp}.json"

        def save(rows: dict[str, Any]) -> None:
            path.write_text(json.dumps({**result, "families": rows}, indent=2))

        measure, fmt = (measure_label_families, format_label_families) if args.label_profile else (measure_families, format_families)
        result["families"] = measure(args, progress, save)
        result["provenance"] = finish(result["provenance"])
        save(result["families"])
        report = fmt(result)
        print(report)
        (args.out / f"speed-{kind}-{args.device}-{stamp}.md").write_text(report + "\n")
        return result
    if args.only in (None, "steps"):
        refused: dict[str, str] = {}
        result["steps"] = measure_steps(args, progress, refused)
        result["refused"] = refused
    if args.only in (None, "mixers"):
        result["mixers"] = measure_mixers(args, progress)
    result["provenance"] = finish(result["provenance"])
    report = format_report(result)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"speed-{args.device}-{stamp}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"speed-{args.device}-{stamp}.md").write_text(report + "\n")
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    main()
