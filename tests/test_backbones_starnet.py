"""The StarNet adapter: preservation, fast = reference, one-hot when unmixed, every timm name, refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.starnet import StarNet
from torch import nn

from mixlabels import TLAlign, TransMix, backbones

FAMILY = next(f for f in backbones.FAMILIES if f.name == "starnet")


def make(drop_path_rate: float = 0.0, **kwargs: Any) -> nn.Module:
    # stages of 1, 2, 1 blocks (widths 8, 16, 32; the stem to 16x16, then grids 8, 4, 2 at 32 px)
    torch.manual_seed(0)
    return StarNet(base_dim=8, depths=[1, 2, 1], mlp_ratio=2, num_classes=C, drop_path_rate=drop_path_rate, drop_rate=0.2, **kwargs)


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)


def test_other_activation() -> None:
    check_parity(make(act_layer=nn.GELU), "tokens_aligned")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_every_timm_name_adapts_and_refusals() -> None:
    names = timm.list_models(module="starnet")
    assert len(names) == 7
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        maxpool = timm.create_model("starnet_s1", pretrained=False, global_pool="max")
        assert FAMILY.refusal(timm.create_model("repvit_m1", pretrained=False)) == "RepVit is not a timm StarNet"
    assert FAMILY.refusal(maxpool) == "global_pool='max' has no label readout; use 'avg'"
    spatial_star: Any = copy.deepcopy(make())
    spatial_star.stages[1][2].f2.conv = nn.Conv2d(16, 32, 3, padding=1)
    assert FAMILY.refusal(spatial_star) == (
        "stage 1 block 1's f1, f2 or g mixes positions: the star's branches must be 1x1 stride-1 convs"
    )
    circular: Any = copy.deepcopy(make())
    circular.stages[0][1].dwconv2.conv.padding_mode = "circular"
    with pytest.raises(TypeError, match="stage 0 block 0's branch module 7 .* only static zero padding has a label rule"):
        backbones.adapt(circular, TLAlign())
    attention: Any = copy.deepcopy(make())
    attention.stages[2][0] = nn.MultiheadAttention(16, 1)
    with pytest.raises(TypeError, match="stage 2's downsampler module 0 is MultiheadAttention, which has no label rule"):
        backbones.adapt(attention, TLAlign())
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
