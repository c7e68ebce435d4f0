"""Operators one training step dispatches: CutMix + TL-Align against CutMix + NoAlign, per family.

Timings on shared CPUs are noisy and GPUs are scarce; the number of ATen operators a step
dispatches is exact on any machine, and in eager mode on a GPU each one is (at least) a kernel
launch: what the label path's many small operations cost there. A dispatch mode counts every
operator the step runs below autograd (forward, loss and backward; the mixer and the optimizer
are the same on both sides and left out), on the CPU, at batch 2 and each model's default size.

Usage::

    python benchmarks/op_count.py                       # every family's small model (benchmarks/_families.py)
    python benchmarks/op_count.py --families vit resnet --out runs/op_count
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import _families
from benchmarks._provenance import finish, provenance
from benchmarks._training_step import TrainingSteps

__all__ = ["OpCounter", "count_step", "main"]

VARIANTS = ("cutmix", "tlalign")  # CutMix + NoAlign, CutMix + TL-Align


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch types its __init_subclass__ loosely
    """Counts every ATen operator dispatched inside it, by name (``aten.mm.default`` -> ``mm``), and apart
    the ones that compute (``kernels``): not views (``view``, ``permute``, ``slice``, ``detach`` ... only
    describe memory that exists), which on a GPU launch nothing."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: Counter[str] = Counter()
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        self.kernels += not getattr(func, "is_view", False)
        return func(*args, **(kwargs or {}))


def count_step(model_name: str, batch_size: int = 2) -> dict[str, Any]:
    """Operators of one forward + loss + backward with CutMix + NoAlign and with CutMix + TL-Align.

    The model, batch, mixer and adapters are ``TrainingSteps``' (what ``speed.py`` and the GPU suite time);
    one CutMix sample, drawn from its generator, serves both variants.
    """
    num_classes = 10 if model_name.startswith("example:") else 1000
    steps = TrainingSteps(model_name, num_classes=num_classes, batch_size=batch_size, device="cpu",
                          variants=VARIANTS, strict=True)
    mixer, images = steps.mixer, steps.images
    mixed, label_map = mixer.mix(images, steps.labels, mixer.sample(images.shape, generator=steps.generator))
    row: dict[str, Any] = {"model": model_name}
    for name in VARIANTS:
        steps.loss(name, mixed, label_map).backward()  # type: ignore[no-untyped-call]  # warm-up: caches filled
        steps.model.zero_grad(set_to_none=True)
        with OpCounter() as counter:
            steps.loss(name, mixed, label_map).backward()  # type: ignore[no-untyped-call]
        steps.model.zero_grad(set_to_none=True)
        row[name] = sum(counter.ops.values())
        row[f"{name}_kernels"] = counter.kernels
        row[f"{name}_ops"] = dict(counter.ops)
    row["added"] = row["tlalign"] - row["cutmix"]
    row["ratio"] = row["tlalign"] / row["cutmix"]
    row["kernel_ratio"] = row["tlalign_kernels"] / row["cutmix_kernels"]
    extra = Counter(row["tlalign_ops"])
    extra.subtract(Counter(row["cutmix_ops"]))
    row["top_added"] = [(op, n) for op, n in extra.most_common(6) if n > 0]
    return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--families", nargs="*", default=None, help="default: every aligning family")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--example", action="store_true", help="the registry's tiny 32 px models instead of benchmarks/_families.py's")
    p.add_argument("--out", type=Path, default=Path("runs/op_count"))
    args = p.parse_args(argv)
    models = _families.family_models()
    names = args.families or list(models)
    unknown = [n for n in names if n not in models]
    if unknown:
        raise SystemExit(f"--families: no such family {unknown}; choose from {', '.join(models)}")
    result: dict[str, Any] = {"provenance": provenance(), "batch_size": args.batch_size, "families": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for family in names:
        model = f"example:{family}" if args.example else models[family]
        row = count_step(model, args.batch_size)
        result["families"][family] = row
        print(f"{family:20s} {model:30s} {row['cutmix']:6d} -> {row['tlalign']:6d} ops ({row['ratio']:.3f}x), "
              f"{row['cutmix_kernels']} -> {row['tlalign_kernels']} computing ({row['kernel_ratio']:.3f}x)  "
              f"added: {', '.join(f'{op} {n}' for op, n in row['top_added'])}", flush=True)
        (args.out / "op_count.json").write_text(json.dumps(result, indent=1))
    result["provenance"] = finish(result["provenance"])
    (args.out / "op_count.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
