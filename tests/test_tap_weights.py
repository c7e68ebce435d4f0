"""A label conv's in-grid tap weights by the axes' products (``backbones._common.tap_weights``).

Every route divides a label conv by its in-grid tap weight: at each output position, the sum of the kernel's taps
that read inside the grid. The CPU's eager route computes it as ``R K C^T`` from the axes' 0/1 reads; the reference
here is the convolution of ones every other route takes, and an explicit loop over taps for the definition itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from mixlabels._routes import launch_routes
from mixlabels.backbones._common import tap_weights

CASES = [
    # kernels (g, kh, kw), grid, padding, dilation
    ((12, 7, 7), (56, 56), (3, 3), (1, 1)),  # StarNet's / ConvNeXt's depthwise 7x7, 'same'
    ((8, 3, 3), (14, 9), (1, 1), (1, 1)),  # a rectangular grid
    ((3, 1, 9), (28, 28), (0, 4), (1, 1)),  # InceptionNeXt's band kernels
    ((3, 9, 1), (28, 20), (4, 0), (1, 1)),
    ((2, 3, 3), (17, 17), (2, 2), (2, 2)),  # dilated 'same'
    ((4, 5, 5), (7, 7), (1, 1), (1, 1)),  # not 'same': the grid shrinks to 5x5
    ((1, 5, 3), (4, 6), (2, 1), (1, 1)),  # a kernel taller than half the grid
    ((5, 3, 3), (1, 1), (1, 1), (1, 1)),  # a single position: only the centre tap reads inside
]


def _by_taps(kernels: torch.Tensor, grid: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]) -> torch.Tensor:
    """The definition: every tap whose read lies inside the grid, added at every output position (float64)."""
    g, kh, kw = kernels.shape
    oh = grid[0] + 2 * padding[0] - dilation[0] * (kh - 1)
    ow = grid[1] + 2 * padding[1] - dilation[1] * (kw - 1)
    out = torch.zeros(g, oh, ow, dtype=torch.float64)
    for i in range(oh):
        for j in range(ow):
            for a in range(kh):
                for b in range(kw):
                    y, x = i - padding[0] + a * dilation[0], j - padding[1] + b * dilation[1]
                    if 0 <= y < grid[0] and 0 <= x < grid[1]:
                        out[:, i, j] += kernels[:, a, b].double()
    return out.unsqueeze(0)


@pytest.mark.parametrize("shape, grid, padding, dilation", CASES)
def test_equals_the_convolution_of_ones_and_the_definition(shape, grid, padding, dilation) -> None:  # type: ignore[no-untyped-def]
    g, kh, kw = shape
    kernels = torch.rand(shape, generator=torch.Generator().manual_seed(g * 100 + kh * 10 + kw))
    kernels = kernels / kernels.sum(dim=(1, 2), keepdim=True)  # label kernels: distributions over the taps
    got = tap_weights(kernels.unsqueeze(1), grid, padding, dilation)
    ones = torch.ones(1, 1, *grid)
    conv = F.conv2d(ones, kernels.unsqueeze(1), padding=padding, dilation=dilation)
    assert got.shape == conv.shape and got.dtype == torch.float32
    assert_close(got, conv, rtol=0, atol=3e-7)
    assert_close(got.double(), _by_taps(kernels, grid, padding, dilation), rtol=0, atol=3e-7)


def test_other_routes_keep_the_convolution_of_ones() -> None:
    """Where every operator is a launch (a GPU's route, ``launch_routes``) and where fp32 products would round (a
    bf16 matmul precision), the convolution of ones itself, to the bit."""
    kernels = torch.rand(6, 1, 5, 5, generator=torch.Generator().manual_seed(0))
    want = F.conv2d(torch.ones(1, 1, 20, 20), kernels, padding=(2, 2))
    with launch_routes():
        assert torch.equal(tap_weights(kernels, (20, 20), (2, 2), (1, 1)), want)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert torch.equal(tap_weights(kernels, (20, 20), (2, 2), (1, 1)), want)
    finally:
        torch.set_float32_matmul_precision(before)


def test_fp32_under_a_bf16_autocast() -> None:
    """Called outside any fp32 region under a bf16 autocast (as ``Kernels.mass`` may be): fp32 products, the values
    without autocast (a bf16 tap weight would leave every divided row 3 digits off summing to 1)."""
    kernels = torch.rand(4, 1, 7, 7, generator=torch.Generator().manual_seed(1))
    want = tap_weights(kernels, (24, 24), (3, 3), (1, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tap_weights(kernels, (24, 24), (3, 3), (1, 1))
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
