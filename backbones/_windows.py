"""Label sums over rectangular windows (strided convs, pools, patch merges), one axis at a time.

A window's 0/1 matrix on a grid is the Kronecker product of one matrix per axis
(``W = W_h (x) W_w``: a position is in a window when its row and its column are), and so is
its row-normalised form and any product of them (``Norm(W) = Norm(W_h) (x) Norm(W_w)``,
``(A (x) B)(C (x) D) = AC (x) BD``). Applying a chain of windows to labels is therefore two
small matrix products, ``Y' = A_h Y A_w^T`` per (sample, label) map, instead of one pooling
pass per window: on CPU the pixel-grid stems (a ResNet's 7x7 stride-2 conv then its 3x3
max pool, PVT's 7x7 stride-4 patch embedding) cost over ten times less this way, since
``avg_pool2d`` with ``divisor_override`` runs a scalar loop over every tap.

Shapes: ``b`` batch, ``h w`` the grid (row-major ``n = h*w``), ``i j`` the output grid,
``l`` label channels.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor

from mixlabels._label_map import fp32_labels

__all__ = [
    "AxisWindow",
    "axis_windows",
    "same_padding",
    "same_axis_windows",
    "axis_out",
    "axis_matrix",
    "chain_matrices",
    "apply_separable",
    "window_sums",
    "axes_sums",
]

AxisWindow = tuple[int, int, int, int, bool]
"""One axis of a window: ``(kernel, stride, padding before, padding after, ceil_mode)``; the two paddings differ
only for TF 'same' padding (``same_axis_windows``)."""


def axis_windows(kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int], ceil_mode: bool = False) -> tuple[AxisWindow, AxisWindow]:
    """A 2-d window with static symmetric padding as its two axes."""
    return (
        (int(kernel[0]), int(stride[0]), int(padding[0]), int(padding[0]), ceil_mode),
        (int(kernel[1]), int(stride[1]), int(padding[1]), int(padding[1]), ceil_mode),
    )


def same_padding(size: int, kernel: int, stride: int, dilation: int = 1) -> tuple[int, int]:
    """TF 'same' padding of one axis of ``size`` (timm's ``get_same_padding`` and ``pad_same``): ``(before, after)``.

    The total makes the output ``ceil(size / stride)`` long; the odd unit, if any, goes after (bottom, right).
    """
    total = max((-(-size // stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def same_axis_windows(grid: Sequence[int], kernel: Sequence[int], stride: Sequence[int]) -> tuple[AxisWindow, AxisWindow]:
    """The two axes of a TF 'same'-padded window (``Conv2dSame``, ``AvgPool2dSame``, ``MaxPool2dSame``) applied to
    ``grid``: its padding depends on the input size, so the axes are resolved per grid."""
    axes = []
    for size, k, s in zip(grid, kernel, stride):
        before, after = same_padding(int(size), int(k), int(s))
        axes.append((int(k), int(s), before, after, False))
    return axes[0], axes[1]


def axis_out(size: int, window: AxisWindow) -> int:
    """PyTorch's pooling output length along one axis (``ceil_mode``: no window starts in the padding)."""
    k, s, before, after, ceil = window
    out = (size + before + after - k + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + before:
        out -= 1
    return out


def axis_matrix(size: int, window: AxisWindow) -> Tensor:
    """``(out, size)`` fp32 0/1: which in-grid positions of an axis each window holds (padding holds none)."""
    k, s, p, _, _ = window
    starts = torch.arange(axis_out(size, window)) * s - p
    pos = torch.arange(size)
    return ((pos[None] >= starts[:, None]) & (pos[None] < starts[:, None] + k)).float()


@functools.lru_cache(maxsize=512)
def chain_matrices(
    grid: tuple[int, int], windows: tuple[tuple[AxisWindow, AxisWindow], ...], normalise: bool, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(A_h, A_w)`` of a chain of windows applied in order (shapes only: cached per device).

    ``normalise``: every window's rows are divided by their in-grid count first (the chain
    of ``Norm(W)``); otherwise the product of the 0/1 matrices (plain sums).
    """
    mats: list[Tensor] = []
    # built on the CPU with autocast off: under a caller's CPU autocast the products would run in bf16, and the
    # rounded matrices would stay in the cache for every later step, fp32 ones included
    with fp32_labels(torch.device("cpu")):
        for axis in (0, 1):
            total = torch.eye(grid[axis])
            for window in windows:
                m = axis_matrix(total.shape[0], window[axis])
                if normalise:
                    m = m / m.sum(dim=-1, keepdim=True).clamp_min(1.0)
                total = m @ total
            mats.append(total.to(device))
    return mats[0], mats[1]


def apply_separable(labels: Tensor, grid: tuple[int, int], rows: Tensor, cols: Tensor) -> Tensor:
    """``(A_h (x) A_w) Y``: ``(b, h*w, l) -> (b, i*j, l)`` in two matrix products, in the labels' dtype
    (autocast off: label sums must not drop to half precision)."""
    b, l = labels.shape[0], labels.shape[-1]
    with fp32_labels(labels.device):
        # two large matrix products over a transposed copy: an expanded ``bmm`` per (b, h) row instead dispatches
        # fewer operators but runs a batch of thousands of (j, w) x (w, l) products, several times slower on a CPU
        y = rearrange(labels, "b (h w) l -> (b l h) w", h=grid[0]) @ cols.T.to(labels.dtype)  # (b l h) j
        y = rows.to(labels.dtype) @ rearrange(y, "(b l h) j -> (b l) h j", b=b, l=l)  # (b l) i j
        return rearrange(y, "(b l) i j -> b (i j) l", b=b)


def window_sums(
    labels: Tensor, grid: tuple[int, int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int], ceil_mode: bool = False
) -> tuple[Tensor, tuple[int, int]]:
    """The sum of the labels in every window (zero padding adds nothing), and the output grid."""
    return axes_sums(labels, grid, axis_windows(kernel, stride, padding, ceil_mode))


def axes_sums(labels: Tensor, grid: tuple[int, int], axes: tuple[AxisWindow, AxisWindow]) -> tuple[Tensor, tuple[int, int]]:
    """``window_sums`` of a window given by its two axes on ``grid`` (a 'same' window resolved there)."""
    rows, cols = chain_matrices(grid, (axes,), False, labels.device)
    return apply_separable(labels, grid, rows, cols), (int(rows.shape[0]), int(cols.shape[0]))
