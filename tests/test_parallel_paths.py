"""``_convnet.Parallel``: branches joined by channel count (a concatenation) or equally (a sum), in both walks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from mixlabels.backbones._convnet import Parallel, Window, apply_path, path_convs, path_grid, path_matrix


def _conv(k: int, seed: int) -> nn.Conv2d:
    torch.manual_seed(seed)
    return nn.Conv2d(4, 4, k, padding=k // 2)


def test_concatenation_is_the_channel_weighted_mean_of_its_branches() -> None:
    grid, conv3, conv5 = (6, 5), _conv(3, 0), _conv(5, 1)
    labels = torch.rand(2, 30, 7).softmax(-1)
    joined = Parallel.concat([(), (conv3,), (conv3, conv5)], [8, 2, 6])
    fast, out = apply_path((joined,), labels, grid)
    # by hand, from each branch alone (the conv rule is tested elsewhere): 8/16 Y + 2/16 P3 Y + 6/16 P5 P3 Y
    p3, p35 = apply_path((conv3,), labels, grid)[0], apply_path((conv3, conv5), labels, grid)[0]
    assert_close(fast, (8 * labels + 2 * p3 + 6 * p35) / 16)
    assert out == grid and path_grid((joined,), grid) == grid
    m, _ = path_matrix((joined,), grid)
    assert_close(m.sum(-1), torch.ones(30, dtype=torch.float64))
    assert_close(torch.einsum("mn,bnl->bml", m.float(), labels), fast, rtol=1e-5, atol=1e-6)


def test_sum_weighs_branches_equally_and_windows_change_the_grid() -> None:
    grid, conv = (8, 8), _conv(3, 2)
    labels = torch.rand(3, 64, 5).softmax(-1)
    pool = Window((3, 3), (2, 2), (1, 1))
    joined = Parallel.sum([(pool,), (conv, pool)])
    fast, out = apply_path((joined, conv), labels, grid)
    a, b = apply_path((pool,), labels, grid)[0], apply_path((conv, pool), labels, grid)[0]
    assert out == (4, 4)
    assert_close(fast, apply_path((conv,), (a + b) / 2, (4, 4))[0])
    m, _ = path_matrix((joined, conv), grid)
    assert_close(torch.einsum("mn,bnl->bml", m.float(), labels), fast, rtol=1e-5, atol=1e-6)
    assert list(path_convs((joined, conv))) == [conv, conv]


def test_branches_ending_on_different_grids_are_refused() -> None:
    joined = Parallel.sum([(), (Window((2, 2), (2, 2), (0, 0)),)])
    with pytest.raises(ValueError, match=r"parallel branches end on different grids \[\(2, 2\), \(4, 4\)\]"):
        apply_path((joined,), torch.rand(1, 16, 3), (4, 4))
    with pytest.raises(ValueError, match="one weight per branch"):
        Parallel(((),), (1.0, 2.0))
