"""Operators one training step dispatches: CutMix + TL-Align against CutMix + NoAlign, per family.

Timings on shared CPUs are noisy and GPUs are scarce; the number of ATen operators a step
dispatches is exact on any machine, and in eager mode on a GPU each one is (at least) a kernel
launch: what the label path's many small operations cost there. A dispatch mode counts every
operator the step runs below autograd (forward, loss and backward; the mixer and the optimizer
are the same on both sides and left out), on the CPU, at batch 2 and each model's default size, with
the label kernels' GPU routes (``launch_routes``: not the CPU's byte-saving ones, which trade
operators a CPU does not pay for against bytes it does).

With ``--mixers``, the mixers instead: every mixer of ``speed.py``'s list (ours, timm's ``Mixup``)
called once on a 128 x 3 x 224 x 224 batch, counted twice in one run: on the CPU (every operator,
views apart), and on the path a CUDA batch takes, replayed on fake CUDA tensors (no GPU needed):
the kernels it would launch, the operators left on the host, the host-to-device copies and the
host syncs (a value read back: ``.item()``, ``.tolist()``, ``bool()``, ``nonzero``), each with
the line that asks for it.

With ``--compiled``, a compiled step instead (``torch.compile``, inductor, on the CPU) for a few families: the
generated kernels and the extern calls (convolutions, matrix products) one step runs, CutMix + NoAlign against
CutMix + TL-Align with the label convs as convolutions and as shifted sums (``compiled_label_convs``); on a GPU
each is a launch (``benchmarks/_compiled_count.py``).

With ``--whole``, whether every family's model compiles whole instead: a TL-Align training step under
``torch.compile(fullgraph=True)`` (``aot_eager`` on the CPU: forward and backward traced, eager kernels), one graph,
no break, no recompile on a second batch, and equal to the eager step from the same state and seed
(``benchmarks/_compile_whole.py``).

Usage::

    python benchmarks/op_count.py                       # every family's small model (benchmarks/_families.py)
    python benchmarks/op_count.py --compiled            # compiled steps of COMPILED_FAMILIES
    python benchmarks/op_count.py --whole               # does every family's step compile as one graph?
    python benchmarks/op_count.py --families vit resnet --out runs/op_count
    python -m benchmarks.op_count --mixers              # every mixer against timm's Mixup
    python -m benchmarks.op_count --mixers CutMix MixUp --batch-size 128
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from benchmarks import _families
from benchmarks._compile_whole import compiles_whole
from benchmarks._compiled_count import count_compiled_calls
from benchmarks._op_counter import OpCounter
from benchmarks._provenance import finish, provenance
from benchmarks._training_step import TrainingSteps
from mixlabels.backbones._common import compiled_label_convs, launch_routes

__all__ = ["OpCounter", "count_step", "main"]  # OpCounter: re-exported from benchmarks._op_counter

VARIANTS = ("cutmix", "tlalign")  # CutMix + NoAlign, CutMix + TL-Align
COMPILED = ("cutmix", "tlalign/conv", "tlalign/shifted")  # CutMix + NoAlign; TL-Align by each compiled label conv route
COMPILED_FAMILIES = ("resnet", "convnext", "efficientnet", "mobilenetv3", "efficientvit_mit", "byobnet")
"""``--compiled``'s default: conv and hybrid families whose label path convolves (inductor compiles each step three
times, about a minute a family on 2 cores)."""


def _mixed_sample(model_name: str, batch_size: int) -> tuple[TrainingSteps, torch.Tensor, Any]:
    """The step set-up (``TrainingSteps``, CPU) and one CutMix sample drawn from its generator: the mixed batch and
    its label map, which every variant counted then shares."""
    num_classes = 10 if model_name.startswith("example:") else 1000
    steps = TrainingSteps(model_name, num_classes=num_classes, batch_size=batch_size, device="cpu",
                          variants=VARIANTS, strict=True)
    mixer, images = steps.mixer, steps.images
    mixed, label_map = mixer.mix(images, steps.labels, mixer.sample(images.shape, generator=steps.generator))
    return steps, mixed, label_map


WARMUP_STEPS = 2
"""Uncounted steps before the counted one: the first fills the shape caches and learns each adapter's grid plan
(``backbones._grid_plan``), the second builds the plan's joint constants, as a GPU's first steps do."""


def count_step(model_name: str, batch_size: int = 2) -> dict[str, Any]:
    """Operators of one forward + loss + backward with CutMix + NoAlign and with CutMix + TL-Align.

    The model, batch, mixer and adapters are ``TrainingSteps``' (what ``speed.py`` and the GPU suite time);
    one CutMix sample, drawn from its generator, serves both variants.
    """
    steps, mixed, label_map = _mixed_sample(model_name, batch_size)
    row: dict[str, Any] = {"model": model_name}
    for name in VARIANTS:
        for _ in range(WARMUP_STEPS):  # on the counted routes: their caches filled, as a GPU's after its first steps
            with launch_routes():
                steps.loss(name, mixed, label_map).backward()  # type: ignore[no-untyped-call]
            steps.model.zero_grad(set_to_none=True)
        with launch_routes(), OpCounter() as counter:  # a GPU's routes: what it would launch (see launch_routes)
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


def count_compiled_step(model_name: str, batch_size: int = 2, steps: int = 2) -> dict[str, Any]:
    """Generated kernels and extern calls of one compiled forward + loss + backward (inductor, on the CPU): CutMix +
    NoAlign, and CutMix + TL-Align with each compiled label conv route, on one CutMix sample."""
    setup, mixed, label_map = _mixed_sample(model_name, batch_size)
    row: dict[str, Any] = {"model": model_name}
    for name in COMPILED:
        variant, _, route = name.partition("/")
        torch._dynamo.reset()  # each variant traced afresh: the route is read while tracing
        compiled = torch.compile(setup.adapted[variant])

        def run() -> None:
            setup.loss(variant, mixed, label_map, compiled).backward()  # type: ignore[no-untyped-call]
            setup.model.zero_grad(set_to_none=True)

        # a GPU's routes (``launch_routes``), and the calls inside too: the routes are read while tracing, and guarded
        with launch_routes(), compiled_label_convs("shifted" if route == "shifted" else "conv"):
            run()  # compiles forward and backward
            with torch.compiler.set_stance("fail_on_recompile"):  # a trace would be counted as calls: refuse it
                row[name] = count_compiled_calls(run, steps)
    base = row["cutmix"]["launches"]
    row["ratios"] = {name: row[name]["launches"] / base for name in COMPILED[1:]}
    return row


def _per_family(
    args: argparse.Namespace, names: Sequence[str], kind: str, measure: Callable[[str], dict[str, Any]],
    said: Callable[[dict[str, Any]], str], example: bool = False,
) -> dict[str, Any]:
    """Each family of ``names`` in turn: ``measure`` of its model (the registry's tiny one with ``example``), a line
    ``said`` of its row, and the JSON (``op_count.json``, ``op_count_<kind>.json`` for a ``kind`` of run, marked in
    it) written again after each, so that a stopped run keeps what it measured."""
    models = _families.family_models()
    path = args.out / (f"op_count_{kind}.json" if kind else "op_count.json")
    result: dict[str, Any] = {"provenance": provenance(), **({kind: True} if kind else {}), "batch_size": args.batch_size,
                              "families": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for family in names:
        row = measure(f"example:{family}" if example else models[family])
        result["families"][family] = row
        print(f"{family:20s} {row['model']:30s} {said(row)}", flush=True)
        path.write_text(json.dumps(result, indent=1))
    result["provenance"] = finish(result["provenance"])
    path.write_text(json.dumps(result, indent=1))
    return result


def _said_eager(row: dict[str, Any]) -> str:
    return (f"{row['cutmix']:6d} -> {row['tlalign']:6d} ops ({row['ratio']:.3f}x), {row['cutmix_kernels']} -> "
            f"{row['tlalign_kernels']} computing ({row['kernel_ratio']:.3f}x)  "
            f"added: {', '.join(f'{op} {n}' for op, n in row['top_added'])}")


def _said_compiled(row: dict[str, Any]) -> str:
    return "launches a step: " + ", ".join(
        f"{name} {row[name]['launches']:.0f} ({row[name]['kernels']:.0f} generated)" for name in COMPILED)


def _said_whole(row: dict[str, Any]) -> str:
    said = row.get("error") or (f"{row['graphs']} graph(s), {row['graph_breaks']} break(s), compiled - eager: "
                                + ", ".join(f"{k} {row[k]:.1e}" for k in ("target", "logits", "loss", "grad")))
    return f"{'whole' if row['whole'] else 'NOT WHOLE'}: {said}"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--families", nargs="*", default=None, help="default: every aligning family")
    p.add_argument("--mixers", nargs="*", default=None,
                   help="count the mixers instead (names containing one of these; none: all) against timm's Mixup")
    p.add_argument("--batch-size", type=int, default=None, help="default: 2 (families), 128 (mixers)")
    p.add_argument("--size", type=int, default=224, help="mixers: image side in pixels")
    p.add_argument("--patch", type=int, default=16, help="mixers: cell (token) side in pixels; 4 lets --size 32 hold BEiT's blocks")
    p.add_argument("--example", action="store_true", help="the registry's tiny 32 px models instead of benchmarks/_families.py's")
    p.add_argument("--compiled", action="store_true",
                   help="compiled steps (inductor, CPU): generated kernels and extern calls; --families default: "
                        + " ".join(COMPILED_FAMILIES))
    p.add_argument("--whole", action="store_true",
                   help="whether each family's TL-Align step compiles whole (fullgraph, aot_eager on the CPU) and equals "
                        "eager; --families default: every aligning family")
    p.add_argument("--out", type=Path, default=Path("runs/op_count"))
    args = p.parse_args(argv)
    if args.whole and args.compiled:
        p.error("--whole and --compiled are two runs: give one")
    if args.mixers is not None:
        return _count_mixers(args)
    args.batch_size = args.batch_size or 2
    models = _families.family_models()
    names = args.families or list(COMPILED_FAMILIES if args.compiled else models)
    unknown = [n for n in names if n not in models]
    if unknown:
        raise SystemExit(f"--families: no such family {unknown}; choose from {', '.join(models)}")
    if args.compiled:  # the families' own models (``--example`` not read)
        return _per_family(args, names, "compiled", lambda m: count_compiled_step(m, args.batch_size), _said_compiled)
    if args.whole:
        return _per_family(args, names, "whole", lambda m: compiles_whole(m, args.batch_size), _said_whole, args.example)
    return _per_family(args, names, "", lambda m: count_step(m, args.batch_size), _said_eager, args.example)


def _count_mixers(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks._mixer_ops import count_mixers, format_mixers

    rows = count_mixers(args.batch_size or 128, args.size, patch=args.patch, names=args.mixers)
    print(format_mixers(rows), flush=True)
    mixers: dict[str, Any] = {"provenance": finish(provenance()), "batch_size": args.batch_size or 128, "size": args.size, "mixers": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "op_count_mixers.json").write_text(json.dumps(mixers, indent=1))
    return mixers


if __name__ == "__main__":
    main()
