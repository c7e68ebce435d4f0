"""The GPU suite: everything a lent GPU should measure, in one call that ends on its own deadline.

GPU time is scarce (minutes at a time, and not always), so this one command runs the parts in
order of how much they decide, writes its JSON after every part (a part cut short by the
deadline or an error is recorded as such, the parts before it are kept), and prints a short
table last:

1. ``routes``: the attention-with-labels routes (``backbones._attention.ROUTES``) against plain
   SDPA, forward + backward, CUDA events, at DeiT-S's and a Swin window's shapes.
2. ``deit``: DeiT-S at batch 128 (bf16 autocast, the paper's Table 2 setting): no mixing,
   CutMix + NoAlign, CutMix + TL-Align by every route, eager; then CutMix + NoAlign and
   CutMix + TL-Align compiled (``torch.compile`` of the adapted model, as timm's
   ``--torchcompile`` does), each against its own baseline, with the graphs and breaks dynamo saw.
   Both modes time timm's own step beside them (``timm-cutmix``: timm's ``Mixup`` doing CutMix, the
   bare model, eager or compiled): what our mixer and adapter cost in a step, not in a call alone.
3. ``mixers``: every mixer at batch 128 x 224 px against timm's ``Mixup`` on the same device.
4. ``tests``: the GPU-only tests (``pytest -m 'not slow'`` over the CUDA test files).
5. ``families``: every aligning family's small model (``benchmarks/_families.py``'s list) at batch
   128, CutMix + NoAlign against CutMix + TL-Align, compiled, as long as the deadline allows.

Every step figure is the median over ``--rounds`` interleaved rounds of ``--steps`` steps after
warm-up, timed by CUDA events (host clock on the CPU), with the spread of the paired per-round
ratios. ``benchmarks/gpu_report.py`` turns the JSON into RESULTS' GPU section.

Usage::

    python benchmarks/gpu_suite.py --out runs/gpu                 # on a GPU: the whole suite
    python benchmarks/gpu_suite.py --device cpu --dry-run          # any machine: every part, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks import _families
from benchmarks._gpu_steps import Steps, compiled_pair, eager_pair, timed_with_memory
from benchmarks._gpu_timing import Deadline, OutOfTime, summarise, timed_rounds, working_calls
from benchmarks._mixer_timing import PROFILED
from benchmarks._mixer_timing import measure_mixers as time_mixers
from benchmarks._provenance import finish, provenance
from benchmarks._training_step import timm_step_refusal
from benchmarks.gpu_report import family_measured, outcomes_of, summary_table

PARTS = ("routes", "deit", "mixers", "tests", "families")
CUDA_TESTS = ("tests/test_attention.py", "tests/test_backbones_cuda.py", "tests/test_compile_cuda.py", "tests/test_strategies_cuda.py")


# --------------------------------------------------------------------------- 1. routes


def _route_shape(text: str) -> tuple[int, int, int, int, bool]:
    """``--route-shapes``' ``BxHxNxD`` (a trailing ``m``: with a mask) as ``(b, h, n, d, masked)``."""
    masked = text.endswith("m")
    parts = text.removesuffix("m").split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is no attention shape: give batch x heads x tokens x head dim as positive integers joined by "
            "'x', with a trailing 'm' for a mask (e.g. 32x4x256x16 or 512x3x49x32m)")
    b, h, n, d = (int(p) for p in parts)
    return b, h, n, d, masked


def measure_routes(args: argparse.Namespace, deadline: Deadline, log: Callable[[str], None]) -> dict[str, Any]:
    """Forward + backward of plain SDPA and of ``attention_with_labels`` by every route."""
    from mixlabels.backbones._attention import ROUTES, attention_route, attention_with_labels

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {  # name: (b, h, n, d, masked)
        "DeiT-S (128 x 6 heads x 197 tokens x 64)": (128, 6, 197, 64, False),
        "Swin-T stage 1 window (128*64 windows x 3 heads x 49 x 32, shift mask)": (128 * 64, 3, 49, 32, True),
    }
    if args.dry_run:
        shapes = {"tiny (2 x 3 x 17 x 16)": (2, 3, 17, 16, False), "tiny window (8 x 2 x 9 x 8, mask)": (8, 2, 9, 8, True)}
    if args.route_shapes:  # a model's own attention shapes (e.g. a CPU-sized batch): these instead
        shapes = {f"{b} x {h} heads x {n} tokens x {d}{', mask' if masked else ''}": (b, h, n, d, masked)
                  for b, h, n, d, masked in args.route_shapes}
    result: dict[str, Any] = {}
    for shape_name, (b, h, n, d, masked) in shapes.items():
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
        labels = torch.rand(b, n, 2, generator=gen).softmax(-1).to(device)
        mask = torch.randn(1, h, n, n, generator=gen).to(device, dtype) if masked else None
        grad = torch.randn(b, h, n, d, generator=gen).to(device, dtype)

        def plain() -> None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5)
            out.backward(grad)  # type: ignore[no-untyped-call]

        def routed(route: Any) -> Callable[[], None]:
            def call() -> None:
                with attention_route(route):
                    out, _ = attention_with_labels(q, k, v, labels, scale=d**-0.5, attn_mask=mask)
                out.backward(grad)  # type: ignore[no-untyped-call]

            return call

        calls: dict[str, Callable[[], object]] = {"plain SDPA (no labels)": plain, **{r: routed(r) for r in ROUTES}}
        log(f"routes: {shape_name}")
        calls, errors = working_calls(calls, log, keep="plain SDPA (no labels)")
        times = timed_rounds(calls, args.rounds, args.steps, args.warmup, device, deadline, log)
        result[shape_name] = summarise(times, "plain SDPA (no labels)")
        result[shape_name].update({name: {"error": why} for name, why in errors.items()})
    return result



# --------------------------------------------------------------------------- 2. DeiT-S, 5. families


def measure_deit(args: argparse.Namespace, deadline: Deadline, log: Callable[[str], None], save: Callable[[], None],
                 into: dict[str, Any]) -> None:
    from mixlabels.backbones._attention import ROUTES

    steps = Steps(args.deit_model, args)
    timm = args.timm_step and steps.timm_mixup is not None  # timm's own step beside ours
    if args.timm_step and not timm:
        log(f"deit: timm's step left out: {timm_step_refusal(args.batch_size)}")
    if args.deit_compiled_only:
        into["compiled"] = compiled_pair(steps, args, deadline, log, routes=args.compiled_routes, timm=timm)
        return
    calls = {"none": steps.call("none"), "cutmix": steps.call("cutmix"), **({"timm-cutmix": steps.call("timm-cutmix")} if timm else {})}
    for route in ROUTES:
        calls[f"tlalign/{route}"] = steps.call("tlalign", route)
    log(f"deit eager: {args.deit_model} batch {args.batch_size}")
    working, errors = working_calls(calls, log, keep="cutmix")
    into["eager"] = timed_with_memory(steps, working, args, deadline, log)
    into["eager"].update({name: {"error": why} for name, why in errors.items()})
    save()
    if args.deit_eager_only:
        return
    log("deit compiled")
    into["compiled"] = compiled_pair(steps, args, deadline, log, routes=args.compiled_routes, timm=timm)


def measure_families(args: argparse.Namespace, deadline: Deadline, log: Callable[[str], None], save: Callable[[], None],
                     into: dict[str, Any]) -> None:
    models = _families.family_models()
    names = args.families or list(models)
    if args.unmeasured_first:
        measured = measured_families(SUMMARY, args.family_mode)
        names = [n for n in names if n not in measured] + [n for n in names if n in measured]
        log(f"families, unmeasured first ({len(measured)} measured {args.family_mode} in {SUMMARY.name}): {' '.join(names)}")
    for family in names:
        if deadline.left() < args.family_min_s:
            into[family] = {"skipped": f"deadline: {deadline.left():.0f} s left, a family needs {args.family_min_s:.0f}"}
            continue
        model = f"example:{family}" if args.dry_run else models[family]
        log(f"family {family}: {model}")
        try:
            steps = Steps(model, args)
            timed = (compiled_pair(steps, args, deadline, log, routes=args.family_routes) if args.family_mode == "compiled"
                     else eager_pair(steps, args, deadline, log, routes=args.family_routes))
            into[family] = {"model": model, "mode": args.family_mode, **timed}
        except OutOfTime as err:
            into[family] = {"model": model, "skipped": f"deadline: {err}"}
        except Exception as err:  # one family's failure must not lose the others' figures
            into[family] = {"model": model, "error": f"{type(err).__name__}: {str(err)[:2000]}"}
        save()


SUMMARY = Path(__file__).resolve().parent / "results" / "gpu-suite.json"
"""The committed summary of the GPU runs so far (``benchmarks.report --add-gpu-suite``)."""


def measured_families(summary: Path, mode: str) -> set[str]:
    """The families with a measured row in ``mode`` (compiled or eager) in the GPU suite summary at ``summary``."""
    if not summary.is_file():
        return set()
    families = json.loads(summary.read_text()).get("parts", {}).get("families", {})
    return {family for family, row in families.items() if family_measured(row) and row.get("mode", "compiled") == mode}


# --------------------------------------------------------------------------- 3. mixers, 4. tests


DRY_RUN_MIXER_SIZE = 128  # BlockwiseMix's 16 cells of 16 px need an 8x8 grid


def measure_mixers(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    mixer_args = argparse.Namespace(
        device=args.device, mixer_batch=args.batch_size, mixer_size=DRY_RUN_MIXER_SIZE if args.dry_run else 224, mixer_patch=16,
        num_classes=args.num_classes, mixers=None, mixer_repeats=args.rounds, mixer_calls=args.steps,
        profile_mixers=PROFILED if args.profile else (),
    )
    return time_mixers(mixer_args, log)


def run_tests(args: argparse.Namespace, deadline: Deadline, out: Path) -> dict[str, Any]:
    files = [f for f in CUDA_TESTS if Path(f).exists()]
    workers = ["-n", str(args.test_workers)] if args.test_workers > 1 else []
    # -v: each test's outcome is printed as it ends, so a run cut off by the budget still names its failures
    cmd = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=", *workers, *files]
    if args.dry_run:
        cmd += ["-k", "every_route"]
    budget = max(10.0, min(args.test_budget_s, deadline.left()))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        text, code = f"{partial}\nTIMED OUT after {budget:.0f} s", -1
    (out / "gpu_tests.log").write_text(text if isinstance(text, str) else text.decode())
    return {"command": " ".join(cmd[1:]), "returncode": code, **outcomes_of(str(text))}


# --------------------------------------------------------------------------- the suite


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("runs/gpu"))
    p.add_argument("--budget-s", type=float, default=480.0, help="the suite stops starting work after this many seconds")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per figure")
    p.add_argument("--steps", type=int, default=20, help="steps (or calls) per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--deit-model", default="deit_small_patch16_224")
    p.add_argument("--families", nargs="*", default=None,
                   help="families to measure (default: all, in benchmarks/_families.py's order)")
    p.add_argument("--unmeasured-first", action="store_true",
                   help="families: those without a measured row of this --family-mode in benchmarks/results/gpu-suite.json "
                   "first (of --families, or of all), so that each lent GPU's minutes add families the summary lacks")
    p.add_argument("--family-min-s", type=float, default=40.0, help="start a family only with this much time left")
    p.add_argument("--family-mode", choices=["compiled", "eager"], default="compiled")
    p.add_argument("--profile", action="store_true",
                   help="families and DeiT-S: after timing, profile each variant's step (kernel time, launches, top kernels) "
                   "and account for its memory (what one more step adds at its peak, and the lines holding it there); "
                   "mixers: the same for a call of batch-mode CutMix and MixUp, ours and timm's")
    p.add_argument("--compile-mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"], default=None,
                   help="torch.compile's mode for every compiled step (default: timm's --torchcompile, no mode; "
                   "reduce-overhead replays CUDA graphs, which take the host's launch time off a step)")
    deit_mode = p.add_mutually_exclusive_group()
    deit_mode.add_argument("--deit-compiled-only", action="store_true", help="DeiT-S: the compiled pair alone (no eager table)")
    deit_mode.add_argument("--deit-eager-only", action="store_true", help="DeiT-S: the eager table alone (no compiles)")
    p.add_argument("--compiled-routes", nargs="*", default=[], help="DeiT-S compiled: TL-Align by these routes too")
    p.add_argument("--timm-step", action=argparse.BooleanOptionalAction, default=True,
                   help="DeiT-S: time timm's own step (timm-cutmix) beside ours in each mode; compiled, it is one more "
                   "compile (about 30 s on an H100)")
    p.add_argument("--family-routes", nargs="*", default=[],
                   help="families: TL-Align by these routes too; compiled, e.g. label-convs=conv (the label convs as "
                   "convolutions, against the default shifted sums: backbones.compiled_label_convs); eager, e.g. "
                   "joins=walk (a conv net's joins branch by branch, against the default fused joins: backbones._joins), "
                   "matrices=cpu (label matrices up to 8x8 grids, not 14x14: backbones._common.launch_matrices), "
                   "residuals=lerp (residuals not folded into the branch's matrices: backbones._convnet.folded_residuals), "
                   "plans=off (label conv groups' tap weights and matrices built grid by grid: backbones._grid_plan.grid_plans)")
    p.add_argument("--route-shapes", nargs="+", type=_route_shape, default=[], metavar="BxHxNxD[m]",
                   help="routes: time these attention shapes (batch x heads x tokens x head dim; a trailing m adds a "
                   "mask) instead of DeiT-S's and a Swin window's, e.g. 32x4x256x16 (MobileViT-XXS at batch 8)")
    p.add_argument("--test-workers", type=int, default=16)
    p.add_argument("--test-budget-s", type=float, default=150.0)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes and the registry's 32 px models: try every part anywhere")
    args = p.parse_args(argv)
    unknown = [f for f in args.families or [] if f not in _families.family_models()]
    if unknown:
        p.error(f"--families: no aligning family is named {', '.join(unknown)}; "
                f"the families are {' '.join(_families.family_models())}")
    if args.dry_run:
        args.batch_size, args.num_classes, args.rounds, args.steps, args.warmup = 4, 10, 2, 2, 1
        args.deit_model, args.family_min_s = "example:vit", 0.0
        args.families = args.families or ["vit", "resnet"]
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = Deadline(args.budget_s)
    path = args.out / "gpu_suite.json"
    result: dict[str, Any] = {
        "provenance": provenance(None if argv is None else ["python", "benchmarks/gpu_suite.py", *argv], device=args.device),
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU",
        "torch": torch.__version__, "batch_size": args.batch_size, "rounds": args.rounds, "steps": args.steps,
        "dry_run": bool(args.dry_run),  # tiny stand-ins: ``benchmarks.report`` refuses to put them in RESULTS
        "parts": {},
    }

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} {deadline.left():5.0f}s left] {msg}", flush=True)

    def save() -> None:
        path.write_text(json.dumps(result, indent=1, default=str))

    for part in args.parts:
        slot: dict[str, Any] = {}
        result["parts"][part] = slot
        if deadline.left() < 0:
            slot["skipped"] = "deadline"
            continue
        t0 = time.perf_counter()
        try:
            if part == "routes":
                slot.update(measure_routes(args, deadline, log))
            elif part == "deit":
                measure_deit(args, deadline, log, save, slot)
            elif part == "mixers":
                slot.update(measure_mixers(args, log))
            elif part == "tests":
                slot.update(run_tests(args, deadline, args.out))
            else:
                measure_families(args, deadline, log, save, slot)
        except OutOfTime as err:
            slot["skipped"] = f"deadline: {err}"
        except Exception as err:  # record it, keep the other parts
            slot["error"] = f"{type(err).__name__}: {str(err)[:2000]}"
            log(f"{part}: {slot['error'][:300]}")
        slot["seconds"] = time.perf_counter() - t0
        save()
        log(f"{part} done in {slot['seconds']:.0f} s")
    result["provenance"] = finish(result["provenance"])
    save()
    print(summary_table(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
