"""The EfficientNet adapter (InvertedResidual, DepthwiseSeparable, EdgeResidual, ConvBnAct blocks): preservation,
fast = reference, refusals."""

from __future__ import annotations

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch import nn

from mixlabels import TLAlign, TransMix, backbones

# test_efficientnet: ConvBnAct, EdgeResidual (with skip), InvertedResidual (with and without skip, SE);
# mnasnet_small: DepthwiseSeparable blocks too. Both at 32 px (stem to 16x16).
NAMES = ("test_efficientnet", "mnasnet_small")


def make(name: str, drop_path_rate: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=C, drop_path_rate=drop_path_rate, drop_rate=0.2)


@pytest.mark.parametrize("name", NAMES)
def test_function_preservation_train_mode(name: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(name, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("test_efficientnet", drop_path_rate=0.4), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make("mnasnet_small", drop_path_rate=0.4), "tl_align")
    check_parity(make("test_efficientnet", drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("test_efficientnet"), POOLED)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "efficientnet")
    for name in ("efficientnet_b0", "efficientnetv2_rw_s", "mobilenetv2_100", "mnasnet_100", "fbnetc_100", "efficientnet_lite0"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("test_efficientnet"), TransMix())(images, lm)
    with torch.device("meta"):
        tf = timm.create_model("tf_efficientnet_b0", pretrained=False)
        mixnet = timm.create_model("mixnet_s", pretrained=False)
    with pytest.raises(TypeError, match="the stem module 0 is Conv2dSame: TF 'same' padding.*without the tf_ prefix"):
        backbones.AdaptedEfficientNet(tf, TLAlign())
    with pytest.raises(TypeError, match="branch module 0 is MixedConv2d, which has no label rule"):
        backbones.AdaptedEfficientNet(mixnet, TLAlign())
