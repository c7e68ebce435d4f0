"""The ReXNet adapter (linear bottlenecks whose shortcut adds to the first in_channels channels only: a fork and a
join of the labels; strided and dilated depthwise convs; SE): preservation, fast = reference, one-hot when unmixed,
every rexnet name accepted, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.models.rexnet import RexNet
from torch import nn

from mixlabels import TLAlign, backbones
from mixlabels.backbones.families.rexnet import TINY, AdaptedRexNet


def make(drop_path_rate: float = 0.0, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return RexNet(num_classes=C, drop_rate=0.2, drop_path_rate=drop_path_rate, **{**TINY, **kwargs})


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)  # MixToken on the stem's 16x16 grid
    check_parity(make(drop_path_rate=0.4, output_stride=32), "tl_official")  # undilated, down to a 1x1 grid


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(drop_path_rate=0.4), POOLED)


def test_partial_shortcut_share() -> None:
    adapted: Any = backbones.adapt(make(), TLAlign())
    shares = [adapted._plain(b) for b in adapted.model.features]
    assert shares[4] == pytest.approx(3 / 26) and shares[0] == 0.0 and shares[-1] == 0.0  # 23 -> 26: 3 plain channels
    assert sum(s > 0 for s in shares) == 5


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "rexnet")
    for name in timm.list_models(module="rexnet"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        assert family.refusal(timm.create_model("resnet18", pretrained=False)) == "ResNet is not a timm RexNet"
    maxpooled = make(global_pool="max")
    with pytest.raises(TypeError, match="global_pool='max'"):
        AdaptedRexNet(maxpooled, TLAlign())
    circular: Any = make()
    circular.features[4].conv_dw.conv.padding_mode = "circular"
    with pytest.raises(TypeError, match="feature 4's branch module 2 .* only static zero padding"):
        AdaptedRexNet(circular, TLAlign())
    strided: Any = make(output_stride=32)
    assert strided.features[4].use_shortcut
    strided.features[4].conv_dw.conv.stride = (2, 2)
    with pytest.raises(TypeError, match="feature 4 has a shortcut but its branch changes the grid"):
        AdaptedRexNet(strided, TLAlign())
    spatial: Any = make()
    spatial.features[-1] = nn.MaxPool2d(2)
    with pytest.raises(TypeError, match="feature 10 is MaxPool2d; only timm's LinearBottleneck"):
        AdaptedRexNet(spatial, TLAlign())
