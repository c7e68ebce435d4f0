"""Adapter for torchvision's MobileNetV2 and MobileNetV3 (small, large).

Their blocks (``InvertedResidual``: 1x1 expansion, depthwise kxk conv, squeeze-excitation in V3,
1x1 projection) are EfficientNet's MBConv without stochastic depth, so the adapter is
``tv_efficientnet``'s (``backbones.families.tv_efficientnet``, on timm EfficientNet's rules): a
stride-1 (or dilated) depthwise conv mixes labels by its channel-averaged normalised |kernel|, a
strided one aggregates, 1x1 convs, batch norms, ReLU6, hard-swish and the hard-sigmoid gates are
channel ops; a residual block joins by the residual rule, a block without one aggregates; the stem
aggregates from the pixels; readout ``pool("mean", 0)``: both pool first (V2 by the function), then
run the classifier (V3's is linear, hard-swish, dropout, linear) on the pooled vector.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchvision.models.mobilenetv2 import MobileNetV2
from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3

from mixlabels.backbones._family import Family
from mixlabels.backbones.families.tv_efficientnet import AdaptedTvEfficientNet, units_refusal

__all__ = ["AdaptedTvMobileNet", "TV_MOBILENET_FAMILY", "tv_mobilenet_refusal", "tiny_tv_mobilenet_v2", "tiny_tv_mobilenet_v3"]

TV_MOBILENET_FAMILY = (
    "torchvision MobileNetV2 and MobileNetV3 (small/large): InvertedResidual blocks with EfficientNet's rules "
    "(stride-1 or dilated depthwise convs mix by the channel-averaged normalised |kernel|, strided convs aggregate, "
    "1x1 convs, norms, ReLU6/hard-swish and squeeze-excitation as channel ops); a residual block joins by the "
    "residual rule, a block without one aggregates; stem from the pixels; global average pooling before the classifier"
)

BUILDERS = ("mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large")


def tv_mobilenet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a torchvision MobileNetV2/V3 this adapter carries labels through (``None``: it is)."""
    if type(model) not in (MobileNetV2, MobileNetV3):
        return f"{type(model).__name__} is not a torchvision MobileNetV2 or MobileNetV3"
    return units_refusal(model)


class AdaptedTvMobileNet(AdaptedTvEfficientNet):
    """A torchvision MobileNetV2/V3 returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = TV_MOBILENET_FAMILY
    refusal = staticmethod(tv_mobilenet_refusal)


def tiny_tv_mobilenet_v3(num_classes: int = 10, **kwargs: Any) -> MobileNetV3:
    """A seeded torchvision MobileNetV3 for 32x32 images (grids 16, 8, 4, 4, 4): squeeze-excitation, ReLU and
    hard-swish blocks, a strided block without residual, a 5x5 kernel, a dilated last block."""
    torch.manual_seed(0)
    settings = [InvertedResidualConfig(8, 3, 8, 8, True, "RE", 2, 1, 1.0), InvertedResidualConfig(8, 3, 32, 16, False, "RE", 2, 1, 1.0),
                InvertedResidualConfig(16, 5, 48, 16, True, "HS", 1, 1, 1.0), InvertedResidualConfig(16, 3, 48, 24, True, "HS", 1, 2, 1.0)]  # fmt: skip
    return MobileNetV3(settings, last_channel=64, num_classes=num_classes, **kwargs)


def tiny_tv_mobilenet_v2(num_classes: int = 10, **kwargs: Any) -> MobileNetV2:
    """A seeded torchvision MobileNetV2 for 32x32 images (grids 16, 16, 8, 4), a quarter of the widths."""
    torch.manual_seed(0)
    return MobileNetV2(num_classes, width_mult=0.25, inverted_residual_setting=[[1, 8, 1, 1], [6, 16, 2, 2], [6, 24, 2, 2]], **kwargs)


FAMILY = Family(
    name="tv_mobilenet",
    description=TV_MOBILENET_FAMILY,
    refusal=AdaptedTvMobileNet.refusal,
    build=AdaptedTvMobileNet,
    example=tiny_tv_mobilenet_v3,
    timm_modules=(),
    torchvision_builders=BUILDERS,
)
