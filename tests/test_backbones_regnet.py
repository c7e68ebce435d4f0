"""The RegNet adapter (Bottleneck with grouped 3x3 and SE, PreBottleneck, conv or avg-pool shortcuts): preservation,
fast = reference, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.regnet import RegNet, RegNetCfg
from torch import nn

from mixlabels import TLAlign, TransMix, backbones


def make(drop_path_rate: float = 0.0, **cfg: Any) -> nn.Module:
    # 4 stages of 1, 1, 2, 1 blocks (widths 8..40, group size 4, SE): grids 16 (stem), 8, 4, 2, 1 at 32 px.
    torch.manual_seed(0)
    args = dict(depth=5, w0=8, wa=8.0, wm=1.5, group_size=4, stem_width=8, se_ratio=0.25) | cfg
    return RegNet(RegNetCfg(**args), num_classes=C, drop_path_rate=drop_path_rate, drop_rate=0.2)


VARIANTS = {"conv1x1": {}, "preact_avg": {"preact": True, "downsample": "avg"}, "no_shortcut": {"downsample": "", "se_ratio": 0.0}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_function_preservation_train_mode(variant: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(drop_path_rate=0.5, **VARIANTS[variant]), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("variant", ["preact_avg", "no_shortcut"])
def test_fast_path_equals_reference_variants(variant: str) -> None:
    check_parity(make(drop_path_rate=0.4, **VARIANTS[variant]), "tl_align")


def test_fast_path_equals_reference_token_space() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "regnet")
    for name in ("regnetx_002", "regnety_002", "regnety_040", "regnetv_040", "regnety_008_tv", "regnetz_005"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    with torch.device("meta"):
        maxpool = timm.create_model("regnetx_002", pretrained=False, global_pool="max")
        resnet = timm.create_model("resnet18", pretrained=False)
        dilated = timm.create_model("regnetx_002", pretrained=False, output_stride=8)
    with pytest.raises(TypeError, match=r"the head \(global_pool='max', use_conv=False\) has no label readout; use 'avg'"):
        backbones.AdaptedRegNet(maxpool, TLAlign())
    with pytest.raises(TypeError, match="ResNet is not a timm RegNet"):
        backbones.AdaptedRegNet(resnet, TLAlign())
    assert family.refusal(dilated) is None  # dilated 3x3 (stride 1) mixes by its dilated taps
    blk: Any = make().s1.b1
    blk.conv2.conv = nn.Conv2d(8, 8, 3, stride=2, padding=2, dilation=2)
    with pytest.raises(TypeError, match="block 0's branch module 2 is a strided dilated convolution"):
        backbones.AdaptedRegNet(make_with(blk), TLAlign())


def make_with(blk: nn.Module) -> nn.Module:
    model: Any = make()
    model.s1.b1 = blk
    return model
