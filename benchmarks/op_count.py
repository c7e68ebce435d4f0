"""Operators one training step dispatches: CutMix + TL-Align against CutMix + NoAlign, per family.

Timings on shared CPUs are noisy and GPUs are scarce; the number of ATen operators a step
dispatches is exact on any machine, and in eager mode on a GPU each one is (at least) a kernel
launch: what the label path's many small operations cost there. A dispatch mode counts every
operator the step runs below autograd (forward, loss and backward; the mixer and the optimizer
are the same on both sides and left out), on the CPU, at batch 2 and each model's default size.

With ``--mixers``, the mixers instead: every mixer of ``speed.py``'s list (ours, timm's ``Mixup``)
called once on a 128 x 3 x 224 x 224 batch, counted twice in one run: on the CPU (every operator,
views apart), and on the path a CUDA batch takes, replayed on fake CUDA tensors (no GPU needed):
the kernels it would launch, the operators left on the host, the host-to-device copies and the
host syncs (a value read back: ``.item()``, ``.tolist()``, ``bool()``, ``nonzero``), each with
the line that asks for it.

Usage::

    python benchmarks/op_count.py                       # every family's small model (speed.py's list)
    python benchmarks/op_count.py --families vit resnet --out runs/op_count
    python -m benchmarks.op_count --mixers              # every mixer against timm's Mixup
    python -m benchmarks.op_count --mixers CutMix MixUp --batch-size 128
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._provenance import finish, provenance

__all__ = ["OpCounter", "DeviceOpCounter", "count_step", "count_mixers", "main"]


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


class DeviceOpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # as OpCounter
    """What a call would ask of a CUDA device, run under a ``FakeTensorMode`` entered before it.

    Operators touching a fake (device) tensor or asking for a CUDA one are ``kernels`` (views
    apart) and run fake; the others run for real on the host (``host``: CPU time, no launch). A
    host copy turned into a device tensor is an ``h2d`` copy. A value read back from the device
    (``_local_scalar_dense``: ``.item()``, ``bool()``, ``int()``, ``.tolist()``; ``nonzero``; a
    device-to-host copy) is a ``sync``, recorded with the line asking for it; it gets a stand-in
    (0, no rows) so that the count goes on, and what follows it is then only indicative.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kernels: Counter[str] = Counter()
        self.host: Counter[str] = Counter()
        self.h2d: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()

    @staticmethod
    def _where() -> str:
        """The innermost line of the library or of timm that dispatched the operator."""
        for frame in reversed(traceback.extract_stack()[:-3]):
            if any(part in frame.filename for part in ("/mixlabels/", "/strategies/", "/timm/")):
                return f"{Path(frame.filename).name}:{frame.lineno}"
        return "?"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
        from torch.utils._pytree import tree_leaves

        kwargs = dict(kwargs or {})
        name = func.overloadpacket.__name__
        leaves = tree_leaves((args, kwargs))
        fake = any(isinstance(a, FakeTensor) for a in leaves)
        to_device = any(isinstance(a, torch.device) and a.type == "cuda" for a in leaves)
        view = getattr(func, "is_view", False) or name == "device"
        if not (fake or to_device):  # host work, for real (pinned memory needs no driver here)
            if name == "is_pinned":
                return False
            if name == "_pin_memory":
                return args[0]
            kwargs.pop("pin_memory", None)
            self.host[name] += not view
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        to_host = name == "_to_copy" and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"
        if name in ("_local_scalar_dense", "nonzero") or to_host:
            self.syncs[f"{name} {self._where()}"] += 1
            if name == "_local_scalar_dense":
                return False if args[0].dtype == torch.bool else 0
            if name == "nonzero":
                return args[0].new_empty((0, args[0].ndim), dtype=torch.long)
        if name in ("_to_copy", "copy_") and any(isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) for a in leaves):
            self.h2d[f"{name} {self._where()}"] += 1
        self.kernels[name] += not view
        return func(*args, **kwargs)


_META_LIBRARY: list[Any] = []


def _fake_dirichlet() -> None:
    """A shape-only kernel for ``_sample_dirichlet`` (Beta draws on the device), which fake tensors lack."""
    if not _META_LIBRARY:
        lib = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
        lib.impl(  # type: ignore[no-untyped-call]
            "_sample_dirichlet", lambda alpha, generator=None: torch.empty_like(alpha), "Meta"
        )
        _META_LIBRARY.append(lib)  # the registration lives as long as the library object


def _cuda_path(call: Callable[[torch.Tensor, torch.Tensor], Any], batch: int, size: int, num_classes: int) -> dict[str, Any]:
    """``DeviceOpCounter``'s figures for the second ``call`` on a fake CUDA batch (the first checks label values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _fake_dirichlet()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        x = torch.empty(batch, 3, size, size, device="cuda")
        y = torch.empty(batch, dtype=torch.long, device="cuda")
    for _ in range(2):
        torch.manual_seed(0)
        counter = DeviceOpCounter()
        try:
            with fake, counter:
                call(x, y)
            error = None
        except Exception as err:  # noqa: BLE001  # an operator fake tensors cannot run: say which
            error = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return {
        "cuda_kernels": sum(counter.kernels.values()),
        "cuda_host_ops": sum(counter.host.values()),
        "cuda_h2d": sum(counter.h2d.values()),
        "cuda_syncs": sum(counter.syncs.values()),
        "cuda_sync_sites": dict(counter.syncs),
        "cuda_h2d_sites": dict(counter.h2d),
        "cuda_ops": dict(counter.kernels),
        "cuda_error": error,
    }


def count_mixers(
    batch_size: int = 128, size: int = 224, num_classes: int = 1000, patch: int = 16, names: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Operators of one call of every mixer (``speed.mixer_candidates``; ours and timm's ``Mixup``), on the CPU
    and on the CUDA path (``DeviceOpCounter``), with the ratios to the timm reference ``speed.measure_mixers``
    compares it with."""
    from benchmarks.speed import mixer_candidates, reference_of, select_mixers

    candidates = {k: v for k, v in mixer_candidates(num_classes, patch).items() if k.startswith(("ours", "timm"))}
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch_size, 3, size, size, generator=gen)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen)
    rows: dict[str, dict[str, Any]] = {}
    for name in select_mixers(list(candidates), names):
        call = candidates[name]
        call(x, y)  # warm-up: the first call checks label values
        torch.manual_seed(0)  # the same draws on both paths (a block mask's draw loop runs as long as they say)
        with OpCounter() as counter:
            call(x, y)
        rows[name] = {"cpu_ops": sum(counter.ops.values()), "cpu_kernels": counter.kernels, **_cuda_path(call, batch_size, size, num_classes)}
    for name, row in rows.items():
        ref = rows[reference_of(name)]
        row["cpu_kernel_ratio"] = row["cpu_kernels"] / ref["cpu_kernels"]
        row["cuda_kernel_ratio"] = row["cuda_kernels"] / max(ref["cuda_kernels"], 1)
    return rows


def format_mixers(rows: dict[str, dict[str, Any]]) -> str:
    """``count_mixers``' rows as a Markdown table, the sync sites after it."""
    lines = ["| mixer | CPU ops | CPU computing | / timm | CUDA kernels | / timm | host ops | H2D copies | syncs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['cpu_ops']} | {r['cpu_kernels']} | {r['cpu_kernel_ratio']:.2f} | {r['cuda_kernels']} | "
                     f"{r['cuda_kernel_ratio']:.2f} | {r['cuda_host_ops']} | {r['cuda_h2d']} | {r['cuda_syncs']} |")
    for name, r in rows.items():
        if r["cuda_sync_sites"] or r["cuda_error"]:
            lines.append(f"- {name}: syncs {r['cuda_sync_sites']}" + (f"; stopped: {r['cuda_error']}" if r["cuda_error"] else ""))
    return "\n".join(lines)


def count_step(model_name: str, batch_size: int = 2) -> dict[str, Any]:
    """Operators of one forward + loss + backward with CutMix + NoAlign and with CutMix + TL-Align."""
    import mixlabels
    from mixlabels.backbones import adapt
    from mixlabels.strategies import CutMix

    from benchmarks.speed import build_model, token_stride

    torch.manual_seed(0)
    num_classes = 10 if model_name.startswith("example:") else 1000
    model, size = build_model(model_name, num_classes)
    model.train()
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, size, size, generator=gen)
    labels = torch.randint(0, num_classes, (batch_size,), generator=gen)
    mixer = CutMix(num_classes, label_smoothing=0.1, patch_size=token_stride(model))
    mixed, label_map = mixer.mix(images, labels, mixer.sample(images.shape, generator=gen))
    row: dict[str, Any] = {"model": model_name}
    for name, scheme in (("cutmix", mixlabels.NoAlign()), ("tlalign", mixlabels.TLAlign())):
        adapted = adapt(model, scheme)
        adapted(mixed, label_map).loss().backward()  # warm-up: caches (tap matrices, probes) filled
        model.zero_grad(set_to_none=True)
        with OpCounter() as counter:
            adapted(mixed, label_map).loss().backward()
        model.zero_grad(set_to_none=True)
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
    from benchmarks.speed import FAMILY_MODELS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--families", nargs="*", default=None, help="default: every aligning family")
    p.add_argument("--mixers", nargs="*", default=None,
                   help="count the mixers instead (names containing one of these; none: all) against timm's Mixup")
    p.add_argument("--batch-size", type=int, default=None, help="default: 2 (families), 128 (mixers)")
    p.add_argument("--size", type=int, default=224, help="mixers: image side in pixels")
    p.add_argument("--example", action="store_true", help="the registry's tiny 32 px models instead of speed.py's")
    p.add_argument("--out", type=Path, default=Path("runs/op_count"))
    args = p.parse_args(argv)
    if args.mixers is not None:
        rows = count_mixers(args.batch_size or 128, args.size, names=args.mixers)
        print(format_mixers(rows), flush=True)
        mixers: dict[str, Any] = {"provenance": finish(provenance()), "batch_size": args.batch_size or 128, "mixers": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "op_count_mixers.json").write_text(json.dumps(mixers, indent=1))
        return mixers
    args.batch_size = args.batch_size or 2
    names = args.families or list(FAMILY_MODELS)
    unknown = [n for n in names if n not in FAMILY_MODELS]
    if unknown:
        raise SystemExit(f"--families: no such family {unknown}; choose from {', '.join(FAMILY_MODELS)}")
    result: dict[str, Any] = {"provenance": provenance(), "batch_size": args.batch_size, "families": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for family in names:
        model = f"example:{family}" if args.example else FAMILY_MODELS[family]
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
