"""Operators a mixer call dispatches, on the CPU and on the path a CUDA batch takes (``op_count --mixers``).

Every mixer of ``speed.py``'s list (ours, timm's ``Mixup``)
called once on a 128 x 3 x 224 x 224 batch, counted twice in one run: on the CPU (every operator,
views apart), and on the path a CUDA batch takes, replayed on fake CUDA tensors (no GPU needed):
the kernels it would launch, the operators left on the host, the host-to-device copies and the
host syncs (a value read back: ``.item()``, ``.tolist()``, ``bool()``, ``nonzero``), each with
the line that asks for it.

"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._op_counter import OpCounter

__all__ = ["DeviceOpCounter", "count_mixers", "format_mixers"]


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
        self.host_files: Counter[str] = Counter()  # host operators by the file asking for them (sampling or applying)

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
            if not view:
                self.host_files[self._where().split(":")[0]] += 1
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
        "cuda_host_files": dict(counter.host_files),
        "cuda_ops": dict(counter.kernels),
        "cuda_error": error,
    }


def count_mixers(
    batch_size: int = 128, size: int = 224, num_classes: int = 1000, patch: int = 16, names: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Operators of one call of every mixer (``speed.mixer_candidates``; ours and timm's ``Mixup``), on the CPU
    and on the CUDA path (``DeviceOpCounter``), with the ratios to the timm reference ``speed.measure_mixers``
    compares it with."""
    from benchmarks._mixer_timing import mixer_candidates, reference_of, select_mixers

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
    """``count_mixers``' rows as a Markdown table; after it, where the CUDA path's host operators come from (said once
    for the mixers that share the same files) and each mixer's sync sites."""
    lines = ["| mixer | CPU ops | CPU computing | / timm | CUDA kernels | / timm | host ops | H2D copies | syncs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['cpu_ops']} | {r['cpu_kernels']} | {r['cpu_kernel_ratio']:.2f} | {r['cuda_kernels']} | "
                     f"{r['cuda_kernel_ratio']:.2f} | {r['cuda_host_ops']} | {r['cuda_h2d']} | {r['cuda_syncs']} |")
    ours = {name for name in rows if name.startswith("ours")}
    by_files: dict[str, list[str]] = {}
    for name, r in rows.items():
        if r["cuda_host_files"]:
            by_files.setdefault(", ".join(f"{f} {n}" for f, n in sorted(r["cuda_host_files"].items())), []).append(name)
    lines += [""] if by_files or any(r["cuda_sync_sites"] or r["cuda_error"] for r in rows.values()) else []
    lines += [f"Host operators on the CUDA path: {files} ({'every one of ours' if set(names) == ours else ', '.join(names)})."
              for files, names in by_files.items()]
    for name, r in rows.items():
        if r["cuda_sync_sites"] or r["cuda_error"]:
            lines.append(f"{name}: syncs {r['cuda_sync_sites']}" + (f"; stopped: {r['cuda_error']}" if r["cuda_error"] else ""))
    return "\n".join(lines)
