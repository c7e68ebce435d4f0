"""The TResNet adapter (space-to-depth stem, blur-pool anti-aliasing, BasicBlock/Bottleneck with SE, average-pool
shortcuts, 'fast' average pooling): preservation, fast = reference, the stem's windows, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.models.tresnet import TResNet
from torch import nn

from mixlabels import TLAlign, backbones
from mixlabels.backbones._convnet import Window
from mixlabels.backbones.families.tresnet import _stem_path

FAMILY = next(f for f in backbones.FAMILIES if f.name == "tresnet")


def make(v2: bool = False, **kwargs: Any) -> nn.Module:
    """One block a stage, 8 planes: grids 8 (stem), 8, 4, 2, 1 at 32 px; v2's first stages are Bottlenecks."""
    torch.manual_seed(0)
    return TResNet(layers=[1, 1, 1, 1], width_factor=0.125, v2=v2, num_classes=C, drop_rate=0.2, drop_path_rate=0.3, **kwargs)


@pytest.mark.parametrize("v2", [False, True])
def test_function_preservation_train_mode(v2: bool) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(v2), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(v2=True), "tl_align")
    check_parity(make(global_pool="avg"), "tl_align")
    check_parity(make(), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(v2=True), POOLED)


def test_stem_is_the_space_to_depth_windows_then_the_conv() -> None:
    model: Any = make()
    window, conv = _stem_path(model)
    assert window == Window((4, 4), (4, 4), (0, 0)) and conv is model.body.conv1.conv
    blk: Any = model.body.layer2[0]
    path, shortcut = backbones.AdaptedTResNet(model, TLAlign())._paths(blk)
    assert path == (blk.conv1.conv, Window((3, 3), (2, 2), (1, 1)), blk.conv2.conv)  # the blur pool after the 3x3 conv
    assert shortcut == (Window((2, 2), (2, 2), (0, 0), ceil_mode=True),)


def test_timm_names_adapt_and_refusals() -> None:
    for name in timm.list_models(module="tresnet"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        maxpool = timm.create_model("tresnet_m", pretrained=False, global_pool="max")
    with pytest.raises(TypeError, match=r"the head \(global_pool='max', use_conv=False\) has no label readout"):
        backbones.AdaptedTResNet(maxpool, TLAlign())
    model: Any = make()
    model.body.layer2[0].conv1.aa = nn.Conv2d(16, 16, 3, stride=2, padding=2, dilation=2, groups=16)
    with pytest.raises(TypeError, match="block 1's branch module 2 is a strided dilated convolution"):
        backbones.AdaptedTResNet(model, TLAlign())
    model = make()
    del model.body.layer4
    with pytest.raises(TypeError, match=r"the body holds \['s2d', 'conv1', 'layer1', 'layer2', 'layer3'\]"):
        backbones.AdaptedTResNet(model, TLAlign())
