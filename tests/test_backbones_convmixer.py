"""The ConvMixer adapter: preservation, fast = reference, 'same' padding resolved, every timm name, refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.convmixer import ConvMixer
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones.families.convmixer import static_padding

FAMILY = next(f for f in backbones.FAMILIES if f.name == "convmixer")


def make(**kwargs: Any) -> nn.Module:
    # 4x4 patches: an 8x8 grid at 32 px; three blocks of width 16 with 5x5 depthwise convs
    torch.manual_seed(0)
    return ConvMixer(**{"dim": 16, "depth": 3, "kernel_size": 5, "patch_size": 4, "num_classes": C, "drop_rate": 0.2, **kwargs})


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(), "tl_align", token_space=True)
    check_parity(make(patch_size=3, kernel_size=3, act_layer=nn.ReLU), "tokens_aligned")  # 10x10 of 32 px: 2 cut off


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


@pytest.mark.parametrize(("kernel", "dilation"), [(3, 1), (5, 1), (9, 1), (3, 2), (4, 2)])  # (4, 2): an even kernel, dilated to even totals
def test_same_padding_is_pytorchs(kernel: int, dilation: int) -> None:
    """The static padding given to the label rule pads as PyTorch's 'same' conv does (same output, every size)."""
    conv = nn.Conv2d(2, 2, kernel, padding="same", dilation=dilation)
    padding = static_padding(conv)
    assert not isinstance(padding, str)
    x = torch.randn(1, 2, 7, 6)
    assert_close(conv(x), nn.functional.conv2d(x, conv.weight, conv.bias, padding=padding, dilation=dilation))


def test_every_timm_name_adapts_and_refusals() -> None:
    names = timm.list_models(module="convmixer")
    assert len(names) == 3
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        maxpool = timm.create_model("convmixer_768_32", pretrained=False, global_pool="max")
        assert FAMILY.refusal(timm.create_model("starnet_s1", pretrained=False)) == "StarNet is not a timm ConvMixer"
    assert FAMILY.refusal(maxpool) == "global_pool='max' has no label readout; use 'avg'"
    even = make(kernel_size=4)
    assert FAMILY.refusal(even) == (
        "block 0's branch module 0: padding='same' with kernel (4, 4) (dilation (1, 1)) pads one side more than the "
        "other; use an odd kernel"
    )
    overlap: Any = copy.deepcopy(make())
    overlap.stem[0] = nn.Conv2d(3, 16, 7, stride=4, padding=3)
    assert FAMILY.refusal(overlap) == "the stem is not a patch conv (kernel == stride, no padding): only patch stems are supported"
    spatial_after: Any = copy.deepcopy(make())
    spatial_after.blocks[1][1] = nn.Conv2d(16, 16, 3, padding=1)
    assert FAMILY.refusal(spatial_after) == (
        "block 1 mixes positions after its residual: only 1x1 stride-1 convs, norms and activations are supported there"
    )
    reflect: Any = copy.deepcopy(make())
    reflect.blocks[2][0].fn[0].padding_mode = "reflect"
    with pytest.raises(TypeError, match=r"block 2's branch module 0 \(stride \(1, 1\), 'reflect' padding 'same'\): only stride-1 zero"):
        backbones.adapt(reflect, TLAlign())
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
