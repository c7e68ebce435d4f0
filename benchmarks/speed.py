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
    python benchmarks/speed.py --families vgg eva --variants cutmix cutmix-again tlalign --malloc keep --threads 2
                                                     # against the run's own noise floor (an A/A control), no trims
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks._label_work import measure_label_families
from benchmarks._malloc import keep_heap
from benchmarks._mixer_timing import measure_mixers
from benchmarks._provenance import finish, provenance
from benchmarks._speed_steps import measure_families, measure_steps
from benchmarks._speed_tables import describe_device, format_families, format_label_families, format_report
from benchmarks._step_memory import memory_worker
from benchmarks._variants import DEFAULT_VARIANTS, STEP_VARIANTS

__all__ = ["main", "parse_args"]


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
                   "the route every map took before BoxMask; with --pixel-boxes a per-pixel mask each step; "
                   "cutmix-again: the baseline again, an A/A control; timm-cutmix: timm's own step, its Mixup doing "
                   "CutMix and the bare model, with no adapter)")
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
    p.add_argument("--malloc", choices=["default", "keep"], default="default",
                   help="keep: glibc's malloc serves every size from its heap and never trims it, in the timing "
                   "process (page faults a step pays to glibc's trims move CPU ratios by several percent either way; "
                   "the per-step faults are reported beside the times). Memory workers run with the default")
    p.add_argument("--worker", choices=STEP_VARIANTS, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.malloc == "keep" and args.worker is None:
        keep_heap()  # before any tensor: every block the steps use comes from the kept heap
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
