"""The EfficientNet adapter (InvertedResidual, DepthwiseSeparable, EdgeResidual, ConvBnAct blocks): preservation,
fast = reference, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
import test_backbones_common
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.layers.conv2d_same import Conv2dSame
from torch import nn

from mixlabels import TLAlign, TransMix, backbones

# test_efficientnet: ConvBnAct, EdgeResidual (with skip), InvertedResidual (with and without skip, SE);
# mnasnet_small: DepthwiseSeparable blocks too. Both at 32 px (stem to 16x16).
NAMES = ("test_efficientnet", "mnasnet_small")


def make(name: str, drop_path_rate: float = 0.0, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=C, drop_path_rate=drop_path_rate, drop_rate=0.2, **kwargs)


def make_same(name: str = "test_efficientnet", drop_path_rate: float = 0.0) -> nn.Module:
    """TF 'same' padding (the tf_* models' pad_type): every strided conv a Conv2dSame, padded by its input size."""
    model = make(name, drop_path_rate, pad_type="same")
    assert any(isinstance(mod, Conv2dSame) for mod in model.modules())
    return model


# 32 px: the stride-2 3x3 convs pad 32 and 16 by (0, 1); 30 px: 30 by (0, 1), 15 by (1, 1) (and 5x5 by (2, 2))
SAME_SIZES = (32, 30)


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


@pytest.mark.parametrize("size", SAME_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_same_padding_preservation(name: str, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_backbones_common, "IMG", size)
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make_same(name, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_same_padding_fast_path_equals_reference(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_backbones_common, "IMG", 30)  # odd grids (15, 5) as well as even ones
    check_parity(make_same(drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("size", SAME_SIZES)
def test_same_padding_variants(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_backbones_common, "IMG", size)
    check_parity(make_same("mnasnet_small", drop_path_rate=0.4), "tl_align")
    check_unmixed_is_one_hot(make_same(), POOLED)
    if size == 32:  # MixToken needs the stem's grid to tile the image
        check_parity(make_same(drop_path_rate=0.4), "tl_align", token_space=True)


def test_same_padding_moves_labels_unlike_symmetric() -> None:
    """The 'same' windows are not the symmetric ones: the same weights with static padding give other targets."""
    same, static = make_same(), make("test_efficientnet")
    static.load_state_dict(same.state_dict())
    images, lm = cutmix_batch()
    a, b = backbones.adapt(same, TLAlign())(images, lm), backbones.adapt(static, TLAlign())(images, lm)
    assert (a.target - b.target).abs().max() > 1e-4


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
    assert family.refusal(tf) is None  # TF 'same' padding: its strided convs' windows resolved per grid
    with pytest.raises(TypeError, match="branch module 0 is MixedConv2d, which has no label rule"):
        backbones.AdaptedEfficientNet(mixnet, TLAlign())
