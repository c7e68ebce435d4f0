"""The legacy SENet adapter (SE basic blocks, SE-ResNet and SE-ResNeXt bottlenecks, SENet-154's 3x3 stem and 3x3/2
shortcuts): preservation, fast = reference, one-hot when unmixed, every timm name accepted, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.senet import SEBottleneck, SENet, SEResNetBlock, SEResNetBottleneck, SEResNeXtBottleneck
from torch import nn

from mixlabels import NoAlign, TLAlign, TransMix, backbones

# 32 px: the stem to 16x16, its ceil-mode max pool to 8x8, then 8, 4, 2, 1 positions a side. SENet's stage widths are
# fixed (64..512 planes); the blocks cover the four block classes, senet154's stem and 3x3/2 shortcuts.
CONFIGS: dict[str, dict[str, Any]] = {
    "basic": {"block": SEResNetBlock, "layers": (1, 1, 1, 1), "groups": 1, "reduction": 16, "inplanes": 16},
    "seresnet": {"block": SEResNetBottleneck, "layers": (2, 1, 1, 1), "groups": 1, "reduction": 16, "inplanes": 16},
    "seresnext": {"block": SEResNeXtBottleneck, "layers": (1, 1, 1, 1), "groups": 4, "reduction": 16, "inplanes": 16},
    "senet154": {"block": SEBottleneck, "layers": (1, 1, 1, 1), "groups": 8, "reduction": 16, "inplanes": 16,
                 "input_3x3": True, "downsample_kernel_size": 3, "downsample_padding": 1},
}  # fmt: skip

NAMES = ("legacy_seresnet18", "legacy_seresnet34", "legacy_seresnet50", "legacy_seresnet101", "legacy_seresnet152",
         "legacy_seresnext26_32x4d", "legacy_seresnext50_32x4d", "legacy_seresnext101_32x4d", "legacy_senet154")  # fmt: skip


def make(config: str) -> nn.Module:
    torch.manual_seed(0)
    return SENet(num_classes=C, drop_rate=0.2, **CONFIGS[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("basic"), scheme)


@pytest.mark.parametrize("config", ["seresnet", "seresnext", "senet154"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config), "tl_align")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make("senet154"), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("seresnext"), POOLED)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "senet")
    for name in NAMES:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        assert family.refusal(timm.create_model("seresnet50", pretrained=False)) == "ResNet is not a timm legacy SENet"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("basic"), TransMix())(images, lm)
    maxpooled = SENet(num_classes=C, global_pool="max", **CONFIGS["basic"])
    with pytest.raises(TypeError, match="global_pool='max' has no label readout"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    circular = make("basic")
    circular.layer1[0].conv2.padding_mode = "circular"
    with pytest.raises(TypeError, match="block 0's branch module 3 .* only static zero padding"):
        backbones.adapt(circular, TLAlign())
    gated = make("basic")
    gated.layer1[0].se_module = nn.MultiheadAttention(64, 1)
    with pytest.raises(TypeError, match="block 0's branch module 6 is MultiheadAttention, which has no label rule"):
        backbones.adapt(gated, TLAlign())
