"""The MambaOut adapter: preservation, fast = reference, one-hot when unmixed, every timm name, refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch import nn

from mixlabels import TLAlign, TransMix, backbones

FAMILY = next(f for f in backbones.FAMILIES if f.name == "mambaout")

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {"conv_ratio": 0.5},  # half the hidden channels untouched, half through the depthwise conv
    "rw": {  # timm's _rw variants: norm-first downsampling, layer scale, ClNormMlpClassifierHead, conv_ratio > 1
        "stem_mid_norm": False, "downsample": "conv_nf", "ls_init_value": 1.0, "head_fn": "norm_mlp",
        "expansion_ratio": 3.0, "conv_ratio": 1.25,
    },
    "all_conv": {"conv_ratio": 8 / 3, "kernel_size": 3},  # every hidden channel through the conv: no identity part
}


def make(config: str = "default", drop_path_rate: float = 0.0) -> nn.Module:
    # stages of 1, 1, 2, 1 blocks (widths 8, 16, 24, 32; the stem to 8x8, then grids 8, 4, 2, 1 at 32 px)
    torch.manual_seed(0)
    model: nn.Module = timm.create_model(
        "mambaout_femto", pretrained=False, depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), num_classes=C,
        drop_path_rate=drop_path_rate, drop_rate=0.2, **CONFIGS[config],
    )  # fmt: skip
    return model


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["rw", "all_conv"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_every_timm_name_adapts_and_refusals() -> None:
    names = timm.list_models(module="mambaout")
    assert len(names) == 11
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("starnet_s1", pretrained=False)) == "StarNet is not a timm MambaOut"
        unpooled = timm.create_model("mambaout_femto", pretrained=False, global_pool="", num_classes=0)
    assert FAMILY.refusal(unpooled) == "the head's pool_type='' has no label readout; use 'avg'"
    circular: Any = copy.deepcopy(make())
    circular.stages[2].blocks[1].conv.padding_mode = "circular"
    with pytest.raises(TypeError, match="stage 2 block 1's module 2 .* only static zero padding has a label rule"):
        backbones.adapt(circular, TLAlign())
    strided: Any = copy.deepcopy(make())
    strided.stages[1].blocks[0].conv.stride = (2, 2)
    assert FAMILY.refusal(strided) == (
        "stage 1 block 0's conv has stride (2, 2): the gate needs it on the block's grid (stride 1)"
    )
    attention: Any = copy.deepcopy(make())
    attention.stages[3].downsample.norm = nn.MultiheadAttention(24, 1)
    assert FAMILY.refusal(attention) == (
        "stage 3's downsampler module 0 is MultiheadAttention, which has no label rule here "
        "(a conv, pool, norm, activation or channel gate)"
    )
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
