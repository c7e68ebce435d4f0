"""The CspNet adapter in its DarkNet form (DarkStage's conv_down, DarkBlocks with an optional SE gate, darknetaa53's
average-pool down): preservation, fast = reference, one-hot when unmixed, every darknet name accepted, the CSP stages
refused."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.models.cspnet import CspNet, CspStemCfg
from torch import nn

from mixlabels import NoAlign, TLAlign, backbones
from mixlabels.backbones.families.cspnet import tiny_cfg

NAMES = ("darknet17", "darknet21", "darknet53", "darknetaa53", "sedarknet21")
REFUSED = ("cspresnet50", "cspresnet50d", "cspresnet50w", "cspresnext50", "cspdarknet53", "cs3darknet_s", "cs3darknet_m",
           "cs3darknet_l", "cs3darknet_x", "cs3darknet_focus_s", "cs3darknet_focus_m", "cs3darknet_focus_l",
           "cs3darknet_focus_x", "cs3sedarknet_l", "cs3sedarknet_x", "cs3sedarknet_xdw", "cs3edgenet_x", "cs3se_edgenet_x")  # fmt: skip

VARIANTS: dict[str, dict[str, Any]] = {
    "dark": {},
    "se": {"attn_layer": "se"},
    "avg_down": {"avg_down": True},
}


def make(variant: str = "dark", drop_path_rate: float = 0.0, stem_stride: int = 1) -> nn.Module:
    torch.manual_seed(0)
    cfg = tiny_cfg(**VARIANTS[variant])
    if stem_stride != 1:  # a smaller first grid (16x16) for the parity runs: the reference's matrices are dense
        cfg.stem = CspStemCfg(out_chs=8, kernel_size=3, stride=stem_stride, pool="")
    return CspNet(cfg=cfg, num_classes=C, drop_path_rate=drop_path_rate, drop_rate=0.2, zero_init_last=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_function_preservation_train_mode(variant: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(variant, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4, stem_stride=2), scheme)


@pytest.mark.parametrize("variant", ["se", "avg_down"])
def test_fast_path_equals_reference_variants(variant: str) -> None:
    check_parity(make(variant, drop_path_rate=0.4, stem_stride=2), "tl_align")


def test_fast_path_equals_reference_pixel_stem() -> None:
    """The darknet stem as timm builds it: a stride-1 3x3 conv on the pixels (grid 32x32)."""
    check_parity(make(drop_path_rate=0.4), "tl_align")


def test_fast_path_equals_reference_token_space() -> None:
    check_parity(make(drop_path_rate=0.4, stem_stride=2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(stem_stride=2), POOLED)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "cspnet")
    for name in NAMES:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    for name in REFUSED:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert "splits the channels and runs residual blocks on one half only" in (family.refusal(model) or ""), name
    with torch.device("meta"):
        assert family.refusal(timm.create_model("resnet18", pretrained=False)) == "ResNet is not a timm CspNet"
    maxpooled = CspNet(cfg=tiny_cfg(), num_classes=C, global_pool="max")
    with pytest.raises(TypeError, match="global_pool='max'"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"
    circular = make()
    circular.stages[1].blocks[0].conv2.conv.padding_mode = "circular"
    with pytest.raises(TypeError, match="stage 1 block 0's branch module 3 .* only static zero padding"):
        backbones.adapt(circular, TLAlign())
    attended = make()
    attended.stages[0].blocks[0].attn = nn.MultiheadAttention(8, 1)
    with pytest.raises(TypeError, match="stage 0 block 0's branch module 2 is MultiheadAttention, which has no label rule"):
        backbones.adapt(attended, TLAlign())
