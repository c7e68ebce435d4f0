"""The ResNetV2 adapter (pre-activation basic and bottleneck blocks, non-pre-activation bottleneck, conv and avg-pool
shortcuts, BiT's fixed stem, deep and tiered stems, weight-standardised convs): preservation, fast = reference,
one-hot when unmixed, every timm name, refusals."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.layers import BatchNormAct2d, EvoNorm2dS0, FilterResponseNormTlu2d, GroupNormAct, StdConv2d
from timm.layers.std_conv import StdConv2dSame
from timm.models.resnetv2 import ResNetV2
from torch import nn

from mixlabels import TLAlign, TransMix, backbones

FAMILY = next(f for f in backbones.FAMILIES if f.name == "resnetv2")

# 32 px: stems to 8x8, stages to 8, 4, 2, 1. Between them: the three block kinds, BiT's fixed stem and the deep and
# tiered stems, conv and avg-pool shortcuts, StdConv2d and plain convs, group, batch, EvoNorm-S0 and FRN norms,
# head dropout.
CONFIGS: dict[str, dict[str, Any]] = {
    "bit": {"stem_type": "fixed", "conv_layer": StdConv2d, "norm_layer": partial(GroupNormAct, num_groups=2)},
    "basic_d": {"basic": True, "bottle_ratio": 1.0, "stem_type": "deep", "avg_down": True, "norm_layer": BatchNormAct2d,
                "layers": [2, 1, 1, 1]},
    "tiered_evos": {"stem_type": "tiered", "avg_down": True, "conv_layer": StdConv2d,
                    "norm_layer": partial(EvoNorm2dS0, group_size=2), "stem_chs": 16},
    "v1_frn": {"preact": False, "norm_layer": FilterResponseNormTlu2d, "conv_layer": StdConv2d},
}  # fmt: skip


def make(config: str, drop_path_rate: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    args = {"layers": [1, 1, 1, 1], "channels": (8, 16, 24, 32), "stem_chs": 8, "drop_rate": 0.2} | CONFIGS[config]
    return ResNetV2(num_classes=C, drop_path_rate=drop_path_rate, **args)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("bit", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["basic_d", "tiered_evos", "v1_frn"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")


def test_fast_path_equals_reference_token_space() -> None:
    check_parity(make("bit", drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("basic_d"), POOLED)


def test_every_timm_name_adapts() -> None:
    names = timm.list_models(module="resnetv2")
    assert names
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name


def test_refusals() -> None:
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("bit"), TransMix())(images, lm)
    with torch.device("meta"):
        maxpool = timm.create_model("resnetv2_50", pretrained=False, global_pool="max")
        same = timm.create_model("resnetv2_50", pretrained=False, stem_type="same")
        assert FAMILY.refusal(timm.create_model("resnet18", pretrained=False)) == "ResNet is not a timm ResNetV2"
    with pytest.raises(TypeError, match=r"the head's global_pool='max' has no label readout; use 'avg'"):
        backbones.AdaptedResNetV2(maxpool, TLAlign())
    with pytest.raises(TypeError, match="the stem's MaxPool2dSame pads by TF 'same' rule"):
        backbones.adapt(same, TLAlign())
    lopsided: Any = make("bit")
    lopsided.stem.pad = nn.ConstantPad2d((0, 1, 0, 1), 0.0)  # not one window's padding
    with pytest.raises(TypeError, match="the stem module 1 is ConstantPad2d, which has no label rule"):
        backbones.adapt(lopsided, TLAlign())
    for cls in (StdConv2dSame,):  # a strided ScaledStdConv2dSame aggregates over its 'same' windows (dm_nfnet)
        tf_same: Any = make("bit")
        tf_same.stages[1].blocks[0].conv2 = cls(8, 8, 3, stride=2)
        with pytest.raises(TypeError, match=f"block 1's branch module 3 is {cls.__name__}: TF 'same' padding.*same_padding=False"):
            backbones.adapt(tf_same, TLAlign())
    circular: Any = make("bit")
    circular.stages[0].blocks[0].conv2.padding_mode = "circular"
    with pytest.raises(TypeError, match=r"block 0's branch module 3 \(StdConv2d\) .* only static zero padding"):
        backbones.adapt(circular, TLAlign())
