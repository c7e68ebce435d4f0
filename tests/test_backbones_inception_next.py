"""The InceptionNeXt adapter (Inception depthwise token mixer: untouched, square, 1xk and kx1 band parts concatenated):
preservation, fast = reference, one-hot when unmixed, every timm name, refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch import nn

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones._convnet import Parallel
from mixlabels.backbones.families.inception_next import _mixer_path

FAMILY = next(f for f in backbones.FAMILIES if f.name == "inception_next")

CONFIGS: dict[str, dict[str, Any]] = {
    "atto": {},  # branch_ratio 0.25, band 9: at width 8 two channels each, two untouched
    "tiny": {"token_mixers": None},  # timm's default mixer (branch_ratio 0.125, band 11): one channel each at width 8
    "os16": {"output_stride": 16},  # the last stage dilated: its downsampler a stride-1 'same' 2x2 conv (aggregates)
}


def make(config: str = "atto", drop_path_rate: float = 0.0) -> nn.Module:
    # stages of 1, 1, 2, 1 blocks (widths 8, 16, 24, 32; the stem to 8x8, then grids 8, 4, 2, 1 at 32 px)
    torch.manual_seed(0)
    kwargs = dict(CONFIGS[config])
    name = "inception_next_tiny" if kwargs.pop("token_mixers", 0) is None else "inception_next_atto"
    model: nn.Module = timm.create_model(
        name, pretrained=False, depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), num_classes=C, ls_init_value=1.0,
        drop_path_rate=drop_path_rate, drop_rate=0.2, **kwargs,
    )  # fmt: skip
    return model


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["tiny", "os16"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_inception_mixer_concatenates_by_channels() -> None:
    mixer: Any = make().stages[1].blocks[0].token_mixer  # 16 wide, branch_ratio 0.25: 4 untouched, then 4 each
    (concat,) = _mixer_path(mixer)
    assert isinstance(concat, Parallel) and concat.weights == (4.0, 4.0, 4.0, 4.0)
    assert concat.branches == ((), (mixer.dwconv_hw,), (mixer.dwconv_w,), (mixer.dwconv_h,))
    narrow: Any = make("tiny").stages[0].blocks[0].token_mixer  # 8 wide, branch_ratio 0.125: 5 untouched, 1 each
    assert _mixer_path(narrow)[0].weights == (5.0, 1.0, 1.0, 1.0)


def test_every_timm_name_adapts_and_refusals() -> None:
    names = timm.list_models(module="inception_next")
    assert len(names) == 4
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("convnext_atto", pretrained=False)) == "ConvNeXt is not a timm MetaNeXt (InceptionNeXt)"
        maxpool = timm.create_model("inception_next_atto", pretrained=False, global_pool="max")
    assert FAMILY.refusal(maxpool) == "the head's pool_type='max' has no label readout; use 'avg'"
    circular: Any = copy.deepcopy(make())
    circular.stages[2].blocks[1].token_mixer.dwconv_w.padding_mode = "circular"
    with pytest.raises(TypeError, match="stage 2 block 1's token mixer module 1 .* only static zero padding has a label rule"):
        backbones.adapt(circular, TLAlign())
    strided: Any = copy.deepcopy(make())
    strided.stages[1].blocks[0].token_mixer = nn.AvgPool2d(3, 2, 1)
    assert FAMILY.refusal(strided) == (
        "stage 1 block 0's branch has a strided conv or a pool: the residual sum needs the branch on the block's grid (stride 1)"
    )
    attention: Any = copy.deepcopy(make())
    attention.stages[3].downsample[0] = nn.MultiheadAttention(24, 1)
    assert FAMILY.refusal(attention) == (
        "stage 3's downsampler module 0 is MultiheadAttention, which has no label rule here "
        "(a conv, pool, norm, activation or channel gate)"
    )
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
