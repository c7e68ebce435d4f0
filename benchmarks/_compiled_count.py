"""What a compiled training step runs: inductor's generated kernels and the ATen operators its code calls out to.

Compiled, a step is no longer one launch per operator: inductor fuses pointwise and reduction work into generated
kernels and calls out (extern) for what it does not generate (convolutions, matrix products). On a GPU each of
either is a launch, which the host pays for; a compiled step of a small model waits on its host (the GPU suite's
profiles). On the CPU inductor generates C++ kernels from the same fused graph, and its Python wrapper calls them
and the extern operators one by one, so counting those calls counts what the GPU would launch, up to the backends'
choices (which operators each generates, falls back on, or splits).

The calls are counted by profiling the Python calls a step makes (``cProfile``): a generated kernel is a built-in
named ``<module>.kernel`` (inductor's C++ kernels, torch 2.14), an extern call a ``torch.<op>`` built-in that is an
ATen operator reading a tensor (``torch.convolution``, ``torch.mm``).
"""

from __future__ import annotations

import cProfile
import pstats
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["count_compiled_calls", "is_aten_operator"]

_BUILTIN = "<built-in method "


def is_aten_operator(name: str) -> bool:
    """Whether ``torch.<name>`` is an ATen operator that reads a tensor (``convolution``, ``mm``): a kernel on the
    device, not a helper (``is_grad_enabled``) or an allocation (``empty_strided``)."""
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return any(
        str(arg.type).startswith("Tensor") and not arg.is_out  # an .out overload's output is no input
        for overload in packet.overloads()
        for arg in getattr(packet, overload)._schema.arguments
    )


def count_compiled_calls(run: Callable[[], None], steps: int = 2) -> dict[str, Any]:
    """Per step of ``run`` (a compiled step, already warm): ``kernels`` (generated), ``extern`` (ATen operators
    called out to, by name) and ``launches`` (both), averaged over ``steps`` steps."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        for _ in range(steps):
            run()
    finally:
        profile.disable()
    kernels, extern = 0, Counter[str]()
    stats: dict[tuple[str, int, str], tuple[Any, ...]] = getattr(pstats.Stats(profile), "stats")
    for (_, _, name), row in stats.items():
        calls = int(row[1])  # primitive and recursive calls alike: what ran
        if not name.startswith(_BUILTIN) or not name.endswith(">"):
            continue
        method = name[len(_BUILTIN) : -1]
        if method.endswith(".kernel") and not method.startswith("torch."):
            kernels += calls
        elif method.startswith("torch.") and "." not in method[len("torch.") :] and is_aten_operator(method[len("torch.") :]):
            extern[method[len("torch.") :]] += calls
    per_step = {op: n / steps for op, n in extern.most_common()}
    return {"kernels": kernels / steps, "extern": per_step, "launches": kernels / steps + sum(per_step.values())}
