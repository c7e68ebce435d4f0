"""The torchvision RegNet adapter: preservation, fast = reference, one-hot when unmixed, every builder accepted."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
import torchvision
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_torchvision_builders, check_unmixed_is_one_hot, cutmix_batch
from torch import nn
from torchvision.models.regnet import RegNet

from mixlabels import NoAlign, TLAlign, TransMix, backbones
from mixlabels.backbones._count import meta_torchvision_model
from mixlabels.backbones.families.tv_regnet import tiny_block_params

FAMILY = next(f for f in backbones.FAMILIES if f.name == "tv_regnet")

# 32 px: the stem to 16x16. "y": squeeze-excitation, stages to 8, 4, 2, 2 (the last with a stride-1 1x1 projection);
# "x": no squeeze-excitation, a stride-1 first stage (16, 8, 4, 2), a wider bottleneck.
CONFIGS: dict[str, dict[str, Any]] = {
    "y": {"block_params": tiny_block_params()},
    "x": {"block_params": tiny_block_params(se_ratio=None, strides=(1, 2, 2, 2))},
}


def make(config: str) -> nn.Module:
    torch.manual_seed(0)
    return RegNet(num_classes=C, stem_width=8, **CONFIGS[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("y"), scheme)


def test_fast_path_equals_reference_regnet_x() -> None:
    check_parity(make("x"), "tl_align")
    check_parity(make("x"), "tokens_aligned")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make("y"), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("x"), POOLED)


def test_every_builder_adapts() -> None:
    check_torchvision_builders("tv_regnet")
    regnets = {n for n in torchvision.models.list_models(module=torchvision.models) if n.startswith("regnet_")}
    assert set(FAMILY.torchvision_builders) == regnets


def test_refusals() -> None:
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("regnety_002", pretrained=False)) == "RegNet is not a torchvision RegNet"
        timm_family = next(f for f in backbones.FAMILIES if f.name == "regnet")
        assert FAMILY.refusal(torchvision.models.resnet18()) == "ResNet is not a torchvision RegNet"
    assert timm_family.refusal(meta_torchvision_model("regnet_y_400mf")) == "RegNet is not a timm RegNet"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("y"), TransMix())(images, lm)
    maxpooled = make("y")
    maxpooled.avgpool = nn.AdaptiveMaxPool2d(1)
    with pytest.raises(TypeError, match="only global average pooling"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    circular = make("y")
    circular.trunk_output[1][1].f.b[0].padding_mode = "circular"
    with pytest.raises(TypeError, match="block 2's branch module 3 .* only static zero padding"):
        backbones.adapt(circular, TLAlign())
    attention = make("y")
    attention.trunk_output[0][0].f.se = nn.MultiheadAttention(8, 1)
    with pytest.raises(TypeError, match="block 0's branch module 6 is MultiheadAttention, which has no label rule"):
        backbones.adapt(attention, TLAlign())
