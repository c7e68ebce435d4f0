"""Separable window sums and stems that start on their windows, against explicit references.

- ``window_sums`` / ``chain_matrices`` against PyTorch's pooling (a sum with ``divisor_override=1``)
  and against the position-by-position window matrices of ``backbones._convnet``;
- ``Mask.window_weights`` (box and cell masks) against the pixel weights multiplied out;
- ``start_on_windows``: the labels a stem's pixel windows give equal starting on the pixels
  and aggregating window by window, for box masks, cell masks and with token targets;
- an adapted CNN and a pyramid transformer on CutMix boxes: fast path == reference.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from timm.layers.conv2d_same import Conv2dSame
from timm.layers.pool2d_same import AvgPool2dSame, MaxPool2dSame
from torch.testing import assert_close

from benchmarks._op_counter import OpCounter
from mixlabels import AlignedTargets, NoAlign, Scheme, TLAlign, TokenLabeling, TokenLabelMap, TokenLayout
from mixlabels._mask import BoxMask, CellMask
from mixlabels.backbones import adapt
from mixlabels.backbones._common import launch_routes, mix_tokens, start_on_windows
from mixlabels.backbones._convnet import Window, apply_path, path_matrix, window_axes
from mixlabels.backbones._windows import _window_kron, axis_windows, chain_matrices, window_sums
from tests.test_backbones_common import sharpen

windows_2d = st.tuples(st.integers(1, 7), st.integers(1, 4), st.integers(0, 3), st.booleans())


def _valid(size: int, k: int, p: int) -> bool:
    return 2 * p <= k and size + 2 * p >= k  # PyTorch's pooling limits


@settings(max_examples=60, deadline=None)
@given(h=st.integers(3, 23), w=st.integers(3, 23), wh=windows_2d, ww=windows_2d, seed=st.integers(0, 2**16))
def test_window_sums_equal_pooling(h: int, w: int, wh: tuple[int, int, int, bool], ww: tuple[int, int, int, bool], seed: int) -> None:
    (kh, sh, ph, ceil), (kw, sw, pw, _) = wh, ww
    assume(_valid(h, kh, ph) and _valid(w, kw, pw))
    y = torch.rand(2, h * w, 3, generator=torch.Generator().manual_seed(seed))
    ours, grid = window_sums(y, (h, w), (kh, kw), (sh, sw), (ph, pw), ceil_mode=ceil)
    pooled = F.avg_pool2d(rearrange(y, "b (h w) l -> b l h w", h=h), (kh, kw), (sh, sw), (ph, pw), ceil_mode=ceil, divisor_override=1)
    assert grid == tuple(pooled.shape[-2:])
    assert_close(ours, rearrange(pooled, "b l h w -> b (h w) l"))


@pytest.mark.parametrize(
    "grid, path",
    [
        ((224, 224), (Window((7, 7), (2, 2), (3, 3)), Window((3, 3), (2, 2), (1, 1)))),  # ResNet's stem
        ((33, 31), (Window((3, 3), (2, 2), (1, 1)), Window((3, 3), (2, 2), (1, 1), True), Window((2, 2), (2, 2), (0, 0)))),
        ((16, 16), (Window((4, 4), (4, 4), (0, 0)),)),
    ],
)
def test_window_chains_equal_explicit_matrices(grid: tuple[int, int], path: tuple[Window, ...]) -> None:
    y = torch.rand(2, grid[0] * grid[1], 2, generator=torch.Generator().manual_seed(0))
    y = y / y.sum(-1, keepdim=True)
    ours, out = apply_path(path, y, grid)
    matrix, ref_out = path_matrix(path, grid) if grid[0] * grid[1] <= 4096 else (None, out)
    assert out == ref_out
    if matrix is not None:
        assert_close(ours.double(), matrix @ y.double(), rtol=1e-6, atol=1e-7)
    assert_close(ours.sum(-1), torch.ones(2, out[0] * out[1]))  # rows stay distributions


def test_window_route_by_batch_size_and_device_gives_the_same_labels() -> None:
    """On a CPU a run of windows is pooled while ``b h w`` is small (the CPU's pooling loop loses to BLAS above),
    else one dense matrix product while ``b n' n`` is (the product reads the matrix once per sample), else
    separable; on a GPU pooled wherever ``avg_pool2d`` makes the windows. Every route gives the same labels."""
    from mixlabels.backbones._windows import window_route

    assert window_route(8, (14, 14), (7, 7)) == "pooled"
    assert window_route(128, (14, 14), (7, 7)) == "pooled"  # 25k positions
    assert window_route(128, (28, 28), (14, 14)) == "separable"  # 100k positions, 19.7M pairs
    assert window_route(8, (14, 14), (7, 7), poolable=False) == "dense"
    assert window_route(128, (14, 14), (7, 7), poolable=False) == "separable"
    assert window_route(2, (56, 56), (28, 28), poolable=False) == "separable"  # 2.5M pairs a sample
    assert window_route(128, (56, 56), (28, 28), "cuda") == "pooled"
    assert window_route(128, (56, 56), (28, 28), torch.device("cuda"), poolable=False) == "separable"
    with launch_routes():  # the CPU counting a GPU's launches takes its route
        assert window_route(128, (28, 28), (14, 14)) == "pooled"
        assert window_route(128, (56, 56), (28, 28), poolable=False) == "separable"
    path = (Window((3, 3), (2, 2), (1, 1)),)
    y = torch.rand(200, 196, 3, generator=torch.Generator().manual_seed(0))
    y = y / y.sum(-1, keepdim=True)
    assert window_route(2, (14, 14), (7, 7)) == "pooled" and window_route(200, (14, 14), (7, 7)) == "separable"
    pooled, grid = apply_path(path, y[:2], (14, 14))
    separable, same = apply_path(path, y, (14, 14))
    assert grid == same == (7, 7)
    axes = window_axes(list(path), (14, 14))
    dense = mix_tokens(_window_kron((14, 14), axes, y.device), y[:2])
    matrix, _ = path_matrix(path, (14, 14))
    for labels in (pooled, dense, separable[:2]):
        assert_close(labels.double(), matrix @ y[:2].double(), rtol=1e-6, atol=1e-7)
    assert_close(separable.double(), matrix @ y.double(), rtol=1e-6, atol=1e-7)


@settings(max_examples=60, deadline=None)
@given(
    size=st.tuples(st.integers(1, 23), st.integers(1, 23)), kernel=st.tuples(st.integers(1, 7), st.integers(1, 7)),
    stride=st.tuples(st.integers(1, 4), st.integers(1, 4)), padding=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    ceil=st.booleans(), same=st.booleans(), second=st.booleans(),
)
def test_pooled_windows_equal_their_matrices_wherever_avg_pool_makes_them(
    size: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int], ceil: bool,
    same: bool, second: bool,
) -> None:
    """``pool_ceil_mode`` accepts every window with padding at most half its kernel (TF 'same' windows, their odd
    unit after, included), and ``apply_pooled`` then equals the chain of row-normalised window matrices on every
    grid; it refuses (``None``) a window ``avg_pool2d`` cannot make."""
    from mixlabels.backbones._windows import apply_pooled, pool_ceil_mode

    padding = (min(padding[0], kernel[0] // 2), min(padding[1], kernel[1] // 2))
    window = Window(kernel, stride, padding, ceil, same=same)
    assume(min(window.out_grid(size)) > 0)
    path = (window, Window((3, 3), (2, 2), (1, 1))) if second and min(window.out_grid(size)) >= 2 else (window,)
    axes = window_axes(list(path), size)
    modes = pool_ceil_mode(size, axes)
    if not same:
        assert modes is not None  # symmetric padding within half the kernel: always pooled
    if modes is None:
        assert same  # only a 'same' window's padding can exceed what avg_pool2d takes
        return
    n = size[0] * size[1]
    y = torch.rand(3, n, 2, generator=torch.Generator().manual_seed(n))
    y = y / y.sum(-1, keepdim=True)
    matrix, out = path_matrix(path, size)
    got = apply_pooled(y, size, axes, modes)
    assert got.shape == (3, out[0] * out[1], 2)
    assert_close(got.double(), matrix @ y.double(), rtol=1e-6, atol=1e-7)


def test_pool_ceil_mode_refuses_padding_over_half_the_kernel_or_negative() -> None:
    """``avg_pool2d`` takes padding from 0 to half its kernel; a window padded more (a 1x1 conv with padding 1) or
    cropping (negative padding: VGG's pre-logits crop) stays on the matrix routes."""
    from mixlabels.backbones._windows import pool_ceil_mode

    assert pool_ceil_mode((8, 8), window_axes([Window((1, 1), (2, 2), (1, 1))], (8, 8))) is None
    assert pool_ceil_mode((9, 9), window_axes([Window((1, 1), (1, 1), (-3, -3))], (9, 9))) is None
    assert pool_ceil_mode((8, 8), window_axes([Window((3, 3), (2, 2), (1, 1))], (8, 8))) == (False,)


def _explicit_window_weights(pixels: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``(b, k, H, W)`` pixel weights multiplied out by the per-axis windows, in float64."""
    out = torch.einsum("ih,bkhw,jw->bijk", rows.double(), pixels.double(), cols.double())
    return rearrange(out, "b i j k -> b (i j) k")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), cell=st.sampled_from([1, 2, 4]))
def test_box_and_cell_window_weights_equal_the_pixels(seed: int, cell: int) -> None:
    g = torch.Generator().manual_seed(seed)
    gh, gw = 32 // cell, 24 // cell
    y0 = torch.randint(-2, gh, (5,), generator=g)
    x0 = torch.randint(-2, gw, (5,), generator=g)
    boxes = torch.stack([y0, y0 + torch.randint(0, gh, (5,), generator=g), x0, x0 + torch.randint(0, gw, (5,), generator=g)], 1)
    box = BoxMask(boxes, (gh, gw))
    cells = CellMask(torch.rand(5, 3, gh, gw, generator=g).softmax(dim=1))
    wh, ww = axis_windows((7, 5), (2, 3), (3, 1)), axis_windows((3, 3), (2, 2), (1, 1))
    rows, cols = chain_matrices((32, 24), ((wh[0], ww[0]), (wh[1], ww[1])), True, torch.device("cpu"))
    for launches in (False, True):  # the CPU's eager route (a product an axis) and a GPU's (one product, both axes)
        with launch_routes() if launches else contextlib.nullcontext():
            for mask in (box, cells):
                expected = _explicit_window_weights(mask.pixel_weights((32, 24)), rows, cols)
                assert_close(mask.window_weights(rows, cols).double(), expected, rtol=1e-6, atol=1e-6)
            with OpCounter() as ops:
                got = box.window_weights(rows, cols)
            assert ops.ops["mm"] == (1 if launches else 2), ops.ops
            # the bounds broadcast per axis against the cells' spans, the shorter axis padded: no indexing
            assert "index" not in ops.ops and ops.kernels == (7 if launches else 8), ops.ops
            assert (got >= 0).all()  # own = total - partner, clamped: rounding stays >= 0
            # the box mask's answer is the cell mask's of its boxes
            assert_close(got, CellMask(box.dense()).window_weights(rows, cols), rtol=1e-6, atol=1e-6)


def test_label_map_weights_and_targets_stay_fp32_under_autocast() -> None:
    """A caller's bf16 autocast (a training step's) does not reach the label map: its window weights (matrix
    products), token targets and soft targets (einsums) are fp32 and the same bits as without autocast."""
    g = torch.Generator().manual_seed(0)
    boxes = torch.tensor([[2, 20, 3, 11], [0, 32, 0, 24], [5, 6, 7, 30], [-1, 9, 4, 4]])
    partner, labels = torch.tensor([1, 2, 3, 0]), torch.tensor([0, 1, 2, 3])
    box = TokenLabelMap.from_boxes(boxes, (32, 24), partner, labels, 5)
    cells = TokenLabelMap.from_mask(torch.rand(4, 8, 6, generator=g), partner, labels, 5, image_size=(32, 24))
    cells = cells.with_token_targets(torch.rand(4, 8, 6, 5, generator=g).softmax(-1))
    wh, ww = axis_windows((7, 5), (2, 3), (3, 1)), axis_windows((3, 3), (2, 2), (1, 1))
    rows, cols = chain_matrices((32, 24), ((wh[0], ww[0]), (wh[1], ww[1])), True, torch.device("cpu"))

    def values(lm: TokenLabelMap) -> list[torch.Tensor]:
        weights = lm.window_weights(rows, cols)
        out = [weights, lm.targets(weights), lm.image_targets()]
        return out + ([lm.mixed_token_targets((4, 3))] if lm.token_targets is not None else [])

    for lm in (box, cells):
        plain = values(lm)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = values(lm)
        for got, want in zip(cast, plain, strict=True):
            assert got.dtype == torch.float32
            assert torch.equal(got, want)


def test_cached_window_matrices_are_fp32_also_when_first_built_under_autocast() -> None:
    """``chain_matrices`` is cached: built first inside a caller's bf16 autocast, its products must not round, or
    every later step reads the rounded matrices (found as the digest changing senet's fast path after a bf16
    test had run in the same process)."""
    grid, run = (19, 23), (axis_windows((3, 3), (2, 2), (1, 1)), axis_windows((3, 3), (1, 1), (1, 1)))
    chain_matrices.cache_clear()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under = [m.clone() for m in chain_matrices(grid, run, True, torch.device("cpu"))]
        chain_matrices.cache_clear()
        plain = chain_matrices(grid, run, True, torch.device("cpu"))
    finally:
        chain_matrices.cache_clear()
    for got, want in zip(under, plain):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_window_weights_refuse_wrong_shapes() -> None:
    lm = TokenLabelMap.unmixed(torch.tensor([0, 1]), 3, (8, 8))
    rows, cols = chain_matrices((8, 8), (axis_windows((3, 3), (2, 2), (1, 1)),), True, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"window_weights: cols must be \(tokens, 8\) over the image's 8 pixels, got \(4, 6\)"):
        lm.window_weights(rows, torch.zeros(4, 6))
    with pytest.raises(ValueError, match="pixel_windows make a 4x4 grid, but the layout's grid is 2x2; pass the stem's output grid"):
        TokenLayout(grid=(2, 2), num_prefix=0, depth=1, class_token=False, pixel_windows=(rows, cols))


def _pixel_start(scheme: Scheme, lm: TokenLabelMap, windows: list[Window], depth: int) -> AlignedTargets:
    """The route before ``pixel_windows``: start on the pixels, aggregate window by window."""
    size = lm.image_size
    tracker = scheme.start(lm, TokenLayout(grid=size, num_prefix=0, depth=depth, class_token=False))
    grid = size
    for w in windows:
        g = grid
        tracker.aggregate(lambda y, g=g, w=w: window_sums(y, g, w.kernel, w.stride, w.padding)[0])  # type: ignore[misc]
        grid = w.out_grid(grid)
    tracker.pool("mean", 0)
    return tracker.finish()


@pytest.mark.parametrize("kind", ["box", "cells", "token_targets"])
def test_start_on_windows_equals_starting_on_the_pixels(kind: str) -> None:
    g = torch.Generator().manual_seed(4)
    labels = torch.randint(0, 5, (4,), generator=g)
    partner = torch.tensor([1, 2, 3, 0])
    if kind == "cells":
        lm = TokenLabelMap.from_mask(torch.rand(4, 32, 32, generator=g).round(), partner, labels, num_classes=5, label_smoothing=0.1)
    else:
        boxes = torch.tensor([[3, 20, 5, 30], [0, 32, 0, 9], [10, 11, 4, 5], [0, 0, 0, 0]])
        lm = TokenLabelMap.from_boxes(boxes, (32, 32), partner, labels, num_classes=5, label_smoothing=0.1)
    if kind == "token_targets":
        lm = lm.with_token_targets(torch.rand(4, 32, 32, 5, generator=g).softmax(-1))  # pixel maps: the pixel start needs them
    windows = [Window((7, 7), (2, 2), (3, 3)), Window((3, 3), (2, 2), (1, 1))]
    scheme: Scheme = TokenLabeling(aligned=True) if kind == "token_targets" else TLAlign()
    tracker, grid = start_on_windows(scheme, lm, (32, 32), 1, window_axes(windows, (32, 32)))
    assert grid == (8, 8)
    tracker.pool("mean", 0)
    ours, expected = tracker.finish(), _pixel_start(scheme, lm, windows, 1)
    assert_close(ours.target, expected.target, rtol=1e-6, atol=1e-6)
    assert (ours.target - lm.image_targets()).abs().max() > 1e-3  # the stem's borders move the pooled target
    if kind == "token_targets":
        assert ours.token_target is not None and expected.token_target is not None
        assert_close(ours.token_target, expected.token_target, rtol=1e-6, atol=1e-6)


def test_token_targets_refuse_pixel_windows() -> None:
    lm = TokenLabelMap.unmixed(torch.tensor([0, 1]), 3, (8, 8)).with_token_targets(torch.rand(2, 4, 4, 3).softmax(-1))
    rows, cols = chain_matrices((8, 8), (axis_windows((3, 3), (2, 2), (1, 1)),), True, torch.device("cpu"))
    layout = TokenLayout(grid=(4, 4), num_prefix=0, depth=1, class_token=False, pixel_windows=(rows, cols))
    with pytest.raises(ValueError, match="token targets .* cannot start on a layout's pixel_windows"):
        TokenLabeling().start(lm, layout)
    NoAlign().start(lm, layout)  # a scheme that tracks nothing never asks


@pytest.mark.parametrize("name", ["resnet", "pvt_v2", "efficientnet"])
def test_box_mask_fast_path_equals_reference(name: str) -> None:
    """CutMix's box masks take the ``pixel_windows`` route in the fast path; the reference starts on the pixels."""
    from mixlabels.backbones import FAMILIES

    model = sharpen(next(f for f in FAMILIES if f.name == name).example()).train()
    g = torch.Generator().manual_seed(2)
    boxes = torch.tensor([[3, 20, 5, 30], [0, 32, 0, 9], [10, 17, 4, 25], [7, 30, 11, 13]])
    lm = TokenLabelMap.from_boxes(boxes, (32, 32), torch.tensor([1, 2, 3, 0]), torch.randint(0, 10, (4,), generator=g), num_classes=10)
    images = lm.mix_pixels(torch.randn(4, 3, 32, 32, generator=g))
    torch.manual_seed(0)
    fast = adapt(model, TLAlign())(images, lm)
    torch.manual_seed(0)
    ref = adapt(model, TLAlign(), reference=True)(images, lm)
    assert_close(fast.target, ref.target, rtol=1e-5, atol=1e-5)
    assert (fast.target - lm.image_targets()).abs().max() > 1e-3


@pytest.mark.parametrize("grid, k, pad, dil", [((7, 7), 3, 1, 1), ((4, 4), 3, 1, 1), ((8, 8), 5, 4, 2), ((5, 9), 7, 3, 1), ((14, 14), 3, 1, 1)])
def test_conv_mix_small_grids_equal_the_conv_and_the_explicit_matrix(
    grid: tuple[int, int], k: int, pad: int, dil: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small grids take the cached tap matrices, large ones the depthwise conv: both equal ``conv_matrix``."""
    from mixlabels.backbones import _common
    from mixlabels.backbones._dense import conv_matrix, row_normalise

    g = torch.Generator().manual_seed(k)
    labels, kernel = torch.rand(3, grid[0] * grid[1], 2, generator=g), torch.rand(k, k, generator=g)
    dense = _common.conv_mix(labels, grid, kernel, (pad, pad), (dil, dil))
    matrix, _ = conv_matrix(grid, kernel.double(), padding=(pad, pad), dilation=(dil, dil))
    assert_close(dense.double(), row_normalise(matrix) @ labels.double(), rtol=1e-6, atol=1e-7)
    small = grid[0] * grid[1] <= _common._DENSE_CONV_TOKENS
    monkeypatch.setattr(_common, "_DENSE_CONV_TOKENS", 0 if small else 10**6)  # the other route
    assert_close(_common.conv_mix(labels, grid, kernel, (pad, pad), (dil, dil)), dense)


def test_a_conv_chain_equals_the_product_of_its_explicit_matrices() -> None:
    """``conv_chain`` (one layout change for a run of convs) against ``Norm(T_3) Norm(T_2) Norm(T_1)`` in float64,
    with kernels of three shapes, paddings and a dilation."""
    from mixlabels.backbones import _common
    from mixlabels.backbones._dense import conv_matrix, row_normalise

    g, grid = torch.Generator().manual_seed(3), (9, 11)
    labels = torch.rand(2, grid[0] * grid[1], 3, generator=g)
    steps = [(torch.rand(3, 3, generator=g), (1, 1), (1, 1)), (torch.rand(1, 5, generator=g), (0, 2), (1, 1)),
             (torch.rand(3, 3, generator=g), (2, 2), (2, 2))]
    expected = labels.double()
    for kernel, padding, dilation in steps:
        expected = row_normalise(conv_matrix(grid, kernel.double(), padding=padding, dilation=dilation)[0]) @ expected
    assert_close(_common.conv_chain(labels, grid, steps).double(), expected, rtol=1e-6, atol=1e-7)


def test_label_kernels_of_many_shapes_equal_each_weights_own() -> None:
    """``label_kernels`` reduces weights of one tap count together (a stack per shape, or rows of every shape
    normalised together and a mean per shape): every result equals ``kernel_labels`` of that weight alone, in the
    order given. No ``segment_reduce``: its CUDA kernel reduces each segment in one thread (a 512x512 conv's
    262144 rows in sequence, milliseconds a step)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from mixlabels.backbones._common import kernel_labels, label_kernels

    g = torch.Generator().manual_seed(0)
    shapes = [(8, 4, 3, 3), (16, 8, 3, 3), (8, 4, 3, 3), (4, 1, 7, 7), (6, 2, 3, 3), (5, 5, 1, 5), (4, 1, 7, 7)]
    weights = [torch.randn(*shape, generator=g) for shape in shapes]
    weights[1][3, 2] = 0.0  # an all-zero (o, i) slice: its taps add nothing

    class Ops(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.add(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        kernels = label_kernels(weights)
    assert "mean.dim" in ops.seen and not any(op.startswith("segment_reduce") for op in ops.seen)
    for got, w in zip(kernels, weights, strict=True):
        assert got.shape == w.shape[-2:]
        assert_close(got, kernel_labels(w), rtol=1e-6, atol=1e-7)
    assert_close(label_kernels(weights[:1])[0], kernel_labels(weights[0]))


@pytest.mark.parametrize("widths", [(8, 16, 8, 24, 32, 16, 40, 48, 56), (8, 16, 24), (8, 16, 8, 24, 32, 40, 48)])
def test_label_kernels_of_depthwise_and_dense_mixes_equal_each_weights_own(widths: tuple[int, ...]) -> None:
    """Depthwise weights of many widths share ``(1, kh, kw)`` and are concatenated along ``o`` (``_tap_rows``' third
    way), mixed with dense ones of several shapes, in an order that interleaves them: each result is still its own
    weight's ``kernel_labels``, in the order given."""
    from mixlabels.backbones._common import kernel_labels, label_kernels

    g = torch.Generator().manual_seed(1)
    shapes = [(c, 1, 3, 3) for c in widths]
    shapes[1:1] = [(8, 4, 3, 3), (16, 2, 3, 3)]
    shapes.append((8, 4, 3, 3))
    weights = [torch.randn(*shape, generator=g) for shape in shapes]
    for got, w in zip(label_kernels(weights), weights, strict=True):
        assert_close(got, kernel_labels(w), rtol=1e-6, atol=1e-7)


def _same_module(kind: str, kernel: tuple[int, int], stride: tuple[int, int]) -> torch.nn.Module:
    """timm's TF 'same' module with an all-ones kernel: its output at a position is positive exactly where a
    one-hot input lies in that position's window."""
    if kind == "avg":
        return AvgPool2dSame(kernel, stride)
    if kind == "max":
        return MaxPool2dSame(kernel, stride)
    conv = Conv2dSame(1, 1, kernel, stride, bias=False)
    torch.nn.init.ones_(conv.weight)
    return conv


@pytest.mark.parametrize("kind", ["conv", "avg", "max"])
@pytest.mark.parametrize("kernel, stride", [((3, 3), (2, 2)), ((2, 2), (2, 2)), ((5, 3), (2, 3)), ((4, 4), (2, 2)), ((1, 1), (2, 2)), ((3, 3), (1, 2))])
@pytest.mark.parametrize("grid", [(16, 16), (15, 15), (30, 31), (7, 10)])
def test_same_windows_equal_timm_modules(kind: str, kernel: tuple[int, int], stride: tuple[int, int], grid: tuple[int, int]) -> None:
    """A 'same' window's resolved windows, output grid, explicit matrix and separable chain are the positions that
    feed each output of timm's own Conv2dSame / AvgPool2dSame / MaxPool2dSame (one one-hot input per position)."""
    n = grid[0] * grid[1]
    with torch.no_grad():
        out = _same_module(kind, kernel, stride)(torch.eye(n).reshape(n, 1, *grid))  # input position, 1, i, j
    brute = (rearrange(out, "n 1 i j -> (i j) n") > 0).double()
    w = Window(kernel, stride, (0, 0), same=True)
    assert w.out_grid(grid) == tuple(out.shape[-2:])
    (kh, sh, top, bottom, _), (kw, sw, left, right, _) = w.axes(grid)
    assert (top + bottom) % 2 == 0 or bottom == top + 1  # the odd unit goes after, as pad_same does
    ref, ref_grid = path_matrix((w,), grid)
    assert ref_grid == w.out_grid(grid)
    assert_close((ref > 0).double(), brute, rtol=0, atol=0)
    rows, cols = chain_matrices(grid, (w.axes(grid),), False, torch.device("cpu"))
    assert_close(torch.kron(rows, cols).double(), brute, rtol=0, atol=0)
    y = torch.rand(2, n, 3, generator=torch.Generator().manual_seed(0))
    ours, _ = apply_path((w,), y, grid)
    assert_close(ours.double(), ref @ y.double(), rtol=1e-5, atol=1e-6)


def test_same_padding_is_asymmetric_where_tested() -> None:
    """The cases above include asymmetric padding (else the brute-force comparison could not tell 'same' from
    symmetric padding): a 3x3/2 window pads a 16 grid by 0 before and 1 after; a 31 grid's 4x4/2 by 1 and 2."""
    assert Window((3, 3), (2, 2), (0, 0), same=True).axes((16, 15))[0][2:4] == (0, 1)
    assert Window((4, 4), (2, 2), (0, 0), same=True).axes((31, 31))[0][2:4] == (1, 2)
    assert Window((3, 3), (2, 2), (0, 0), same=True).axes((16, 15))[1][2:4] == (1, 1)


def test_same_window_chain_equals_timm_modules() -> None:
    """A chain of 'same' windows resolves each on the grid it receives (15 -> 8 -> 4): as timm's modules run."""
    grid = (15, 30)
    modules = [_same_module("conv", (3, 3), (2, 2)), _same_module("max", (3, 3), (2, 2)), _same_module("avg", (2, 2), (2, 2))]
    path = tuple(Window(tuple(m.kernel_size), tuple(m.stride), (0, 0), same=True) for m in modules)  # type: ignore[arg-type]
    n = grid[0] * grid[1]
    x = torch.eye(n).reshape(n, 1, *grid)
    with torch.no_grad():
        for m in modules:
            x = m(x)
    ref, out = path_matrix(path, grid)
    assert out == tuple(x.shape[-2:]) == (2, 4)
    assert_close((ref > 0).double(), (rearrange(x, "n 1 i j -> (i j) n") > 0).double(), rtol=0, atol=0)
    y = torch.rand(2, n, 3, generator=torch.Generator().manual_seed(1))
    assert_close(apply_path(path, y, grid)[0].double(), ref @ y.double(), rtol=1e-5, atol=1e-6)


def test_window_routes_benchmark_times_both_routes_and_names_the_one_taken() -> None:
    """benchmarks/window_routes.py (the figures behind ``window_route``'s thresholds): the three routes give the
    same labels (it checks), each timed, and the route named is the one ``apply_path`` takes."""
    from benchmarks import window_routes
    from mixlabels.backbones._windows import window_route

    rows = window_routes.main(["--batch-sizes", "1", "64", "--rounds", "1", "--calls", "1"])
    assert [(r.grid, r.batch) for r in rows] == [(g, b) for g in window_routes.GRIDS for b in (1, 64)]
    assert all(r.dense_ms > 0 and r.separable_ms > 0 and r.pooled_ms > 0 and r.route == window_route(r.batch, r.grid, r.out)
               for r in rows)
    assert {r.route for r in rows} == {"pooled", "separable"}


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_kernel_labels_of_a_large_weight_equal_float64(layout: str) -> None:
    """A weight of ``_LARGE_WEIGHT`` elements or more (a classifier head written as a 7x7 conv) is averaged in two sums,
    over output channels and then input channels (a channels-last one by the one mean), a weight one output channel
    smaller by the one mean: each equals its float64 ``mean_{o,i}(|K_oi| / sum|K_oi|)`` to fp32 rounding (the two
    sums: 1e-7 of the largest tap)."""
    from mixlabels.backbones._common import _LARGE_WEIGHT, kernel_labels

    g = torch.Generator().manual_seed(3)
    w = torch.randn(_LARGE_WEIGHT // (64 * 49) + 1, 64, 7, 7, generator=g)
    assert w.numel() >= _LARGE_WEIGHT and w[1:].numel() < _LARGE_WEIGHT
    if layout == "channels_last":
        w = w.contiguous(memory_format=torch.channels_last)
    for weight in (w, w[1:]):
        k = weight.double().abs()
        want = (k / k.sum(dim=(-2, -1), keepdim=True)).mean(dim=(0, 1))
        got = kernel_labels(weight)
        assert got.dtype == torch.float32 and got.shape == (7, 7)
        # a channels-last weight's one mean (reduced in its own order) lands 1.2e-6 of the largest tap from float64
        assert_close(got.double(), want, rtol=0.0, atol=(5e-7 if layout == "contiguous" else 3e-6) * float(want.max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_labels_of_a_large_cpu_weight_in_chunks_equal_float64(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a large weight is read in chunks of output channels through one reused buffer
    (``_chunked_pair_mean``: fresh memory for the whole ``|K|`` every step costs more in page faults than its
    arithmetic). Chunks of 100 output channels, the last one short (1338 = 13 x 100 + 38), a bf16 weight too: each
    equals its float64 ``mean_{o,i}(|K_oi| / sum|K_oi|)`` to fp32 rounding, and so does ``_CHUNK``'s own split (83
    output channels a chunk)."""
    from mixlabels.backbones import _common

    g = torch.Generator().manual_seed(4)
    w = torch.randn(_common._LARGE_WEIGHT // (64 * 49) + 1, 64, 7, 7, generator=g).to(dtype)
    assert w.shape[0] == 1338
    k = w.double().abs()
    want = (k / k.sum(dim=(-2, -1), keepdim=True)).mean(dim=(0, 1))
    whole = _common.kernel_labels(w)  # chunks of _CHUNK elements: 83 output channels each (64 x 49 taps a channel)
    monkeypatch.setattr(_common, "_CHUNK", 100 * 64 * 49)
    got = _common.kernel_labels(w)
    assert got.dtype == torch.float32 and got.shape == (7, 7)
    # within 6e-8 on any number of threads (the chunks' per-channel products); one product over a chunk's thousands
    # of rows (a matrix-vector product's fp32 sum) landed 2.4e-7 away on 2 threads, 6e-7 on one
    for chunks in (got, whole):
        assert_close(chunks.double(), want, rtol=0.0, atol=1.5e-7 * float(want.max()))


def test_label_kernels_of_large_cpu_weights_go_weight_by_weight_with_the_same_bits() -> None:
    """On the CPU the stride-1 convs of one tap count totalling ``_SEPARATE_WEIGHTS`` elements or more are reduced
    weight by weight (a ResNet's 3x3 convs: their stack and concatenation were two copies of the weights in fresh
    memory every step, 29 ms of ResNetV2-18's 3x3 labels against 12 to 17 without). No stack or concatenation is
    dispatched then; ``launch_routes`` (what ``benchmarks/op_count.py`` counts: a GPU's route) keeps them. Weight by
    weight is the nearer float64 (each weight's own mean: 1e-8 here, where the concatenated rows' means are up to
    6e-7 off; for ResNet-18's and Res2Net-50's convs the two routes give the same bits)."""
    from benchmarks._op_counter import OpCounter
    from mixlabels.backbones._common import _SEPARATE_WEIGHTS, label_kernels, launch_routes
    from mixlabels.backbones._dense import kernel_reference

    g = torch.Generator().manual_seed(5)
    shapes = [(64, 64, 3, 3), (128, 128, 3, 3), (128, 64, 3, 3), (256, 256, 3, 3), (64, 64, 3, 3), (256, 256, 3, 3)]
    weights = [torch.randn(*shape, generator=g) for shape in shapes]
    assert sum(w.numel() for w in weights) >= _SEPARATE_WEIGHTS > sum(w.numel() for w in weights[:3])

    with OpCounter() as apart:
        kernels = label_kernels(weights)
    with launch_routes(), OpCounter() as together:
        grouped = label_kernels(weights)
    assert not {"cat", "stack"} & set(apart.ops) and {"cat", "stack"} & set(together.ops)
    assert sum(together.ops.values()) < sum(apart.ops.values())
    small = label_kernels(weights[:3])  # under the threshold: concatenated on the CPU too
    for got, same, w in zip(kernels, grouped, weights, strict=True):
        assert_close(got.double(), kernel_reference(w), rtol=0.0, atol=5e-8)  # each weight's own mean: 1e-8 here
        assert_close(same, got, rtol=0.0, atol=1e-6)  # the concatenated rows' means: up to 6e-7 here
    for got, want in zip(small, kernels[:3], strict=True):
        assert_close(got, want, rtol=0.0, atol=1e-6)


def test_label_kernels_of_many_long_shapes_average_runs_of_rows_then_weights() -> None:
    """Weights of one tap count whose rows are too many for one product with the per-weight mean matrix (a ResNet's
    3x3 convs on a GPU's route: 1.5M rows, 13 weights) average runs of ``gcd`` rows first, then each weight its runs
    by one product: no mean per shape, four operators where those took eleven (four shapes here), and each result
    within float rounding of its weight's own float64 kernel. Weights whose rows share no long run keep the means per
    shape."""
    from benchmarks._op_counter import OpCounter
    from mixlabels.backbones._common import _MEAN_MATRIX_ENTRIES, label_kernels, launch_routes
    from mixlabels.backbones._dense import kernel_reference

    g = torch.Generator().manual_seed(6)
    shapes = [(64, 64, 3, 3), (128, 128, 3, 3), (256, 128, 3, 3), (256, 256, 3, 3), (64, 64, 3, 3), (256, 256, 3, 3)]
    weights = [torch.randn(*shape, generator=g) for shape in shapes]
    weights[3][7, 5] = 0.0  # an all-zero (o, i) slice: its taps add nothing
    rows = sum(w.shape[0] * w.shape[1] for w in weights)
    assert len(weights) * rows > _MEAN_MATRIX_ENTRIES  # the per-weight mean matrix would be too large
    with launch_routes(), OpCounter() as ops:
        kernels = label_kernels(weights)
    assert ops.ops.get("mean", 0) == 1 and "split_with_sizes" not in ops.ops, ops.ops
    for got, w in zip(kernels, weights, strict=True):
        assert_close(got.double(), kernel_reference(w), rtol=0.0, atol=1e-7)  # 2e-8 at most seen, as per shape
    odd = [torch.randn(*shape, generator=g) for shape in [(97, 89, 3, 3), (101, 83, 3, 3)] * 6]  # rows: coprime
    assert len(odd) * sum(w.shape[0] * w.shape[1] for w in odd) > _MEAN_MATRIX_ENTRIES
    with launch_routes(), OpCounter() as per_shape:
        odd_kernels = label_kernels(odd)
    assert per_shape.ops.get("mean", 0) == 2 and "split_with_sizes" in per_shape.ops  # gcd 1: a mean per shape
    for got, w in zip(odd_kernels, odd, strict=True):
        assert_close(got.double(), kernel_reference(w), rtol=0.0, atol=1e-7)  # 2e-8 at most seen, as per shape


def test_label_kernels_gather_weights_by_fewest_launches_where_every_operator_is_one() -> None:
    """Where every operator is a launch (``launch_routes``), the tap rows of weights of several shapes (ResNet-18's
    3x3 convs of seven shapes, scaled down) are gathered by a view per weight and one concatenation: one
    launch, not a concatenation per shared ``(i, kh, kw)`` and one of those (four here; fewer operators dispatched,
    which the CPU's eager route keeps). Both give each weight its own kernel."""
    from benchmarks._op_counter import OpCounter
    from mixlabels.backbones._common import label_kernels, launch_routes
    from mixlabels.backbones._dense import kernel_reference

    g = torch.Generator().manual_seed(7)
    shapes = [(16, 16, 3, 3)] * 4 + [(32, 16, 3, 3)] + [(32, 32, 3, 3)] * 3 + [(64, 32, 3, 3)] + [(64, 64, 3, 3)] * 2
    weights = [torch.randn(*shape, generator=g) for shape in shapes]
    with launch_routes(), OpCounter() as launch:
        on_launches = label_kernels(weights)
    with OpCounter() as cpu:
        on_cpu = label_kernels(weights)
    assert "stack" not in launch.ops and launch.ops["cat"] == 1, launch.ops
    # the control: the fewest dispatched, the weights sharing an (i, kh, kw) concatenated along o (three such
    # tails here) and the three concatenations concatenated
    assert "stack" not in cpu.ops and cpu.ops["cat"] == 4, cpu.ops
    for got, again, w in zip(on_launches, on_cpu, weights, strict=True):
        assert_close(got.double(), kernel_reference(w), rtol=0.0, atol=5e-7)  # fp32 means of 256-4096 rows: 1.2e-7 seen
        assert_close(again.double(), kernel_reference(w), rtol=0.0, atol=5e-7)


def test_as_grid_of_as_tokens_is_the_grid_view_itself() -> None:
    """``as_grid(as_tokens(y), grid)`` returns ``y`` (no view dispatched): the same values, strides and storage as the
    view it would take; another grid of as many positions, or tokens not made from a grid, take their own view."""
    from mixlabels.backbones._windows import as_grid, as_tokens

    labels = torch.rand(2, 12, 5, generator=torch.Generator().manual_seed(0))
    y = F.avg_pool2d(as_grid(labels, (3, 4)), 1)  # a pool's output, as the walk's ops leave it
    tokens = as_tokens(y)
    assert torch.equal(tokens, rearrange(y, "b l h w -> b (h w) l"))
    assert as_grid(tokens, (3, 4)) is y
    fresh = tokens.as_strided(tokens.shape, tokens.stride())  # the same view, without the link: what it would take
    viewed = as_grid(fresh, (3, 4))
    assert viewed is not y and viewed.stride() == y.stride() and viewed.data_ptr() == y.data_ptr() and torch.equal(viewed, y)
    other = as_grid(tokens, (4, 3))  # as many positions on another grid: a view of its own
    assert other.shape == (2, 5, 4, 3) and torch.equal(other, rearrange(tokens, "b (h w) l -> b l h w", h=4))
