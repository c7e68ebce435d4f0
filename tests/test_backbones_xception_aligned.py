"""The aligned Xception adapter (separable convs; identity, 1x1 and strided 1x1 shortcuts as resnet's; the last block
without skip; pre-activation and dilated variants): preservation, fast = reference, one-hot, every timm name, refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch import nn

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones._convnet import Window
from mixlabels.backbones.families.xception_aligned import AdaptedXceptionAligned, tiny_xception

FAMILY = next(f for f in backbones.FAMILIES if f.name == "xception_aligned")

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},  # xception41's blocks: start_with_relu, the last without skip and with its activations inside
    "preact": {"preact": True},  # xception41p's: pre-activation blocks, a final activation
    "os8": {"output_stride": 8},  # the last strided block at stride 1 (a 1x1 conv shortcut), then a dilated block
}


def make(config: str = "default", drop_path_rate: float = 0.0) -> nn.Module:
    return tiny_xception(num_classes=C, drop_path_rate=drop_path_rate, drop_rate=0.2, **CONFIGS[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["preact", "os8"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("preact"), POOLED)


def test_shortcuts_and_layers() -> None:
    adapted: Any = backbones.adapt(make(), TLAlign())
    blocks = adapted._blocks()
    assert [adapted._is_layer(b) for b in blocks] == [True, True, True, True, False, False]  # no skip; final act
    # a strided block: its last depthwise 3x3 stride-2 conv and its 1x1 stride-2 shortcut aggregate (resnet's rule)
    branch, shortcut = adapted._paths(blocks[0])
    assert branch[-1] == Window((3, 3), (2, 2), (1, 1)) and shortcut == (Window((1, 1), (2, 2), (0, 0)),)
    assert adapted._paths(blocks[1])[1] == ()  # the identity
    assert adapted._paths(blocks[4])[1] is None and len(adapted._paths(blocks[4])[0]) == 3  # aggregates by its convs
    dilated: Any = backbones.adapt(make("os8"), TLAlign())
    assert dilated._paths(dilated._blocks()[3])[1] == ()  # stride 1 now: a 1x1 conv shortcut keeps the labels
    assert [op.dilation for op in dilated._paths(dilated._blocks()[4])[0]] == [(2, 2)] * 3


def test_every_timm_name_adapts_and_refusals() -> None:
    names = timm.list_models(module="xception_aligned")
    assert len(names) == 5
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("legacy_xception", pretrained=False)) == "Xception is not a timm XceptionAligned"
        maxpool = timm.create_model("xception41", pretrained=False, global_pool="max")
    assert FAMILY.refusal(maxpool) == "the head's global_pool='max' has no label readout; use 'avg'"
    circular: Any = copy.deepcopy(make())
    circular.blocks[1].stack.conv2.conv_dw.padding_mode = "circular"
    with pytest.raises(TypeError, match="block 1's branch module 8 .* only static zero padding has a label rule"):
        backbones.adapt(circular, TLAlign())
    dilated: Any = copy.deepcopy(make())
    dilated.blocks[0].shortcut.conv = nn.Conv2d(64, 16, 3, stride=2, padding=2, dilation=2)
    assert FAMILY.refusal(dilated) == "block 0's shortcut module 0 is a strided dilated convolution; only undilated strided convolutions aggregate here"
    attention: Any = copy.deepcopy(make("preact"))
    attention.blocks[2].norm = nn.MultiheadAttention(16, 1)
    assert FAMILY.refusal(attention) == (
        "block 2's norm module 0 is MultiheadAttention, which has no label rule here (a conv, pool, norm, activation or channel gate)"
    )
    assert isinstance(backbones.adapt(make(), TLAlign()), AdaptedXceptionAligned)
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
