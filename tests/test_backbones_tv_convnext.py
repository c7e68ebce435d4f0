"""The torchvision ConvNeXt adapter: preservation, fast = reference, one-hot when unmixed, every builder accepted."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from test_backbones_common import POOLED, SCHEMES, check_parity, check_preservation, check_torchvision_builders, check_unmixed_is_one_hot, cutmix_batch
from torch import nn

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones.families.tv_convnext import tiny_tv_convnext

FAMILY = next(f for f in backbones.FAMILIES if f.name == "tv_convnext")


@pytest.mark.parametrize("layer_scale", [1.0, 1e-6])
def test_function_preservation_train_mode(layer_scale: float) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(tiny_tv_convnext(stochastic_depth_prob=0.5, layer_scale=layer_scale), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(tiny_tv_convnext(stochastic_depth_prob=0.4), scheme)


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(tiny_tv_convnext(stochastic_depth_prob=0.2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(tiny_tv_convnext(), POOLED)


def test_every_builder_adapts() -> None:
    check_torchvision_builders("tv_convnext")


def test_refusals() -> None:
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("convnext_atto", pretrained=False)) == "ConvNeXt is not a torchvision ConvNeXt"
        timm_family = next(f for f in backbones.FAMILIES if f.name == "convnext")
        assert timm_family.refusal(torchvision.models.convnext_tiny()) == "ConvNeXt is not a timm ConvNeXt"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(tiny_tv_convnext(), TransMix())(images, lm)
    circular = tiny_tv_convnext()
    circular.features[1][0].block[0].padding_mode = "circular"
    with pytest.raises(TypeError, match="unit 0's depthwise conv uses padding"):
        backbones.adapt(circular, TLAlign())
    mlp_head = tiny_tv_convnext()
    mlp_head.classifier[2] = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    with pytest.raises(TypeError, match="the classifier is not torchvision's"):
        backbones.adapt(mlp_head, TLAlign())
