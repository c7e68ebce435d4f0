"""The torchvision EfficientNet adapter: preservation, fast = reference, one-hot when unmixed, every builder accepted."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from test_backbones_common import POOLED, SCHEMES, check_parity, check_preservation, check_torchvision_builders, check_unmixed_is_one_hot, cutmix_batch
from torch import nn

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones.families.tv_efficientnet import tiny_tv_efficientnet

FAMILY = next(f for f in backbones.FAMILIES if f.name == "tv_efficientnet")


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(tiny_tv_efficientnet(stochastic_depth_prob=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(tiny_tv_efficientnet(stochastic_depth_prob=0.4), scheme)


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(tiny_tv_efficientnet(stochastic_depth_prob=0.2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(tiny_tv_efficientnet(), POOLED)


def test_every_builder_adapts() -> None:
    check_torchvision_builders("tv_efficientnet")


def test_refusals() -> None:
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("efficientnet_b0", pretrained=False)) == "EfficientNet is not a torchvision EfficientNet"
        timm_family = next(f for f in backbones.FAMILIES if f.name == "efficientnet")
        assert timm_family.refusal(torchvision.models.efficientnet_b0()) == "EfficientNet is not a timm EfficientNet"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(tiny_tv_efficientnet(), TransMix())(images, lm)
    model = tiny_tv_efficientnet()
    model.features[3][0].block[1][0].padding_mode = "circular"
    with pytest.raises(TypeError, match="block 2's branch module 3 .* only static zero padding"):
        backbones.adapt(model, TLAlign())
    model = tiny_tv_efficientnet()
    model.avgpool = nn.AdaptiveMaxPool2d(1)
    with pytest.raises(TypeError, match="only global average pooling"):
        backbones.adapt(model, TLAlign())
