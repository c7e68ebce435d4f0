"""A conv whose weight is all zeros reads nothing: its label kernel is the identity (the labels stay), not 0 / 0.

timm's ``zero_init_last`` zeroes ResNetV2's basic blocks' second 3x3 conv; before the self tap
(``_common._self_tap``) every such model's TL-Align targets were NaN on both paths from the first step (a NaN loss,
and under a gradient scaler steps skipped without end). Every family with stride-1 kxk convs was checked so (all
of them zeroed, fast path and reference); these tests keep a few and the rule itself.
"""

from __future__ import annotations

import pytest
import timm
import torch
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabelMap, backbones
from mixlabels.backbones._common import conv_mix, kernel_labels, label_kernels

FAMILIES = {f.name: f for f in backbones.FAMILIES}


def _batch(size: int = 32) -> tuple[torch.Tensor, TokenLabelMap]:
    mask = torch.ones(2, size, size)
    mask[0, 4:20, 6:26] = 0.0
    mask[1, 10:30, 0:13] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([3, 7]), num_classes=10)
    return lm.mix_pixels(torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))), lm


def test_a_zero_kernel_keeps_the_labels_and_others_keep_their_bits() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, 3, 3, generator=g)
    zero = torch.zeros(8, 4, 3, 3)
    k = kernel_labels(zero)
    assert k.argmax() == 4 and k.sum() > 0  # the centre: each position reads itself
    labels = torch.rand(2, 25, 3, generator=g)
    labels = labels / labels.sum(-1, keepdim=True)
    assert_close(conv_mix(labels, (5, 5), k, (1, 1), (1, 1)), labels)  # the identity, border rows too
    # a kernel with weight is the same to the bit, alone or in a stack with a zero weight
    k_w = kernel_labels(w)
    w_abs = w.double().abs()
    assert_close(k_w.double(), (w_abs / w_abs.sum((-2, -1), keepdim=True)).mean((0, 1)), atol=1e-7, rtol=0)
    stacked = label_kernels([w, zero, w * 2])
    assert torch.isfinite(torch.stack(stacked)).all() and stacked[1].argmax() == 4
    assert_close(stacked[0], k_w, atol=1e-7, rtol=0)


@pytest.mark.parametrize("family", ["vgg", "resnet", "convnext", "byobnet", "efficientvit_mit", "twins"])
def test_zeroed_convs_give_finite_targets_fast_equal_to_reference(family: str) -> None:
    images, lm = _batch()
    out = []
    for reference in (False, True):
        model = FAMILIES[family].example().train()
        with torch.no_grad():
            for conv in model.modules():
                if isinstance(conv, torch.nn.Conv2d) and max(conv.kernel_size) > 1 and conv.stride == (1, 1):
                    conv.weight.zero_()
        torch.manual_seed(0)
        out.append(backbones.adapt(model, TLAlign(), reference=reference)(images, lm).target.double())
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()
    assert_close(out[0], out[1], atol=1e-6, rtol=0)


def test_timm_zero_init_last_resnetv2_trains_on_finite_targets() -> None:
    """The user's call: ``timm.create_model("resnetv2_18", zero_init_last=True)``, one TL-Align training step."""
    torch.manual_seed(0)
    model = timm.create_model("resnetv2_18", pretrained=False, zero_init_last=True, num_classes=10).train()
    zeroed = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and not m.weight.any()]
    assert zeroed and all(m.kernel_size == (3, 3) for m in zeroed)
    images, lm = _batch()
    out = backbones.adapt(model, TLAlign())(images, lm)
    assert torch.isfinite(out.target).all()
    assert_close(out.target.sum(-1), torch.ones(2))
    loss = torch.sum(-out.target * torch.log_softmax(out.logits, dim=-1), dim=-1).mean()
    loss.backward()  # type: ignore[no-untyped-call]
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
