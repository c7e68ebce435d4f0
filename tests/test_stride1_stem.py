"""A stem that keeps the pixel grid (VGG's first conv, DarkNet's and CSPDarkNet's stride-1 stem conv) still mixes the
labels by its conv's rule: the labels start on the pixels, and a stride-1 ``kxk`` conv mixes them by its normalised
|kernel|, as every later one does.

The adapters took ``start == grid`` (the labels' first grid is the stem's) for a token-space map, which MixToken has
already mixed, and left such a stem's conv out on both paths: VGG's targets were off by up to 2e-3, CSPNet's by 7e-3
(its token targets by 5e-2), and the fast path still agreed with the reference, which did the same.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixlabels import TLAlign, TokenLabelMap, backbones

FAMILIES = {f.name: f for f in backbones.FAMILIES}


def _stem_conv(family: str, model: nn.Module) -> nn.Conv2d:
    m: object = model
    conv = m.features[0] if family == "vgg" else m.stem.conv1.conv  # type: ignore[attr-defined]
    assert isinstance(conv, nn.Conv2d) and conv.stride == (1, 1) and conv.kernel_size == (3, 3)
    return conv


def _targets(family: str, corner: float, reference: bool) -> torch.Tensor:
    """The family's TL-Align target with every (out, in) kernel of the stem conv its centre tap 1 and its top-left
    tap ``corner``, the rest zero (a lone off-centre tap would leave border positions no in-grid tap)."""
    torch.manual_seed(0)
    model = FAMILIES[family].example().train()
    conv = _stem_conv(family, model)
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[:, :, 1, 1] = 1.0
        conv.weight[:, :, 0, 0] = corner
    mask = torch.ones(2, 32, 32)
    mask[0, 4:20, 6:26] = 0.0
    mask[1, 10:30, 0:13] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([3, 7]), num_classes=10)
    images = lm.mix_pixels(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
    adapted = backbones.adapt(model, TLAlign(), reference=reference)
    torch.manual_seed(0)
    target: torch.Tensor = adapted(images, lm).target
    return target.double()


@pytest.mark.parametrize("family", ["vgg", "cspnet"])
def test_the_stem_conv_moves_the_labels(family: str) -> None:
    """A stem conv reading its top-left neighbour three times as much as its centre moves every pixel's label three
    quarters of the way to the position below and right of it: the targets differ from a centre-only stem's (which
    keeps the labels), on both paths alike; a stem left out gives the same targets for both kernels."""
    centre, corner = _targets(family, 0.0, False), _targets(family, 3.0, False)
    assert (centre - corner).abs().max() > 1e-4
    torch.testing.assert_close(corner, _targets(family, 3.0, True), atol=1e-6, rtol=0)
    torch.testing.assert_close(centre, _targets(family, 0.0, True), atol=1e-6, rtol=0)
