"""Label sums over rectangular windows (strided convs, pools, patch merges), one axis at a time.

A window's 0/1 matrix on a grid is the Kronecker product of one matrix per axis
(``W = W_h (x) W_w``: a position is in a window when its row and its column are), and so is
its row-normalised form and any product of them (``Norm(W) = Norm(W_h) (x) Norm(W_w)``,
``(A (x) B)(C (x) D) = AC (x) BD``). Applying a chain of windows to labels is therefore two
small matrix products, ``Y' = A_h Y A_w^T`` per (sample, label) map, instead of one pooling
pass per window: on CPU the pixel-grid stems (a ResNet's 7x7 stride-2 conv then its 3x3
max pool, PVT's 7x7 stride-4 patch embedding) cost over ten times less this way, since
``avg_pool2d`` with ``divisor_override`` runs a scalar loop over every tap.

Averaged windows (``Norm(W)``, what a merge of labels is) are also one ``avg_pool2d`` each with
``count_include_pad=False`` (``apply_pooled``): one kernel where the products dispatch about
fifteen operators, so it is the route on a GPU and, for small inputs, on a CPU (``window_route``).

Shapes: ``b`` batch, ``h w`` the grid (row-major ``n = h*w``), ``i j`` the output grid,
``l`` label channels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mixlabels._label_map import fp32_labels
from mixlabels._routes import eager_launch_routes
from mixlabels._shape_cache import shape_cache

__all__ = [
    "AxisWindow",
    "axis_windows",
    "same_padding",
    "same_axis_windows",
    "axis_out",
    "axis_matrix",
    "chain_matrices",
    "apply_separable",
    "as_grid",
    "as_tokens",
    "folded",
    "is_position_major",
    "unfolded",
    "position_major",
    "pool_ceil_mode",
    "apply_pooled",
    "pool_on_grid",
    "window_route",
    "mix_tokens",
    "average_windows",
    "window_plan",
    "WindowPlan",
    "window_means",
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


@shape_cache(maxsize=512)
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


_GRID_SOURCE = "_mixlabels_grid_source"
"""The attribute by which ``as_tokens``' strided view of a grid holds that grid view (eager mode)."""


def as_grid(labels: Tensor, grid: tuple[int, int]) -> Tensor:
    """``rearrange(labels, "b (h w) l -> b l h w")`` as one strided view (einops' view and permute are two operators):
    channels-last memory where ``labels`` are contiguous. Of ``as_tokens``' view of a ``grid`` view, that view itself
    (the same storage, strides and offset): a pool or conv's output read on its grid again dispatches nothing."""
    if not torch.compiler.is_compiling():  # a traced view costs nothing, and dynamo need not see the attribute
        source = getattr(labels, _GRID_SOURCE, None)
        if source is not None and (int(source.shape[-2]), int(source.shape[-1])) == tuple(grid):
            return source  # type: ignore[no-any-return]
    b, n, l = labels.shape
    sb, sn, sl = labels.stride()
    return labels.as_strided((b, l, grid[0], grid[1]), (sb, sl, sn * grid[1], sn))  # the storage offset: the input's


def as_tokens(y: Tensor) -> Tensor:
    """``rearrange(y, "b l h w -> b (h w) l")``: one strided view where ``h`` and ``w`` merge (a convolution's or a
    pooling's output in ``as_grid``'s layout), einops otherwise."""
    b, l, h, w = y.shape
    sb, sl, sh, sw = y.stride()
    if sh != sw * w:
        return rearrange(y, "b l h w -> b (h w) l")
    tokens = y.as_strided((b, h * w, l), (sb, sw, sl))
    if not torch.compiler.is_compiling():
        setattr(tokens, _GRID_SOURCE, y)  # as_grid(tokens, (h, w)) is y: the same view
    return tokens


def folded(y: Tensor) -> Tensor | None:
    """Labels viewed ``(b, l, h, w)`` as one channels-last map of ``b * l`` channels ``(1, (b l), h, w)``, where they
    lie in position-major memory (``is_position_major``), else ``None``.

    A depthwise conv or a pooling treats every channel alike, so on the folded view it is the same sums in one call
    over ``b * l`` channels. On the CPU that call is the faster one: its channels-last kernels vectorise over the
    channels, and a label map has two or three (8 x 2 labels, 3x3, 2 cores: 0.080 ms folded against 0.218 on
    112x112, 0.055 against 0.089 on 56x56)."""
    if not is_position_major(y):
        return None
    b, l, h, w = (int(s) for s in y.shape)
    # channel b*l + l' lies at b*l + l'. The batch axis (size 1) gets a dense tensor's stride: PyTorch reads any
    # other as a layout that is not channels-last, and the convolution would first copy the labels out of it
    return y.as_strided((1, b * l, h, w), (b * l * h * w, 1, w * b * l, b * l))


def is_position_major(y: Tensor) -> bool:
    """Whether labels viewed ``(b, l, h, w)``, a batch of more than one, lie in ``position_major``'s memory
    ``(h, w, b, l)``: the one layout ``folded`` folds."""
    b, l, _, w = (int(s) for s in y.shape)
    return b > 1 and y.stride() == (l, 1, w * b * l, b * l)


def unfolded(y: Tensor, batch: int) -> Tensor:
    """``folded``'s inverse: a ``(1, (b l), h, w)`` result viewed ``(b, l, h, w)`` in its own memory layout."""
    _, c, h, w = (int(s) for s in y.shape)
    _, sc, sh, sw = y.stride()
    return y.as_strided((batch, c // batch, h, w), (c // batch * sc, sc, sh, sw))


def position_major(y: Tensor) -> Tensor:
    """Labels viewed ``(b, l, h, w)`` copied into position-major memory ``(h, w, b, l)`` and viewed as before, which
    ``folded`` folds: one copy, after which the depthwise convs, pools and elementwise events (a residual's ``lerp``
    keeps its inputs' layout) keep the layout, so a forward copies once, not once a conv."""
    b, l, h, w = (int(s) for s in y.shape)
    out = y.new_empty((h, w, b, l)).permute(2, 3, 0, 1)
    return out.copy_(y)


def pool_ceil_mode(grid: tuple[int, int], axes: Sequence[tuple[AxisWindow, AxisWindow]]) -> tuple[bool, ...] | None:
    """The ``ceil_mode`` with which ``avg_pool2d`` (symmetric padding: each axis' padding before) makes exactly the
    windows of every window in ``axes`` applied in turn from ``grid``, or ``None`` where one cannot: padding over
    half the kernel or negative (a crop: VGG's pre-logits), or no ``ceil_mode`` giving the window's output size on both axes (a 'same' window's odd unit
    after is then no padding ``avg_pool2d`` needs, since every window starts at ``o * stride - before`` either way)."""
    modes = []
    for window in axes:
        fits = [
            ceil for ceil in (False, True)
            if all(0 <= 2 * p <= k and axis_out(size, (k, s, p, p, ceil)) == axis_out(size, (k, s, p, after, c))
                   for size, (k, s, p, after, c) in zip(grid, window))
        ]
        if not fits:
            return None
        modes.append(fits[0])
        grid = (axis_out(grid[0], window[0]), axis_out(grid[1], window[1]))
    return tuple(modes)


def apply_pooled(labels: Tensor, grid: tuple[int, int], axes: Sequence[tuple[AxisWindow, AxisWindow]], ceil_modes: Sequence[bool]) -> Tensor:
    """``Norm(W_k) ... Norm(W_1) Y``: ``(b, h*w, l) -> (b, i*j, l)`` fp32, ``pool_on_grid`` on the labels viewed
    ``(b, l, h, w)`` in place. ``ceil_modes``: ``pool_ceil_mode``'s."""
    return as_tokens(pool_on_grid(as_grid(labels, grid), axes, ceil_modes))


def pool_on_grid(y: Tensor, axes: Sequence[tuple[AxisWindow, AxisWindow]], ceil_modes: Sequence[bool]) -> Tensor:
    """Labels viewed ``(b, l, h, w)`` (``as_grid``) through one ``avg_pool2d`` per window (``count_include_pad=False``:
    every window's mean over its in-grid positions is its row of ``Norm(W)``): one kernel a window, where
    ``apply_separable`` launches about six. ``ceil_modes``: ``pool_ceil_mode``'s.

    Returns:
        ``(b, l, i, j)`` fp32 in the input's memory layout (``folded`` where the input folds).
    """
    with fp32_labels(y.device):
        y, batch = y.float(), int(y.shape[0])
        f = folded(y)  # position-major labels: every window over the whole batch's labels in one channels-last call
        z = y if f is None else f
        for ((kh, sh, ph, _, _), (kw, sw, pw, _, _)), ceil in zip(axes, ceil_modes):
            z = F.avg_pool2d(z, (kh, kw), (sh, sw), (ph, pw), ceil_mode=ceil, count_include_pad=False)
        return z if f is None else unfolded(z, batch)


_DENSE_WINDOW_PRODUCTS = 2**19
"""A run of windows whose dense ``(n', n)`` matrix, applied to the whole batch, makes at most this many position
pairs (``b n' n``) is that one cached matrix and one batched product (two operators); a larger one is separable
(a product per axis). The batched product reads the whole matrix once per sample: on 2 CPU cores a ResNet's
56x56 -> 28x28 window (2.5M pairs) took 15 ms at batch 8 and 240 ms at batch 128 that way, 0.4 and 1.6 ms
separable; 14x14 -> 7x7 (9.6k pairs) 0.07 ms dense at batch 8 against 0.17 separable, and 0.9 against 0.3 at 128
(``window_route`` decides; its test holds these sizes)."""

_POOLED_CPU_POSITIONS = 2**15
"""On a CPU, a run of windows whose input has at most this many positions over the batch (``b h w``) is pooled
(``apply_pooled``: one ``avg_pool2d`` a window, three operators with its two views, where the separable products
dispatch fifteen). Above it the CPU's pooling loop is slower than the separable products' BLAS calls: a ResNet's
3x3 stride-2 window on 2 cores (``benchmarks/window_routes.py``), 14x14 at batch 128 (25k positions) 0.20 ms
pooled against 0.33 separable, 56x56 at batch 8 (25k) 0.22 against 0.18, 28x28 at 128 (100k) 0.84 against 0.42.
On a GPU pooling is one memory-bound kernel whatever the size, where the separable products launch about six."""


def window_route(batch: int, grid: tuple[int, int], out: tuple[int, int], device: torch.device | str = "cpu",
                 poolable: bool = True) -> str:
    """``"pooled"``, ``"dense"`` or ``"separable"``: how ``apply_path`` applies a run of windows from ``grid`` to
    ``out`` on ``device`` (``poolable``: ``avg_pool2d`` can make its windows, ``pool_ceil_mode``). The CPU under
    ``launch_routes`` takes a GPU's route (pooled whatever the size), so that what it counts is what a GPU launches."""
    device = torch.device(device)
    on_cpu = device.type == "cpu" and not eager_launch_routes(device)
    if poolable and (not on_cpu or batch * grid[0] * grid[1] <= _POOLED_CPU_POSITIONS):
        return "pooled"
    return "dense" if batch * out[0] * out[1] * grid[0] * grid[1] <= _DENSE_WINDOW_PRODUCTS else "separable"


@shape_cache(maxsize=128)
def _window_kron(grid: tuple[int, int], axes: tuple[tuple[AxisWindow, AxisWindow], ...], device: torch.device) -> Tensor:
    """``Norm(A_h) (x) Norm(A_w)``: a run of windows as one ``(n', n)`` fp32 matrix (shapes only: cached)."""
    rows, cols = chain_matrices(grid, axes, True, device)
    return torch.kron(rows, cols)


def mix_tokens(matrix: Tensor, labels: Tensor) -> Tensor:
    """``matrix @ labels`` for one ``(n, m)`` matrix shared by the batch (or that matrix expanded ``(b, n, m)``
    already: ``Kernels.residual``'s) and labels ``(b, m, l)``: ``(b, n, l)``.

    ``@`` broadcasts a matrix over a batch in seven operators (views, an expand, a transpose, the product);
    an expanded ``bmm`` is two, and multiplies the same rows.
    """
    return torch.bmm(matrix if matrix.dim() == 3 else matrix.expand(labels.shape[0], -1, -1), labels)


WindowPlan = tuple[str, tuple[bool, ...] | None, tuple[int, int]]
"""How a run of windows is applied (``window_plan``): the route, ``pool_ceil_mode``'s modes, the grid it ends on."""


def window_plan(batch: int, grid: tuple[int, int], axes: Sequence[tuple[AxisWindow, AxisWindow]], device: torch.device) -> WindowPlan:
    """The route ``window_route`` takes for a run of windows on ``grid``, the ``ceil_mode`` values that pool it (``None``:
    it does not pool), and the grid it ends on."""
    out = grid
    for window in axes:
        out = (axis_out(out[0], window[0]), axis_out(out[1], window[1]))
    ceil_modes = pool_ceil_mode(grid, axes)
    return window_route(batch, grid, out, device, ceil_modes is not None), ceil_modes, out


def average_windows(
    labels: Tensor, grid: tuple[int, int], axes: Sequence[tuple[AxisWindow, AxisWindow]], plan: WindowPlan | None = None,
) -> tuple[Tensor, tuple[int, int]]:
    """``Norm(W_k) ... Norm(W_1) Y``: labels ``(b, h*w, l)`` averaged over the in-grid positions of every window of a
    chain applied in turn, ``(b, i*j, l)`` fp32 (rows summing to 1 where the input's do), and the grid it ends on;
    pooled, one dense matrix or separable, as ``window_plan`` chooses (``plan``: already asked)."""
    route, ceil_modes, out = window_plan(int(labels.shape[0]), grid, axes, labels.device) if plan is None else plan
    with fp32_labels(labels.device):
        if route == "pooled" and ceil_modes is not None:
            return apply_pooled(labels.float(), grid, axes, ceil_modes), out
        if route == "dense":
            return mix_tokens(_window_kron(grid, tuple(axes), labels.device), labels.float()), out
        return apply_separable(labels.float(), grid, *chain_matrices(grid, tuple(axes), True, labels.device)), out


def window_means(
    labels: Tensor, grid: tuple[int, int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int], ceil_mode: bool = False
) -> tuple[Tensor, tuple[int, int]]:
    """The mean of the labels over every window's in-grid positions (``average_windows`` of one window), and the
    output grid: ``window_sums`` renormalised, where the input's rows sum to 1."""
    return average_windows(labels, grid, (axis_windows(kernel, stride, padding, ceil_mode),))


def window_sums(
    labels: Tensor, grid: tuple[int, int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int], ceil_mode: bool = False
) -> tuple[Tensor, tuple[int, int]]:
    """The sum of the labels in every window (zero padding adds nothing), and the output grid."""
    return axes_sums(labels, grid, axis_windows(kernel, stride, padding, ceil_mode))


def axes_sums(labels: Tensor, grid: tuple[int, int], axes: tuple[AxisWindow, AxisWindow]) -> tuple[Tensor, tuple[int, int]]:
    """``window_sums`` of a window given by its two axes on ``grid`` (a 'same' window resolved there)."""
    rows, cols = chain_matrices(grid, (axes,), False, labels.device)
    return apply_separable(labels, grid, rows, cols), (int(rows.shape[0]), int(cols.shape[0]))
