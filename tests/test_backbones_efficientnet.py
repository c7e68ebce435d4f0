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
from timm.layers.mixed_conv2d import MixedConv2d
from timm.models.efficientnet import _gen_efficientnet_x, _gen_mixnet_m
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones._convnet import Parallel, apply_path, path_matrix, path_of, path_refusal

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
    assert family.refusal(mixnet) is None  # MixedConv2d: the one conv its groups make


# MixNet (MixedConv2d: channel groups with kernels 3, 5, 7, 9, some strided), shrunk: mixnet_m's blocks at a quarter
# width, one block per stage; pad_type="same" is tf_mixnet_*'s TF padding (its strided groups Conv2dSame).
def make_mixnet(drop_path_rate: float = 0.0, pad_type: str = "") -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = _gen_mixnet_m("mixnet_m", channel_multiplier=0.25, depth_multiplier=0.25, pretrained=False,
                                     num_classes=C, drop_path_rate=drop_path_rate, drop_rate=0.2, pad_type=pad_type)
    mixed = [mod for mod in model.modules() if isinstance(mod, MixedConv2d)]
    assert any(len(mod) > 2 and mod["0"].stride == (2, 2) for mod in mixed)  # strided 3.5.7(.9) depthwise groups
    assert any(len(mod) > 2 and mod["0"].stride == (1, 1) for mod in mixed)
    return model


@pytest.mark.parametrize("pad_type", ["", "same"])
def test_mixnet_preservation(pad_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_backbones_common, "IMG", 30 if pad_type else 32)
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make_mixnet(0.5, pad_type), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", ["tl_align", "tl_no_norm", "tokens_aligned"])
def test_mixnet_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make_mixnet(0.4), scheme)


@pytest.mark.parametrize("size", SAME_SIZES)
def test_tf_mixnet_fast_path_equals_reference(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_backbones_common, "IMG", size)
    check_parity(make_mixnet(0.4, "same"), "tl_align")
    check_unmixed_is_one_hot(make_mixnet(pad_type="same"), ["tl_align"])


def _one_conv(mixed: MixedConv2d, same: bool) -> nn.Conv2d:
    """The single depthwise conv a MixedConv2d equals: every group's kernel zero-padded, centred, to the largest."""
    groups: list[Any] = list(mixed.values())
    big, stride = max(int(g.kernel_size[0]) for g in groups), groups[0].stride
    conv: nn.Conv2d = (Conv2dSame(mixed.in_channels, mixed.out_channels, big, stride, groups=mixed.in_channels, bias=False)
                       if same else nn.Conv2d(mixed.in_channels, mixed.out_channels, big, stride, big // 2, groups=mixed.in_channels, bias=False))
    with torch.no_grad():
        conv.weight.copy_(torch.cat([F.pad(g.weight, [(big - int(g.kernel_size[0])) // 2] * 4) for g in groups]))
    return conv


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", ["", "same"])
def test_mixed_conv_is_the_one_conv_it_equals(stride: int, padding: str) -> None:
    """By hand: a MixedConv2d computes exactly one depthwise conv with zero-padded kernels, and its labels are that
    conv's under the project's rule (a stride-1 conv: mean over every (out, in) pair of |kernel| / sum, one
    renormalisation over in-grid taps; strided: the largest kernel's windows). Unequal groups (channels 6, 4, 4)."""
    torch.manual_seed(0)
    mixed = MixedConv2d(14, 14, [3, 5, 7], stride=stride, padding=padding, depthwise=True)
    assert path_refusal([mixed], "mixed") is None
    conv = _one_conv(mixed, same=padding == "same" and stride > 1)
    for size in (9, 10):
        x = torch.randn(2, 14, size, size)
        assert_close(mixed(x), conv(x), rtol=1e-5, atol=1e-5)
        grid = (size, size)
        (m_mixed, out), (m_conv, out_conv) = path_matrix(path_of([mixed]), grid), path_matrix(path_of([conv]), grid)
        assert out == out_conv == tuple(mixed(x).shape[2:])
        assert_close(m_mixed, m_conv, rtol=0, atol=1e-12)
        y = torch.softmax(torch.randn(2, size * size, 5, dtype=torch.float64), dim=-1)
        assert_close(apply_path(path_of([mixed]), y, grid)[0].double(), m_conv @ y, rtol=1e-5, atol=1e-6)
    if stride == 1:
        # the rule by hand on the 9x9 grid: channel-weighted kernel (6/14, 4/14, 4/14 of each group's mean)
        k = torch.zeros(7, 7, dtype=torch.float64)
        for g in mixed.values():
            w = g.weight.detach().double().abs()
            w = w / w.sum(dim=(-2, -1), keepdim=True)
            k += F.pad(w.sum(dim=(0, 1)), [(7 - int(g.kernel_size[0])) // 2] * 4) / 14
        t = torch.zeros(81, 81, dtype=torch.float64)
        for i in range(81):
            for dy in range(-3, 4):
                for dx in range(-3, 4):
                    y0, x0 = i // 9 + dy, i % 9 + dx
                    if 0 <= y0 < 9 and 0 <= x0 < 9:
                        t[i, y0 * 9 + x0] = k[dy + 3, dx + 3]
        assert_close(path_matrix(path_of([mixed]), (9, 9))[0], t / t.sum(dim=-1, keepdim=True), rtol=0, atol=1e-12)
        # not the concatenation of three convs each renormalised on its own: they differ at the border
        groups = [path_of([g]) for g in mixed.values()]
        concat = path_matrix((Parallel.concat(groups, [6, 4, 4]),), (9, 9))[0]
        assert (concat - t / t.sum(dim=-1, keepdim=True)).abs().max() > 1e-3


def test_mixed_conv_refusals() -> None:
    assert "even kernel" in str(path_refusal([MixedConv2d(8, 8, [3, 4], depthwise=True)], "m"))
    off = MixedConv2d(8, 8, [3, 5], depthwise=True)
    off["1"].padding = (1, 1)  # not centred on the 5x5: not one conv
    assert "not centred" in str(path_refusal([off], "m"))
    assert path_of([MixedConv2d(8, 8, [1, 1])]) == ()  # 1x1 groups: a channel op


# efficientnet_x_*/h_*: block 0 starts with a space-to-depth conv (s2d: 2x2 stride-2 'same') and runs a 2x2 'same'
# depthwise conv (stride 1: one zero tap before); shrunk to a quarter width and depth.
def make_x(drop_path_rate: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = _gen_efficientnet_x("efficientnet_x_b3", channel_multiplier=0.25, depth_multiplier=0.25,
                                           pretrained=False, num_classes=C, drop_path_rate=drop_path_rate, drop_rate=0.2)
    assert any(isinstance(mod, Conv2dSame) and mod.stride == (1, 1) for mod in model.modules())
    return model


@pytest.mark.parametrize("size", SAME_SIZES)
def test_space_to_depth_preservation_and_parity(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_backbones_common, "IMG", size)  # 30: the s2d conv on a 15x15 grid pads (0, 1)
    check_preservation(make_x(0.5), SCHEMES["tokens_aligned"])
    check_parity(make_x(0.4), "tl_align")


def test_space_to_depth_unmixed_and_schemes() -> None:
    check_parity(make_x(0.4), "tokens_aligned")
    check_unmixed_is_one_hot(make_x(), ["tl_align"])


def test_stride1_same_conv_is_the_static_conv_it_equals() -> None:
    """By hand: a stride-1 2x2 Conv2dSame (pads 0 before, 1 after) equals a 3x3 conv, padding 1, whose first row and
    column are zero, on every grid; its labels are that conv's."""
    torch.manual_seed(0)
    same = Conv2dSame(6, 6, 2, 1, groups=6, bias=False)
    conv = nn.Conv2d(6, 6, 3, 1, 1, groups=6, bias=False)
    with torch.no_grad():
        conv.weight.copy_(F.pad(same.weight, (1, 0, 1, 0)))
    assert path_refusal([same], "same") is None
    for size in (7, 8):
        x = torch.randn(2, 6, size, size)
        assert_close(same(x), conv(x), rtol=1e-5, atol=1e-5)
        (m_same, out), (m_conv, _) = path_matrix(path_of([same]), (size, size)), path_matrix(path_of([conv]), (size, size))
        assert out == (size, size)
        assert_close(m_same, m_conv, rtol=0, atol=1e-12)
        assert (m_same.diagonal() > 0).all() and m_same[0, 1] > 0 and m_same[1, 0] == 0  # reads itself, right, below
    dilated = Conv2dSame(6, 6, 2, 1, dilation=3, groups=6, bias=False)
    assert "dilated Conv2dSame" in str(path_refusal([dilated], "d"))
