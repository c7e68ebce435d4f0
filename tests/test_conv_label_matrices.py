"""``Kernels.matrix``: a small grid's conv label mixes, built for every conv of one kernel shape and geometry at once,
held against the explicit float64 matrix of each conv (``_dense.conv_matrix``, renormalised over its in-grid taps)."""

from __future__ import annotations

import torch
from torch import nn
from torch.testing import assert_close

from mixlabels.backbones._common import kernel_labels
from mixlabels.backbones._convnet import Kernels
from mixlabels.backbones._dense import conv_matrix, row_normalise


def test_every_conv_gets_its_own_renormalised_tap_matrix_built_once_per_grid() -> None:
    torch.manual_seed(0)
    plain = [nn.Conv2d(4, 6, 3, padding=1) for _ in range(5)]
    dilated = [nn.Conv2d(6, 4, 3, padding=2, dilation=2) for _ in range(5)]  # the same shape, another geometry
    lone = nn.Conv2d(4, 4, 5, padding=2)
    kernels = Kernels([*plain, *dilated, lone])
    for grid in ((5, 6), (3, 3)):
        for conv in [*plain, *dilated]:
            m = kernels.matrix(conv, grid)
            assert m is not None
            kernel = kernel_labels(conv.weight.detach()).double()
            ref, _ = conv_matrix(grid, kernel, padding=(conv.padding[0], conv.padding[1]), dilation=(conv.dilation[0], conv.dilation[1]))
            assert m.shape == (grid[0] * grid[1],) * 2
            assert_close(m.double(), row_normalise(ref), atol=2.5e-7, rtol=0)  # fp32: two units in the last place of 1
            assert kernels.matrix(conv, grid) is m  # one build per grid and shape
    assert kernels.matrix(lone, (5, 6)) is None  # alone of its shape: ``conv_chain`` builds its own
    assert kernels.matrix(nn.Conv2d(4, 4, 3, padding=1), (5, 6)) is None  # not a conv of this forward
