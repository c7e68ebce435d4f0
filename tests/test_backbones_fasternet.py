"""The FasterNet adapter (partial conv: a 3x3 conv on the first channels, the rest untouched, concatenated):
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
from mixlabels.backbones.families.fasternet import _branch_path

FAMILY = next(f for f in backbones.FAMILIES if f.name == "fasternet")

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},  # n_div 4: at width 8 two channels through the conv, six untouched
    "ls": {"layer_scale_init_value": 0.5, "n_div": 2, "patch_norm": False},  # layer scale, half the channels convolved
    "slicing": {"pconv_fw_type": "slicing"},  # timm's inference-only forward: it writes into a copy, no backward
}


def make(config: str = "default", drop_path_rate: float = 0.0) -> nn.Module:
    # stages of 1, 1, 2, 1 blocks (widths 8, 16, 32, 64; the stem to 8x8, then grids 8, 4, 2, 1 at 32 px)
    torch.manual_seed(0)
    model: nn.Module = timm.create_model(
        "fasternet_t0", pretrained=False, embed_dim=8, depths=(1, 1, 2, 1), feature_dim=32, num_classes=C,
        drop_path_rate=drop_path_rate, drop_rate=0.2, **CONFIGS[config],
    )  # fmt: skip
    return model


@pytest.mark.parametrize("config", ["default", "ls"])
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["ls", "slicing"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_partial_conv_concatenates_by_channels() -> None:
    blk: Any = make().stages[1].blocks[0]  # 16 wide, n_div 4: 4 through the conv, 12 untouched
    concat = _branch_path(blk)[0]
    assert isinstance(concat, Parallel) and concat.weights == (4.0, 12.0)
    assert concat.branches == ((blk.spatial_mixing.partial_conv3,), ())
    assert len(_branch_path(blk)) == 1  # the MLP: channel ops


def test_every_timm_name_adapts_and_refusals() -> None:
    names = timm.list_models(module="fasternet")
    assert len(names) == 6
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("starnet_s1", pretrained=False)) == "StarNet is not a timm FasterNet"
        maxpool = timm.create_model("fasternet_t0", pretrained=False, global_pool="max")
    assert FAMILY.refusal(maxpool) == "global_pool='max' has no label readout; use 'avg'"
    circular: Any = copy.deepcopy(make())
    circular.stages[2].blocks[1].spatial_mixing.partial_conv3.padding_mode = "circular"
    with pytest.raises(TypeError, match="stage 2 block 1's partial conv module 0 .* only static zero padding has a label rule"):
        backbones.adapt(circular, TLAlign())
    spatial_mlp: Any = copy.deepcopy(make())
    spatial_mlp.stages[1].blocks[0].mlp[0] = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
    assert FAMILY.refusal(spatial_mlp) == (
        "stage 1 block 0's branch has a strided conv or a pool: the residual sum needs the branch on the block's grid (stride 1)"
    )
    attention: Any = copy.deepcopy(make())
    attention.stages[3].downsample.norm = nn.MultiheadAttention(64, 1)
    assert FAMILY.refusal(attention) == (
        "stage 3's downsample module 1 is MultiheadAttention, which has no label rule here "
        "(a conv, pool, norm, activation or channel gate)"
    )
    big_head: Any = copy.deepcopy(make())
    big_head.conv_head = nn.Conv2d(64, 32, 3, padding=1)
    assert FAMILY.refusal(big_head) == (
        "the head's conv_head has kernel (3, 3): it runs on the pooled map, only a 1x1 stride-1 conv has a label readout"
    )
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
