"""The NormFreeNet adapter (NFNet-F's deep stem, extra conv and SE last; NF-RegNet's mid-branch SE and final conv;
NF-ResNet's pooled 7x7 stem and ECA; skipinit and gamma-in-activation; scaled weight-standardised convs):
preservation, fast = reference, one-hot when unmixed, every timm name, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.layers import ScaledStdConv2d, ScaledStdConv2dSame
from timm.models.nfnet import NormFreeNet, model_cfgs
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones.families.nfnet import tiny_cfg

FAMILY = next(f for f in backbones.FAMILIES if f.name == "nfnet")

# 32 px. "nfnet": the deep quad stem to 8x8, stages to 8, 4, 2, 1; "regnet": the 3x3 stem to 16x16, stages to 8, 4,
# 2, 1, SE between the 3x3 and the last 1x1; "resnet": the 7x7 stem and max pool to 8x8, ECA last, no final conv,
# ungrouped; "skipinit": the deep stem with a max pool, skipinit gains, NFNet's gamma in the activations.
CONFIGS: dict[str, dict[str, Any]] = {
    "nfnet": {},
    "regnet": {"stem_type": "3x3", "reg": True, "bottle_ratio": 2.0, "extra_conv": False},
    "resnet": {"stem_type": "7x7_pool", "attn_layer": "eca", "attn_kwargs": {}, "num_features": 0, "group_size": None,
               "extra_conv": False, "act_layer": "relu"},
    "skipinit": {"stem_type": "deep_pool", "skipinit": True, "gamma_in_act": True, "attn_layer": None},
    "same": {"same_padding": True},  # dm_nfnet_*: ScaledStdConv2dSame, strided ones padded per input size
}  # fmt: skip


def make(config: str, drop_path_rate: float = 0.0) -> nn.Module:
    """A seeded tiny NormFreeNet with every gain moved off its init (the last conv of each branch starts at gain 0,
    skipinit's gain at 0: the branch would add nothing, and preservation could not see it)."""
    torch.manual_seed(0)
    model = NormFreeNet(tiny_cfg(**CONFIGS[config]), num_classes=C, drop_rate=0.2, drop_path_rate=drop_path_rate)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (ScaledStdConv2d, ScaledStdConv2dSame)):
                mod.gain.uniform_(0.5, 1.5)
            if getattr(mod, "skipinit_gain", None) is not None:
                mod.skipinit_gain.fill_(0.7)
    return model


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("nfnet", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["regnet", "resnet", "skipinit", "same"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")


def test_fast_path_equals_reference_token_space() -> None:
    check_parity(make("nfnet", drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("regnet"), POOLED)


def test_every_timm_name_adapts() -> None:
    """Every name is accepted, those timm builds with TF 'same' padding (``ScaledStdConv2dSame``) included."""
    names = timm.list_models(module="nfnet")
    assert any(model_cfgs[name].same_padding for name in names)
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name


def test_same_padding_paths() -> None:
    """A 'same' model's strided convs are windows resolved per grid (32 px: the stem's stride-2 3x3 pads (0, 1)),
    its stride-1 3x3s static convs, and their label kernels read from the standardised weight."""
    from mixlabels.backbones._common import effective_weight
    from mixlabels.backbones._convnet import Window, path_of

    model: Any = make("same")
    stem = path_of(list(model.stem.children()))
    assert isinstance(stem[0], Window) and stem[0].same and stem[0].axes((32, 32))[0][2:4] == (0, 1)
    conv = model.stages[0][0].conv2b
    assert type(conv) is ScaledStdConv2dSame and not conv.same_pad and path_of([conv]) == (conv,)
    assert_close(effective_weight(conv), ScaledStdConv2d.forward.__globals__["F"].batch_norm(
        conv.weight.reshape(1, conv.out_channels, -1), None, None, weight=(conv.gain * conv.scale).view(-1),
        training=True, momentum=0.0, eps=conv.eps).reshape_as(conv.weight))
    dilated: Any = make("same")
    dilated.stages[1][0].conv2.dilation = (2, 2)
    assert "ScaledStdConv2dSame with kernel (3, 3), stride (2, 2) and dilation (2, 2)" in str(FAMILY.refusal(dilated))


def test_refusals() -> None:
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("nfnet"), TransMix())(images, lm)
    with torch.device("meta"):
        maxpool = timm.create_model("nf_regnet_b0", pretrained=False, global_pool="max")
        assert FAMILY.refusal(timm.create_model("resnetv2_50", pretrained=False)) == "ResNetV2 is not a timm NormFreeNet"
        resnetv2 = next(f for f in backbones.FAMILIES if f.name == "resnetv2")
        assert resnetv2.refusal(timm.create_model("nf_resnet26", pretrained=False)) == "NormFreeNet is not a timm ResNetV2"
    with pytest.raises(TypeError, match=r"the head's global_pool='max' has no label readout; use 'avg'"):
        backbones.AdaptedNFNet(maxpool, TLAlign())
    circular: Any = make("nfnet")
    circular.stages[1][1].conv2b.padding_mode = "circular"
    with pytest.raises(TypeError, match=r"block 2's branch module 5 \(ScaledStdConv2d\) .* only static zero padding"):
        backbones.adapt(circular, TLAlign())
    attention: Any = make("regnet")
    attention.stages[0][0].attn = nn.MultiheadAttention(8, 1)
    with pytest.raises(TypeError, match="block 0's branch module 4 is MultiheadAttention, which has no label rule"):
        backbones.adapt(attention, TLAlign())
