"""The CspNet adapter: its DarkNet form (DarkStage's conv_down, DarkBlocks with an optional SE gate, darknetaa53's
average-pool down) and its cross stages (CrossStage, CrossStage3: blocks on half the channels between a fork and a
join of the labels): preservation, fast = reference, one-hot when unmixed, every cspnet name accepted, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.models.cspnet import CspNet, CspStemCfg
from torch import nn
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, backbones
from mixlabels.backbones._convnet import CrossPart
from mixlabels.backbones.families.cspnet import CSP_KINDS, _units, tiny_cfg, tiny_csp_cfg

NAMES = ("darknet17", "darknet21", "darknet53", "darknetaa53", "sedarknet21")
CSP_NAMES = ("cspresnet50", "cspresnet50d", "cspresnet50w", "cspresnext50", "cspdarknet53", "cs3darknet_s", "cs3darknet_m",
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


def make_csp(kind: str = "csp", drop_path_rate: float = 0.0, stem_stride: int = 1, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    cfg = tiny_csp_cfg(kind, **kwargs)
    if stem_stride != 1:
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


@pytest.mark.parametrize("kind", CSP_KINDS)
def test_cross_stages_function_preservation_train_mode(kind: str) -> None:
    check_preservation(make_csp(kind, drop_path_rate=0.5, stem_stride=2), SCHEMES["none"])
    gated = {"attn_layer": "se", "groups": 2} if kind in ("csp", "cs3_edge") else {}  # BottleneckBlock's, EdgeBlock's gates
    check_preservation(make_csp(kind, drop_path_rate=0.5, stem_stride=2, **gated), SCHEMES["tokens_aligned"])


@pytest.mark.parametrize("scheme", POOLED)
def test_cross_stage_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make_csp("csp", drop_path_rate=0.4, stem_stride=2), scheme)


@pytest.mark.parametrize(("kind", "scheme"), [("cs3", "tl_align"), ("cs3", "tokens"), ("csp_dark", "tl_no_norm"),
                                              ("cs3_edge", "tokens_aligned")])  # fmt: skip
def test_cross_stages_fast_path_equals_reference_variants(kind: str, scheme: str) -> None:
    check_parity(make_csp(kind, drop_path_rate=0.4, stem_stride=2, attn_layer="se", groups=2), scheme)


def test_cross_stages_pixel_stem_token_space_and_unmixed() -> None:
    check_parity(make_csp("cs3_edge", drop_path_rate=0.4), "tl_official")  # the stride-1 stem: grid 32x32, CrossStage3
    check_parity(make_csp("csp", drop_path_rate=0.4, stem_stride=2), "tl_align", token_space=True)
    check_unmixed_is_one_hot(make_csp("cs3", stem_stride=2), POOLED)


def test_cross_stage_units_fork_and_join_half_the_channels() -> None:
    model: Any = make_csp("csp")
    units = _units(model)
    parts = [u for u in units if isinstance(u, CrossPart)]
    assert len(parts) == 3 and parts[1].units == tuple(model.stages[1].blocks)
    x = torch.randn(2, int(model.stages[1].expand_chs), 4, 4)  # 48 channels
    waiting, running = parts[1].split(x)
    assert_close(waiting, x[:, : x.shape[1] // 2])  # CrossStage: xs waits, xb runs the blocks
    joined = parts[1].cat(waiting, running)
    assert joined.shape[1] == 2 * waiting.shape[1]  # the waiting half's share: 1/2
    cs3: Any = make_csp("cs3")
    x = torch.randn(2, int(cs3.stages[0].expand_chs), 4, 4)  # 16 channels
    part = _units(cs3)[2]  # stage 0: conv_down, conv_exp, then the cross part
    assert isinstance(part, CrossPart)
    waiting, running = part.split(x)
    assert_close(running, x[:, : x.shape[1] // 2])  # CrossStage3: x1 runs, x2 waits


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "cspnet")
    for name in (*NAMES, *CSP_NAMES):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    assert set(timm.list_models(module="cspnet")) == {*NAMES, *CSP_NAMES}
    transition = make_csp("csp")
    transition.stages[1].conv_transition_b.conv = nn.Conv2d(12, 12, 3, padding=1)
    with pytest.raises(TypeError, match="stage 1's conv_transition_b is not a 1x1 stride-1 conv"):
        backbones.adapt(transition, TLAlign())
    strided = make_csp("cs3")
    strided.stages[2].blocks[0].conv2.conv.stride = (2, 2)
    with pytest.raises(TypeError, match="stage 2 block 0's branch changes the grid"):
        backbones.adapt(strided, TLAlign())
    odd = make_csp("cs3")
    odd.stages[0].blocks[0] = nn.Conv2d(8, 8, 1)
    with pytest.raises(TypeError, match="stage 0 block 0 is Conv2d; only timm's DarkBlock, BottleneckBlock and EdgeBlock"):
        backbones.adapt(odd, TLAlign())
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
