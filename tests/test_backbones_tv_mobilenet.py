"""The torchvision MobileNetV2/V3 adapter: preservation, fast = reference, one-hot when unmixed, every builder accepted."""

from __future__ import annotations

import pytest
import timm
import torch
from test_backbones_common import POOLED, SCHEMES, check_parity, check_preservation, check_torchvision_builders, check_unmixed_is_one_hot
from torch import nn

from mixlabels import backbones
from mixlabels.backbones.families.tv_mobilenet import tiny_tv_mobilenet_v2, tiny_tv_mobilenet_v3

FAMILY = next(f for f in backbones.FAMILIES if f.name == "tv_mobilenet")
MAKE = {"v2": tiny_tv_mobilenet_v2, "v3": tiny_tv_mobilenet_v3}


@pytest.mark.parametrize("version", list(MAKE))
def test_function_preservation_train_mode(version: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(MAKE[version](), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(tiny_tv_mobilenet_v3(), scheme)


def test_fast_path_equals_reference_v2() -> None:
    for scheme in ("tl_align", "tokens_aligned"):
        check_parity(tiny_tv_mobilenet_v2(), scheme)
    check_parity(tiny_tv_mobilenet_v2(), "tl_align", token_space=True)


@pytest.mark.parametrize("version", list(MAKE))
def test_unmixed_gives_one_hot(version: str) -> None:
    check_unmixed_is_one_hot(MAKE[version](), POOLED)


def test_every_builder_adapts() -> None:
    check_torchvision_builders("tv_mobilenet")


def test_refusals() -> None:
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("mobilenetv3_small_100", pretrained=False)) == (
            "MobileNetV3 is not a torchvision MobileNetV2 or MobileNetV3")
    model = tiny_tv_mobilenet_v3()
    model.classifier[1] = nn.LayerNorm(64)
    assert FAMILY.refusal(model) == "the classifier has a module other than dropout, linear layers and activations"
