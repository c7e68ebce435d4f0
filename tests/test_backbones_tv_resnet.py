"""The torchvision ResNet adapter: preservation, fast = reference, one-hot when unmixed, every builder accepted."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
import torchvision
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_torchvision_builders, check_unmixed_is_one_hot, cutmix_batch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from mixlabels import NoAlign, TLAlign, TransMix, backbones

# 32 px: the stem to 8x8, then 8, 4, 2, 1 positions a side (dilated stages keep 4x4). Between them: both block types,
# grouped convs (ResNeXt), wider bottlenecks (Wide ResNet), dilated 3x3 convs with stride-1 1x1 shortcuts.
CONFIGS: dict[str, dict[str, Any]] = {
    "basic": {"block": BasicBlock, "layers": [1, 1, 1, 1]},
    "resnext": {"block": Bottleneck, "layers": [2, 1, 1, 1], "groups": 2, "width_per_group": 4},
    "wide": {"block": Bottleneck, "layers": [1, 1, 1, 1], "width_per_group": 16},
    "dilated": {"block": Bottleneck, "layers": [1, 1, 1, 1], "width_per_group": 8, "replace_stride_with_dilation": [False, True, True]},
}  # fmt: skip


def make(config: str) -> nn.Module:
    torch.manual_seed(0)
    return ResNet(num_classes=C, **CONFIGS[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("basic"), scheme)


@pytest.mark.parametrize("config", ["resnext", "wide", "dilated"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config), "tl_align")
    check_parity(make(config), "tokens_aligned")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make("basic"), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("resnext"), POOLED)


def test_every_builder_adapts() -> None:
    check_torchvision_builders("tv_resnet")


def test_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "tv_resnet")
    with torch.device("meta"):
        assert family.refusal(timm.create_model("resnet18", pretrained=False)) == "ResNet is not a torchvision ResNet"
        timm_family = next(f for f in backbones.FAMILIES if f.name == "resnet")
        assert timm_family.refusal(torchvision.models.resnet18()) == "ResNet is not a timm ResNet"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("basic"), TransMix())(images, lm)
    maxpooled = make("basic")
    maxpooled.avgpool = nn.AdaptiveMaxPool2d(1)
    with pytest.raises(TypeError, match="only global average pooling"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    circular = make("basic")
    circular.layer1[0].conv2.padding_mode = "circular"
    with pytest.raises(TypeError, match="block 0's branch module 3 .* only static zero padding"):
        backbones.adapt(circular, TLAlign())
