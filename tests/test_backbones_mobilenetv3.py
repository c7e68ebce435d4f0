"""The MobileNetV3 adapter (EfficientNet's blocks, pooling before the conv_head): preservation, fast = reference,
refusals."""

from __future__ import annotations

import pytest
import test_backbones_common
import timm
import torch
from test_backbones_common import POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.layers.conv2d_same import Conv2dSame
from torch import nn

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones.families.mobilenetv3 import tiny_mobilenetv3


def make(drop_path_rate: float = 0.0) -> nn.Module:
    # DepthwiseSeparable, InvertedResidual (with and without skip, SE), EdgeResidual, ConvBnAct; grid 4x4 at the end.
    return tiny_mobilenetv3(drop_path_rate=drop_path_rate, drop_rate=0.2)


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)
    torch.manual_seed(0)
    lcnet = timm.create_model("lcnet_050", pretrained=False, num_classes=10)  # DepthwiseSeparable only, 1x1 at 32 px
    check_parity(lcnet, "tl_align")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def make_same(drop_path_rate: float = 0.0) -> nn.Module:
    """TF 'same' padding (the tf_mobilenetv3_* models' pad_type): the strided convs are Conv2dSame."""
    model = tiny_mobilenetv3(drop_path_rate=drop_path_rate, drop_rate=0.2, pad_type="same")
    assert any(isinstance(mod, Conv2dSame) for mod in model.modules())
    return model


@pytest.mark.parametrize("size", [32, 30])  # the stride-2 3x3 convs pad 32 by (0, 1); 30 by (0, 1), then 15 by (1, 1)
def test_same_padding(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_backbones_common, "IMG", size)
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make_same(drop_path_rate=0.5), SCHEMES[scheme])
    for scheme in ("tl_align", "tl_official", "tokens_aligned"):
        check_parity(make_same(drop_path_rate=0.4), scheme)
    check_unmixed_is_one_hot(make_same(), POOLED)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "mobilenetv3")
    names = ("mobilenetv3_large_100", "mobilenetv3_small_050", "mobilenetv3_rw", "fbnetv3_b", "lcnet_100", "hardcorenas_a")
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
        assert backbones.AdaptedEfficientNet.refusal(model) == "MobileNetV3 is not a timm EfficientNet"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    with torch.device("meta"):
        tf = timm.create_model("tf_mobilenetv3_small_100", pretrained=False)
        mnv4 = timm.create_model("mobilenetv4_conv_small", pretrained=False)
        mnv4_plain = timm.create_model("mobilenetv4_conv_small", pretrained=False)
        maxpool = timm.create_model("mobilenetv3_small_100", pretrained=False, global_pool="max")
        effnet = timm.create_model("efficientnet_b0", pretrained=False)
    mnv4_plain.norm_head = nn.Identity()  # timm's MobileNetV4 always has head_norm; without it, a MobileNetV3 head
    assert family.refusal(tf) is None  # TF 'same' padding: its strided convs' windows resolved per grid
    with pytest.raises(TypeError, match=r"norm_head \(head_norm=True\) is MobileNetV4's head: the mobilenetv4 family takes it"):
        backbones.AdaptedMobileNetV3(mnv4, TLAlign())
    assert family.refusal(mnv4_plain) is None  # its UniversalInvertedResidual blocks have the rules
    with pytest.raises(TypeError, match="global_pool='max' has no label readout; use 'avg'"):
        backbones.AdaptedMobileNetV3(maxpool, TLAlign())
    with pytest.raises(TypeError, match="EfficientNet is not a timm MobileNetV3"):
        backbones.AdaptedMobileNetV3(effnet, TLAlign())
