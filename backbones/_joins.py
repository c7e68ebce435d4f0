"""Fused joins: branches that are each the identity or one stride-1 conv, joined by channel shares, as one convolution.

A ``Parallel`` of such branches (InceptionNeXt's token mixer: the untouched channels, a square and two band
depthwise convs) mixes labels by ``sum_i s_i Norm(T(k_i)) Y``: walked branch by branch that is a convolution and a
division per conv branch and a ``lerp`` per further branch, nine operators for InceptionNeXt's four. Every kernel
centred in one common window (the identity as a delta tap), scaled by its branch's share, makes it one grouped
convolution with a branch per output channel, one division by the branches' in-grid tap weights and one sum over
the branches: three operators a join, the same sums (rounded in another order). The kernels of every join alike in
a forward are centred, stacked and scaled together, and their tap weights on a grid come from one convolution of
ones (``Kernels.join``). A GPU's route (``fused_join_route``), and a CPU's eager walk's on grids up to 28x28 (there a
depthwise conv call costs its floor, ~60 us on 2 cores, whatever the grid: one call for the join beats three); on
larger grids the CPU keeps the branches (its folded depthwise convs are faster than one call over the padded window),
and so does a compiled graph (its shifted sums fuse already).

Shapes: ``b`` batch, ``l`` label channels, ``j`` joins alike, ``r`` branches, ``(kh, kw)`` the common window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import Tensor

from mixlabels._shape_cache import shape_cache
from mixlabels._routes import eager_cpu_routes, switched
from mixlabels.backbones._common import tap_weights

__all__ = ["JoinShape", "fused_join", "fused_join_route", "fused_joins", "join_masses", "join_shares", "join_window", "window_kernels"]

JoinShape = tuple[tuple[int, int] | None, ...]
"""A fusable join's branches in order: each conv branch's kernel ``(kh, kw)`` (odd, its padding half of it less one:
a stride-1 'same' conv), ``None`` for the identity."""


_FUSED = [True]
"""Whether a GPU's eager walk fuses the joins that fuse (``fused_joins``)."""


def fused_joins(on: bool) -> AbstractContextManager[None]:
    """Inside, a GPU's eager walk (and a CPU's, on grids up to ``_FUSED_CPU_TOKENS``) fuses the joins that fuse
    (``on``, the default) or walks their branches one by one (the CPU's route on larger grids, kept as the tested
    fallback): ``benchmarks/gpu_suite.py --family-mode eager --family-routes
    joins=walk`` times both on a GPU."""
    return switched(_FUSED, on)


_FUSED_CPU_TOKENS = 784
"""A CPU's eager walk fuses the joins on grids of at most this many positions (28x28). InceptionNeXt-atto at 224 px,
batch 8, 2 cores, forward label work with the joins fused up to 196 / 784 positions / on every grid against the walk:
-0.3 to -0.8 / -0.6 to -1.1 / +1.1 to +1.5 ms (medians of paired rounds, two to three runs each)."""


def fused_join_route(device: torch.device, grid: tuple[int, int]) -> bool:
    """Whether fusable joins run as one convolution (``fused_join``) on ``device``: a GPU's eager route (and the CPU
    under ``launch_routes``), not a compiled graph, unless ``fused_joins(False)``; a CPU's eager walk on ``grid``
    where it has at most ``_FUSED_CPU_TOKENS`` positions."""
    if not _FUSED[0] or torch.compiler.is_compiling():
        return False
    if eager_cpu_routes(device):
        return grid[0] * grid[1] <= _FUSED_CPU_TOKENS
    return True


def join_window(shape: JoinShape) -> tuple[int, int]:
    """The common padding ``(ph, pw)`` of a join's branches: the window ``(2 ph + 1, 2 pw + 1)`` holds every kernel
    centred."""
    kernels = [k for k in shape if k is not None]
    return max((k[0] for k in kernels), default=1) // 2, max((k[1] for k in kernels), default=1) // 2


def window_kernels(shape: JoinShape, branches: Sequence[Tensor | None], joins: int, device: torch.device) -> Tensor:
    """The joins' kernels centred in the common window ``(j, r, kh, kw)`` fp32, unscaled: branch ``i``'s kernels
    ``(j, kh_i, kw_i)`` padded with zeros, an identity branch (``None``) a delta at the centre."""
    ph, pw = join_window(shape)
    parts = []
    for kernel, stacked in zip(shape, branches, strict=True):
        if kernel is None or stacked is None:
            parts.append(_delta((2 * ph + 1, 2 * pw + 1), device).expand(joins, -1, -1))
        else:
            dh, dw = ph - kernel[0] // 2, pw - kernel[1] // 2
            parts.append(F.pad(stacked.float(), (dw, dw, dh, dh)) if dh or dw else stacked.float())
    return torch.stack(parts, dim=1)


@shape_cache(maxsize=32)
def _delta(window: tuple[int, int], device: torch.device) -> Tensor:
    """``(kh, kw)`` fp32: 1 at the centre, 0 elsewhere (the identity as a kernel: its tap weight is 1 everywhere)."""
    delta = torch.zeros(window, device=device)
    delta[window[0] // 2, window[1] // 2] = 1.0
    return delta


@shape_cache(maxsize=64)
def join_shares(shares: tuple[tuple[float, ...], ...], device: torch.device) -> Tensor:
    """Every join's branch shares ``(j, r, 1, 1)`` fp32 (constants of the model: cached)."""
    return torch.tensor(shares, dtype=torch.float32, device=device)[:, :, None, None]


def join_masses(kernels: Tensor, grid: tuple[int, int], flat: Tensor | None = None) -> Tensor:
    """Every branch's in-grid tap weight ``(j, r, h, w)`` on ``grid`` (``kernels``: ``window_kernels``' unscaled):
    ``tap_weights`` of every kernel at once (zero taps add nothing, so each is its own conv's weight). ``flat``:
    ``kernels`` viewed ``(j r, 1, kh, kw)``, made once by a caller that asks on several grids (one view, not one a grid)."""
    j, r, kh, kw = (int(s) for s in kernels.shape)
    weight = kernels.view(j * r, 1, kh, kw) if flat is None else flat
    return tap_weights(weight, grid, (kh // 2, kw // 2), (1, 1)).view(j, r, *grid)


def fused_join(y: Tensor, weight: Tensor, masses: Tensor) -> Tensor:
    """``sum_i s_i Norm(T(k_i)) Y`` of labels viewed ``(b, l, h, w)``: one grouped convolution with every branch's
    share-scaled kernel (``weight`` ``(l r, 1, kh, kw)``: each label channel's ``r`` kernels), the division by the
    branches' tap weights ``masses`` ``(r, h, w)`` and the sum over the branches.

    Returns:
        ``(b, l, h, w)`` fp32, rows summing to 1 where the input's do (the shares do).
    """
    l, kh, kw = int(y.shape[1]), int(weight.shape[-2]), int(weight.shape[-1])
    z = F.conv2d(y, weight, padding=(kh // 2, kw // 2), groups=l)  # b (l r) h w
    b, h, w = int(z.shape[0]), int(z.shape[2]), int(z.shape[3])
    return z.view(b, l, -1, h, w).div_(masses).sum(dim=2)  # the channel axis split: a view in any layout
