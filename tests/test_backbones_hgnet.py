"""The HGNet adapter (V1 and V2): preservation, fast = reference, the V2 stem's padded 2x2 rule, every timm name."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.hgnet import HighPerfGpuNet
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones._convnet import Parallel, apply_path, path_matrix
from mixlabels.backbones.families.hgnet import _right_bottom_padded, _stem_path

FAMILY = next(f for f in backbones.FAMILIES if f.name == "hgnet")

STAGES = dict(  # in, mid, out, blocks, downsample, light block, kernel, layers
    stage1=[16, 8, 16, 1, False, False, 3, 2], stage2=[16, 8, 24, 2, True, True, 3, 2],
    stage3=[24, 8, 32, 1, True, True, 5, 2], stage4=[32, 8, 32, 2, True, False, 3, 1],
)  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    "v2": {"cfg": {"stem_type": "v2", "stem_chs": [8, 16], **STAGES}, "use_lab": True},
    "v1": {"cfg": {"stem_type": "v1", "stem_chs": [8, 8, 16], **STAGES}},
}


def make(config: str = "v2", drop_path_rate: float = 0.0) -> nn.Module:
    # grids at 32 px: the stem to 8x8, then 8, 4, 2, 1
    torch.manual_seed(0)
    return HighPerfGpuNet(num_classes=C, head_hidden_size=16, drop_rate=0.2, drop_path_rate=drop_path_rate, **CONFIGS[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_fast_path_equals_reference_v1() -> None:
    check_parity(make("v1", drop_path_rate=0.4), "tokens_aligned")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_padded_2x2_rule_by_hand() -> None:
    """The V2 stem's 2x2 taps on a right-bottom padded map, written out: output (y, x) reads (y, x), (y, x+1), (y+1, x),
    (y+1, x+1) where in the grid, each tap weighed by the kernel's normalised |weight|, renormalised over those inside."""
    torch.manual_seed(2)
    weight = torch.randn(3, 2, 2, 2)
    padded = _right_bottom_padded(weight)
    assert padded.shape == (3, 2, 3, 3) and (padded[..., 0, :] == 0).all() and (padded[..., :, 0] == 0).all()
    x = torch.randn(1, 2, 5, 4)  # the padded kernel with padding 1 is timm's F.pad then an unpadded 2x2 conv
    assert_close(nn.functional.conv2d(x, padded, padding=1), nn.functional.conv2d(nn.functional.pad(x, (0, 1, 0, 1)), weight))
    stem: Any = make().stem
    joined = _stem_path(stem)[1]
    assert isinstance(joined, Parallel)
    (pool,), (conv_a, _) = joined.branches
    grid, labels = (5, 4), torch.rand(2, 20, 6).softmax(-1)
    ref, out = path_matrix((conv_a,), grid)
    assert out == grid
    assert_close(ref, _by_hand(stem.stem2a.conv.weight.detach(), grid))
    assert_close(apply_path((conv_a,), labels, grid)[0], torch.einsum("mn,bnl->bml", ref.float(), labels))
    assert_close(path_matrix((pool,), grid)[0], _by_hand(torch.ones(1, 1, 2, 2), grid))  # the max pool: in-grid taps alike


def _by_hand(weight: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    h, w = grid
    k = weight.double().abs()
    k = (k / k.sum(dim=(-2, -1), keepdim=True)).mean(dim=(0, 1))
    m = torch.zeros(h * w, h * w, dtype=torch.float64)
    for y in range(h):
        for x in range(w):
            for dy in (0, 1):
                for dx in (0, 1):
                    if y + dy < h and x + dx < w:
                        m[y * w + x, (y + dy) * w + x + dx] = k[dy, dx]
    return m / m.sum(-1, keepdim=True)


def test_every_timm_name_adapts_and_refusals() -> None:
    names = timm.list_models(module="hgnet")
    assert len(names) == 10
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("starnet_s1", pretrained=False)) == "StarNet is not a timm HighPerfGpuNet"
        maxpool = timm.create_model("hgnetv2_b0", pretrained=False, global_pool="max")
    assert FAMILY.refusal(maxpool) == "the head (global_pool='max') has no label readout; use 'avg' and a linear fc"
    padded: Any = copy.deepcopy(make())
    padded.stem.stem2a.conv.padding = (1, 1)
    assert FAMILY.refusal(padded) == "the stem's stem2a is not a 2x2 stride-1 unpadded nn.Conv2d (the right-bottom padded kernel rule)"
    circular: Any = copy.deepcopy(make())
    circular.stages[1].blocks[1].layers[0].conv2.conv.padding_mode = "circular"
    with pytest.raises(TypeError, match="stage 1 block 1 module 4 .* only static zero padding has a label rule"):
        backbones.adapt(circular, TLAlign())
    strided: Any = copy.deepcopy(make())
    strided.stages[0].blocks[0].layers[1].conv.stride = (2, 2)
    assert FAMILY.refusal(strided) == "stage 0 block 0 has a strided layer: the concatenation needs every layer on the block's grid"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
