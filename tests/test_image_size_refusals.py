"""Images of a size the model was not built for are refused with a clear error, not a tensor-shape crash.

MaxxViT's relative position biases, MViTv2's relative position tables, VOLO's position embedding and the hybrid
ViTs' (ViT-hybrid, ViTamin: ``HybridEmbed`` has no size assertion) are sized from ``img_size`` at construction. The
bare timm model fed other images fails deep inside (``The size of tensor a (8) must match ...``, an ``IndexError``
in ``cal_rel_pos_type``); the adapters now say which size the model was built for and how to get another.
The families whose patch embedding asserts the size itself (ViT, Swin, ...) keep timm's clear message.
"""

from __future__ import annotations

import pytest
import torch

from mixlabels import TLAlign, TokenLabelMap, backbones

FAMILIES = {f.name: f for f in backbones.FAMILIES}


def _batch(h: int, w: int) -> tuple[torch.Tensor, TokenLabelMap]:
    mask = torch.ones(2, h, w)
    mask[0, 4:20, 6:26] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([3, 7]), num_classes=10)
    return lm.mix_pixels(torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(1))), lm


@pytest.mark.parametrize(
    ("family", "says"),
    [
        ("maxxvit", "relative position bias is for"),
        ("mvitv2", "relative positions along the"),
        ("volo", "position embedding, which is 4x4"),
        ("vit_hybrid", "position embedding is for 4x4"),
        ("vitamin", "position embedding is for 2x2"),
    ],
)
@pytest.mark.parametrize("size", [(32, 64), (64, 64)])
@pytest.mark.parametrize("reference", [False, True])
def test_an_image_size_the_model_was_not_built_for_is_refused_clearly(
    family: str, says: str, size: tuple[int, int], reference: bool
) -> None:
    model = FAMILIES[family].example().train()  # built for 32x32 images
    images, lm = _batch(*size)
    adapted = backbones.adapt(model, TLAlign(), reference=reference)
    with pytest.raises(ValueError, match=says) as err:
        adapted(images, lm)
    assert "img_size" in str(err.value)
    images, lm = _batch(32, 32)  # the size it was built for trains
    assert torch.isfinite(adapted(images, lm).target).all()
