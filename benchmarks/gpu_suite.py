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
3. ``mixers``: every mixer at batch 128 x 224 px against timm's ``Mixup`` on the same device.
4. ``tests``: the GPU-only tests (``pytest -m 'not slow'`` over the CUDA test files).
5. ``families``: every aligning family's small model (``benchmarks/speed.py``'s list) at batch
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
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks._provenance import finish, provenance

PARTS = ("routes", "deit", "mixers", "tests", "families")
CUDA_TESTS = ("tests/test_attention.py", "tests/test_backbones_cuda.py", "tests/test_compile_cuda.py")


class Deadline:
    """Seconds left of the suite's budget; a part asks before each unit of work."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class OutOfTime(Exception):
    """The suite's deadline came before a unit of work could start."""


def timed_rounds(
    calls: dict[str, Callable[[], object]], rounds: int, steps: int, warmup: int, device: torch.device,
    deadline: Deadline, log: Callable[[str], None],
) -> dict[str, list[float]]:
    """Milliseconds per call of every entry in each round: rounds rotate the order, each entry runs
    ``steps`` calls back to back between two CUDA events (a host clock and a sync on the CPU)."""
    cuda = device.type == "cuda"
    for name, call in calls.items():
        for _ in range(warmup):
            call()
    if cuda:
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        if deadline.left() < 0:
            raise OutOfTime(f"after {r} of {rounds} rounds")
        for name in order:
            if cuda:
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                for _ in range(steps):
                    calls[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / steps)
            else:
                t0 = time.perf_counter()
                for _ in range(steps):
                    calls[name]()
                times[name].append(1000 * (time.perf_counter() - t0) / steps)
        order = order[1:] + order[:1]
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f} ms" for n in calls))
    return times


def summarise(times: dict[str, list[float]], baseline: str | None) -> dict[str, Any]:
    """Median and range of each entry's ms, and its paired per-round ratio to ``baseline``."""
    out: dict[str, Any] = {}
    for name, ts in times.items():
        row: dict[str, Any] = {"ms_median": statistics.median(ts), "ms_min": min(ts), "ms_max": max(ts), "ms_per_round": ts}
        if baseline is not None and baseline in times:
            ratios = [t / b for t, b in zip(ts, times[baseline])]
            row.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        out[name] = row
    return out


# --------------------------------------------------------------------------- 1. routes


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
        times = timed_rounds(calls, args.rounds, args.steps, args.warmup, device, deadline, log)
        result[shape_name] = summarise(times, "plain SDPA (no labels)")
    return result


# --------------------------------------------------------------------------- 2. DeiT-S, 5. families


class Steps:
    """Training steps of one model by several variants (the adapters share its parameters)."""

    def __init__(self, model_name: str, args: argparse.Namespace) -> None:
        import mixlabels
        from mixlabels.backbones import adapt
        from mixlabels.strategies import CutMix

        from benchmarks.speed import build_model, token_stride

        torch.manual_seed(0)
        self.device = torch.device(args.device)
        num_classes = 10 if model_name.startswith("example:") else args.num_classes
        model, size = build_model(model_name, num_classes)
        self.model = model.to(self.device).train()
        gen = torch.Generator().manual_seed(0)
        self.images = torch.randn(args.batch_size, 3, size, size, generator=gen).to(self.device)
        self.labels = torch.randint(0, num_classes, (args.batch_size,), generator=gen).to(self.device)
        self.mixer = CutMix(num_classes=num_classes, label_smoothing=0.1, patch_size=token_stride(model))
        self.schemes: dict[str, Any] = {"cutmix": mixlabels.NoAlign(), "tlalign": mixlabels.TLAlign()}
        self.adapted = {name: adapt(self.model, scheme) for name, scheme in self.schemes.items()}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.05)
        self.amp = self.device.type == "cuda"

    def call(self, variant: str, route: Any = None, compiled: Any = None) -> Callable[[], None]:
        """One full training step (mix, forward, loss, backward, AdamW) of ``variant``: ``none`` (no
        mixing), ``cutmix`` or ``tlalign``; by an attention ``route``; through ``compiled`` (the adapter)."""
        from mixlabels.backbones._attention import attention_route

        def step() -> None:
            with (attention_route(route) if route else contextlib.nullcontext()), \
                    torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):  # fmt: skip
                if variant == "none":
                    loss = F.cross_entropy(self.model(self.images), self.labels, label_smoothing=0.1)
                else:
                    mixed, label_map = self.mixer(self.images, self.labels)
                    model = compiled if compiled is not None else self.adapted[variant]
                    loss = model(mixed, label_map).loss()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            self.opt.step()

        return step

    def peak_mb(self, step: Callable[[], None]) -> float:
        """Peak allocated memory of one more step (CUDA), 0 on the CPU."""
        if self.device.type != "cuda":
            return 0.0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20


@contextlib.contextmanager
def dynamo_stats() -> Iterator[dict[str, int]]:
    """Graphs and graph breaks dynamo made inside the block (its counters, read at exit)."""
    from torch._dynamo.utils import counters

    counters.clear()
    stats: dict[str, int] = {}
    yield stats
    stats["graphs"] = int(counters["stats"]["unique_graphs"])
    stats["graph_breaks"] = int(sum(counters["graph_break"].values()))


def timed_with_memory(
    steps: Steps, calls: dict[str, Callable[[], None]], args: argparse.Namespace, deadline: Deadline,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """``calls`` timed side by side (ratios to ``cutmix``), each row with its peak memory and the ratio of that."""
    summary = summarise(timed_rounds(dict(calls), args.rounds, args.steps, args.warmup, steps.device, deadline, log), "cutmix")
    for name, row in summary.items():
        row["peak_mb"] = steps.peak_mb(calls[name])
    base = summary["cutmix"]["peak_mb"]
    for row in summary.values():
        row["memory_ratio"] = row["peak_mb"] / base if base else float("nan")
    return summary


def compiled_pair(
    steps: Steps, args: argparse.Namespace, deadline: Deadline, log: Callable[[str], None], routes: Sequence[str] = (),
) -> dict[str, Any]:
    """CutMix + NoAlign and CutMix + TL-Align (the device's route, then each of ``routes``), each adapter
    compiled, timed side by side. A variant that fails to compile is recorded, the others are timed."""
    calls: dict[str, Callable[[], None]] = {}
    info: dict[str, Any] = {}
    for name in ("cutmix", "tlalign", *(f"tlalign/{r}" for r in routes)):
        variant, _, route = name.partition("/")
        if deadline.left() < 0:
            raise OutOfTime("while compiling")
        torch._dynamo.reset()
        compiled = torch.compile(steps.adapted[variant])
        t0 = time.perf_counter()
        try:
            with dynamo_stats() as stats:
                step = steps.call(variant, route or None, compiled=compiled)
                step()
                step()  # a second step: a recompile would show here
        except Exception as err:
            info[name] = {"error": f"{type(err).__name__}: {str(err)[:1500]}"}
            log(f"  compiled {name}: {info[name]['error'][:300]}")
            continue
        info[name] = {"compile_s": time.perf_counter() - t0, **stats}
        log(f"  compiled {name}: {info[name]}")
        calls[name] = step
    if "cutmix" not in calls:
        return info
    timed = timed_with_memory(steps, calls, args, deadline, log)
    return {**info, **{name: {**info[name], **row} for name, row in timed.items()}}


def eager_pair(steps: Steps, args: argparse.Namespace, deadline: Deadline, log: Callable[[str], None]) -> dict[str, Any]:
    """CutMix + NoAlign and CutMix + TL-Align (the device's route), eager, side by side."""
    return timed_with_memory(steps, {"cutmix": steps.call("cutmix"), "tlalign": steps.call("tlalign")}, args, deadline, log)


def measure_deit(args: argparse.Namespace, deadline: Deadline, log: Callable[[str], None], save: Callable[[], None],
                 into: dict[str, Any]) -> None:
    from mixlabels.backbones._attention import ROUTES

    steps = Steps(args.deit_model, args)
    if args.deit_compiled_only:
        into["compiled"] = compiled_pair(steps, args, deadline, log, routes=args.compiled_routes)
        return
    calls = {"none": steps.call("none"), "cutmix": steps.call("cutmix")}
    for route in ROUTES:
        calls[f"tlalign/{route}"] = steps.call("tlalign", route)
    log(f"deit eager: {args.deit_model} batch {args.batch_size}")
    into["eager"] = timed_with_memory(steps, calls, args, deadline, log)
    save()
    log("deit compiled")
    into["compiled"] = compiled_pair(steps, args, deadline, log, routes=args.compiled_routes)


def measure_families(args: argparse.Namespace, deadline: Deadline, log: Callable[[str], None], save: Callable[[], None],
                     into: dict[str, Any]) -> None:
    from benchmarks.speed import FAMILY_MODELS

    names = args.families or list(FAMILY_MODELS)
    for family in names:
        if deadline.left() < args.family_min_s:
            into[family] = {"skipped": f"deadline: {deadline.left():.0f} s left, a family needs {args.family_min_s:.0f}"}
            continue
        model = f"example:{family}" if args.dry_run else FAMILY_MODELS[family]
        log(f"family {family}: {model}")
        try:
            pair = compiled_pair if args.family_mode == "compiled" else eager_pair
            into[family] = {"model": model, "mode": args.family_mode, **pair(Steps(model, args), args, deadline, log)}
        except OutOfTime as err:
            into[family] = {"model": model, "skipped": f"deadline: {err}"}
        except Exception as err:  # one family's failure must not lose the others' figures
            into[family] = {"model": model, "error": f"{type(err).__name__}: {str(err)[:2000]}"}
        save()


# --------------------------------------------------------------------------- 3. mixers, 4. tests


def measure_mixers(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from benchmarks.speed import measure_mixers as speed_mixers

    mixer_args = argparse.Namespace(
        device=args.device, mixer_batch=args.batch_size, mixer_size=64 if args.dry_run else 224, mixer_patch=16,
        num_classes=args.num_classes, mixers=None, mixer_repeats=args.rounds, mixer_calls=args.steps,
    )
    return speed_mixers(mixer_args, log)


def run_tests(args: argparse.Namespace, deadline: Deadline, out: Path) -> dict[str, Any]:
    files = [f for f in CUDA_TESTS if Path(f).exists()]
    workers = ["-n", str(args.test_workers)] if args.test_workers > 1 else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *workers, *files]
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
    last = [line for line in str(text).splitlines() if line.strip()][-1:] or [""]
    return {"command": " ".join(cmd[1:]), "returncode": code, "summary": last[0]}


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
    p.add_argument("--families", nargs="*", default=None, help="families to measure (default: all, speed.py's order)")
    p.add_argument("--family-min-s", type=float, default=40.0, help="start a family only with this much time left")
    p.add_argument("--family-mode", choices=["compiled", "eager"], default="compiled")
    p.add_argument("--deit-compiled-only", action="store_true", help="DeiT-S: the compiled pair alone (no eager table)")
    p.add_argument("--compiled-routes", nargs="*", default=[], help="DeiT-S compiled: TL-Align by these routes too")
    p.add_argument("--test-workers", type=int, default=8)
    p.add_argument("--test-budget-s", type=float, default=150.0)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes and the registry's 32 px models: try every part anywhere")
    args = p.parse_args(argv)
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
    from benchmarks.gpu_report import summary_table

    print(summary_table(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
