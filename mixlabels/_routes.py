"""Which device's routes the label path takes: the CPU's own (byte-saving, folded layouts, cheap reductions) or the
ones a GPU takes (fewest launches). ``launch_routes`` turns the CPU's off, so that ``benchmarks/op_count.py`` counts
on the CPU what a GPU would launch. In the core, not in ``backbones``, so that the trackers read the same switch as
every backbone module (``CompactTracker``'s readout)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["eager_cpu_routes", "eager_launch_routes", "launch_routes", "rounding_matmuls", "switched"]

_BYTE_ROUTES = [True]
"""Whether the CPU takes its own routes (the byte-saving ones, ``_byte_route``; folded label convs, ``fold_route``);
``launch_routes`` turns them off."""


@contextmanager
def launch_routes() -> Iterator[None]:
    """Inside, the label path takes the routes a GPU takes on every device: no CPU-only byte-saving route
    (``_byte_route``), none of ``eager_cpu_routes``' (folded label convs, the head mean's chained slices, CaiT's
    per-sample label products).
    ``benchmarks/op_count.py`` counts the operators so: what a GPU would launch, where the CPU trades launches it does
    not pay for against bytes it does."""
    before = _BYTE_ROUTES[0]
    _BYTE_ROUTES[0] = False
    try:
        yield
    finally:
        _BYTE_ROUTES[0] = before


def _byte_route(device: torch.device, elements: int, threshold: int) -> bool:
    """Whether weights of ``elements`` on ``device`` take the CPU's byte-saving route: the CPU pays per byte moved
    (fresh memory is page-faulted in every step) and little per operator, a GPU the other way round."""
    return device.type == "cpu" and elements >= threshold and _BYTE_ROUTES[0]


def eager_cpu_routes(device: torch.device) -> bool:
    """Whether the label path on ``device`` may take the CPU's own layouts and call patterns (``fold_route``,
    ``_attention._head_mean``, CaiT's ``talking_heads_label_mix``): the CPU, in eager mode (a compiled graph lays
    its tensors out as its compiler decides), outside ``launch_routes``."""
    return device.type == "cpu" and _BYTE_ROUTES[0] and not torch.compiler.is_compiling()


@contextmanager
def switched(flag: list[bool], on: bool) -> Iterator[None]:
    """Inside, the route switch ``flag`` (a one-element list a route reads) is ``on``; as it was after. The GPU's eager
    routes each have one (``fused_joins``, ``launch_matrices``, ``folded_residuals``), so that their fallbacks can be
    timed beside them."""
    before = flag[0]
    flag[0] = bool(on)
    try:
        yield
    finally:
        flag[0] = before


def eager_launch_routes(device: torch.device) -> bool:
    """Whether the label path on ``device`` runs eagerly where every operator is a launch: a GPU's eager route (the
    CPU's under ``launch_routes``), neither the CPU's eager route (whose bits the targets digest holds) nor a compiled
    graph (whose compiler fuses what the launch routes batch)."""
    return not eager_cpu_routes(device) and not torch.compiler.is_compiling()


def rounding_matmuls(device: torch.device) -> bool:
    """Whether an fp32 matmul on ``device`` may round its inputs under the caller's precision settings: TF32 on a GPU
    (``torch.backends.cuda.matmul.allow_tf32 = True``, as many training scripts set, or
    ``torch.set_float32_matmul_precision("high")``), bf16 on a CPU with bf16 kernels (``"medium"``). The label
    expansions (``TokenLabelMap.targets``, ``mixed_token_targets``) then take exact fp32 products of their own: a
    rounded product would move a CutMix target by up to 1e-3 (timm's ``Mixup`` mixes elementwise, exactly). True
    while compiling (the precision getters do not trace, and the compiler fuses the products into one kernel), and
    on a device whose settings this cannot read."""
    if torch.compiler.is_compiling():
        return True
    if device.type == "meta":  # no values to round: the matmul's shapes, as ever
        return False
    backend = {"cuda": torch.backends.cuda, "cpu": torch.backends.mkldnn}.get(device.type)
    if backend is None:
        return True
    # torch >= 2.9: the operator's effective setting, a backend's or the global one resolved ("none": IEEE, inherited)
    precision = getattr(getattr(backend, "matmul", None), "fp32_precision", None)
    if precision is not None:
        return precision not in ("none", "ieee")
    if device.type == "cuda":  # older torch: the legacy switches
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return torch.get_float32_matmul_precision() != "highest"
