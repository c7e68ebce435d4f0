"""Reference label rules on dense ``(b, n, c)`` class distributions, with explicit matrices.

The reference paths of the adapters run the model's modules with explicit attention
and hand every spatial mix, as an explicit ``(b, n, n)`` (or ``(n, n)``) matrix, and
every merge, as an explicit ``(n', n)`` 0/1 matrix, to ``DenseRules`` (the core's
``DenseTracker``: any scheme's ``Rules`` on dense float64 labels). The fast paths
(compact labels, convolutions, pooling, rolled windows, fused attention, events) are
tested against this second implementation; no code here knows which scheme runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels import DenseTracker, Scheme, TokenLabelMap, TokenLayout

__all__ = ["DenseRules", "conv_matrix", "kernel_reference", "window_matrix", "row_normalise", "drop_path_reference"]


def kernel_reference(weight: Tensor) -> Tensor:
    """The float64 label kernel ``mean_{o,i}(|K_oi| / sum|K_oi|)`` ``(kh, kw)`` of a conv weight ``(o, i, kh, kw)``
    (``_common.kernel_labels``' rule), every reference's: a pair of zeros adds nothing (its sum clamped, not 0 / 0),
    and a weight of zeros gives zeros, whose rows ``row_normalise`` makes the identity's."""
    k = weight.detach().double().abs()
    return (k / k.sum(dim=(-2, -1), keepdim=True).clamp_min(1e-300)).mean(dim=(0, 1))


def row_normalise(m: Tensor) -> Tensor:
    """Every row of ``m`` divided by its sum; a row of a square matrix with no mass (a conv whose weight is all zeros,
    or a position whose in-grid taps are; a token mixer's zeroed row) is the identity's row: that position keeps its
    own labels (``_common._self_tap`` and ``_common.mixing_rows``, the fast path's rules)."""
    sums = m.sum(dim=-1, keepdim=True)
    if m.shape[-1] == m.shape[-2] and bool((sums == 0).any()):
        eye = torch.eye(int(m.shape[-1]), dtype=m.dtype, device=m.device).expand_as(m)
        m = torch.where(sums == 0, eye, m)
        sums = m.sum(dim=-1, keepdim=True)
    return m / sums


def _taps(grid: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]) -> tuple[tuple[int, int], list[tuple[int, int, Tensor, Tensor, Tensor]]]:
    """For every tap ``(i, j)``: output and input flat indices of the in-grid pairs."""
    h, w = grid
    oh = (h + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    oy, ox = torch.meshgrid(torch.arange(oh), torch.arange(ow), indexing="ij")
    taps = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            iy = oy * stride[0] - padding[0] + i * dilation[0]
            ix = ox * stride[1] - padding[1] + j * dilation[1]
            ok = (iy >= 0) & (iy < h) & (ix >= 0) & (ix < w)
            taps.append((i, j, (oy * ow + ox)[ok], (iy * w + ix)[ok], ok))
    return (oh, ow), taps


def conv_matrix(
    grid: tuple[int, int],
    kernel: Tensor,
    stride: tuple[int, int] = (1, 1),
    padding: tuple[int, int] = (0, 0),
    dilation: tuple[int, int] = (1, 1),
) -> tuple[Tensor, tuple[int, int]]:
    """The explicit ``(n_out, n_in)`` matrix of a single-channel cross-correlation with zero padding."""
    out, taps = _taps(grid, (int(kernel.shape[0]), int(kernel.shape[1])), stride, padding, dilation)
    m = torch.zeros(out[0] * out[1], grid[0] * grid[1], dtype=torch.float64)
    for i, j, rows, cols, _ in taps:
        m[rows, cols] += float(kernel[i, j])
    return m, out


def window_matrix(attn: Tensor, index: Tensor, n: int) -> Tensor:
    """Scatter per-window matrices ``(b, nw, a, a)`` to one ``(b, n, n)`` over original token ids ``index`` ``(nw, a)``."""
    b, nw, a, _ = attn.shape
    m = attn.new_zeros(b, n, n)
    rows = index[:, :, None].expand(nw, a, a)
    cols = index[:, None, :].expand(nw, a, a)
    m[:, rows, cols] = attn
    return m


def drop_path_reference(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's DropPath with the same draw, and who kept the branch: the adapters' one helper
    (``branch``), so fast and reference paths drop the same samples; the function-preservation
    tests hold that helper to timm's own ``DropPath``."""
    return branch(module, x)


class DenseRules(DenseTracker):
    """Any scheme's rules on dense labels ``(b, n, c)`` (float64): ``mixlabels.DenseTracker`` for a grid.

    Args:
        scheme: any ``Scheme``; its ``rules`` decide what every event does to the labels.
        label_map: the batch's map.
        grid: the token grid the labels start on.
        num_prefix: prefix tokens (class token) before the patch tokens, labelled with the image target.
        depth: number of layers (layer choices resolve against it).
        class_token: the head reads token 0 (default: ``num_prefix > 0``).
    """

    def __init__(
        self, scheme: Scheme, label_map: TokenLabelMap, grid: tuple[int, int], num_prefix: int, depth: int,
        class_token: bool | None = None,
    ) -> None:
        layout = TokenLayout(grid=grid, num_prefix=num_prefix, depth=depth,
                             class_token=num_prefix > 0 if class_token is None else class_token)
        super().__init__(scheme.rules(label_map, layout), label_map, layout)

    def aggregate_convs(self, start: tuple[int, int], grid: tuple[int, int], convs: Sequence[Any]) -> None:
        """The reference of ``start_on_convs``: labels on the pixels (``start``) summed over every window of the
        strided ``convs`` in turn, as explicit 0/1 matrices; nothing for a token-space map (``start == grid``)."""
        if start == grid:
            return
        g = start
        for conv in convs:
            merge, g = conv_matrix(g, torch.ones(conv.kernel_size), conv.stride, conv.padding)
            self.aggregate(merge)
