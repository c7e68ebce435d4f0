"""Weight-standardised convs (timm's ``StdConv2d``, ``ScaledStdConv2d``): the weight their forward convolves with,
and the label kernel both walks read from it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.layers import ScaledStdConv2d, StdConv2d
from torch import nn
from torch.testing import assert_close

from mixlabels.backbones._common import effective_weight
from mixlabels.backbones._convnet import apply_path, path_matrix, path_of


@pytest.mark.parametrize("cls", [StdConv2d, ScaledStdConv2d])
def test_effective_weight_is_what_the_forward_convolves_with(cls: type[nn.Conv2d]) -> None:
    torch.manual_seed(0)
    conv = cls(4, 6, 3, stride=2, groups=2)
    with torch.no_grad():
        conv.weight.add_(0.5)  # a mean per output channel, which standardisation removes
        if isinstance(conv, ScaledStdConv2d):
            conv.gain.uniform_(-2.0, 2.0)
    x = torch.randn(2, 4, 9, 7)
    w = effective_weight(conv)
    assert not w.requires_grad
    assert_close(F.conv2d(x, w, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups), conv(x))
    # by hand, in float64: each output channel standardised over (in, kh, kw), then scaled by gain * scale
    raw = conv.weight.detach().double()
    mean, var = raw.mean(dim=(1, 2, 3), keepdim=True), raw.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
    by_hand = (raw - mean) / (var + conv.eps).sqrt()  # type: ignore[operator]
    if isinstance(conv, ScaledStdConv2d):
        by_hand = by_hand * conv.gain.detach().double() * conv.scale
    assert_close(w.double(), by_hand, rtol=1e-5, atol=1e-6)


def test_label_kernel_is_read_from_the_standardised_weight() -> None:
    """A stride-1 StdConv2d mixes labels by the kernel of ``w - mean``: both walks, not that of ``|w|``."""
    torch.manual_seed(0)
    conv = StdConv2d(2, 3, 3)
    with torch.no_grad():
        conv.weight.add_(0.5)
    y = torch.rand(2, 12, 4).softmax(-1)
    got, _ = apply_path(path_of([conv]), y, (3, 4))
    plain = nn.Conv2d(2, 3, 3, padding=1, bias=False)
    with torch.no_grad():
        plain.weight.copy_(effective_weight(conv))
    assert_close(got, apply_path(path_of([plain]), y, (3, 4))[0])
    assert_close(path_matrix(path_of([conv]), (3, 4))[0].float() @ y, got)
    with torch.no_grad():
        plain.weight.copy_(conv.weight)  # the raw weight's kernel: another mix
    assert (apply_path(path_of([plain]), y, (3, 4))[0] - got).abs().max() > 1e-3
