"""The SelecSLS adapter (blocks concatenating their conv chain's outputs and their stage's first output; no residual
sum): preservation, fast = reference, a stage's path by hand, refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.models.selecsls import SelecSls
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, backbones
from mixlabels.backbones._convnet import apply_path, path_matrix, path_of
from mixlabels.backbones.families.selecsls import TINY_CFG, _stage_path, _stages

FAMILY = next(f for f in backbones.FAMILIES if f.name == "selecsls")


def make() -> nn.Module:
    torch.manual_seed(0)
    return SelecSls(copy.deepcopy(TINY_CFG), num_classes=C, drop_rate=0.2)


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(), scheme)


def test_fast_path_equals_reference_token_space() -> None:
    check_parity(make(), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def _block_matrix(blk: Any, grid: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """``cat[d1, d2, d3]`` of one block by hand: each part's chain matrix, weighed by its channels."""
    d1, out = path_matrix(path_of(list(blk.conv1)), grid)
    d2 = path_matrix(path_of([*blk.conv2, *blk.conv3]), out)[0] @ d1
    d3 = path_matrix(path_of([*blk.conv4, *blk.conv5]), out)[0] @ d2
    widths = [blk.conv1[0].out_channels, blk.conv3[0].out_channels, blk.conv5[0].out_channels]
    return sum(w * d for w, d in zip(widths, (d1, d2, d3))) / sum(widths), out  # type: ignore[return-value]


def test_stage_path_reads_the_first_blocks_output_as_skip() -> None:
    """Stage 1 (three blocks on a 16x16 grid): block 1 gives ``S``; blocks 2 and 3 join their chain's parts with ``S``
    (not with their own input), weighed by channel count: the nested path equals that recursion, in both walks."""
    stage = _stages(make())[0]
    assert len(stage) == 3
    first, out = _block_matrix(stage[0], (16, 16))
    y = first
    for blk in stage[1:]:
        chain, _ = _block_matrix(blk, out)
        skip = blk.conv6[0].in_channels - 16  # the chain's 8 + 4 + 4 channels
        y = (16 * chain @ y + skip * first) / (16 + skip)
    m, grid = path_matrix(_stage_path(stage), (16, 16))
    assert grid == out == (8, 8)
    assert_close(m, y)
    labels = torch.rand(2, 256, 5).softmax(-1)
    fast, _ = apply_path(_stage_path(stage), labels, (16, 16))
    assert_close(fast, torch.einsum("mn,bnl->bml", y.float(), labels), rtol=1e-5, atol=1e-6)


def test_timm_names_adapt_and_refusals() -> None:
    for name in timm.list_models(module="selecsls"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        maxpool = timm.create_model("selecsls42b", pretrained=False, global_pool="max")
    with pytest.raises(TypeError, match=r"the head \(global_pool='max'\) has no label readout"):
        backbones.AdaptedSelecSls(maxpool, TLAlign())
    model: Any = make()
    model.features[1].conv3[0] = nn.Conv2d(8, 4, 3, padding=2, dilation=1)
    with pytest.raises(TypeError, match=r"features block 1's conv3 module 0 is a stride-1 \(3, 3\) conv with padding \(2, 2\)"):
        backbones.AdaptedSelecSls(model, TLAlign())
    model = make()
    model.features[0].is_first = False
    with pytest.raises(TypeError, match=r"features block 0 reads a skip no block before it made \(is_first=False\)"):
        backbones.AdaptedSelecSls(model, TLAlign())
    model = make()
    model.head[1][0] = nn.Conv2d(32, 32, 3, padding=1, padding_mode="reflect")
    with pytest.raises(TypeError, match="head conv 1 module 0 .* only static zero padding has a label rule"):
        backbones.AdaptedSelecSls(model, TLAlign())
