"""The Nest adapter: preservation, fast = reference, the ConvPool rules, names, refusals."""

from __future__ import annotations

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, set_fused, sharpen
from timm.models.nest import Nest
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TransMix, backbones
from mixlabels.backbones.families.nest import _pool_matrix, _pool_merge

PADS = ["", "same"]  # PyTorch symmetric padding; TF 'same' (the nest_*_jx models): the max pool pads after only


def make(pad_type: str = "", drop_path_rate: float = 0.0) -> torch.nn.Module:
    """Three levels on 32 px, patch 4: 8x8 tokens in 16 blocks of 2x2, then 4x4 in 4 blocks, then one 2x2 block."""
    torch.manual_seed(0)
    model = Nest(img_size=32, patch_size=4, num_levels=3, embed_dims=(8, 16, 32), num_heads=(1, 2, 2), depths=(1, 1, 1),
                 num_classes=C, drop_path_rate=drop_path_rate, pad_type=pad_type)
    return sharpen(model)


@pytest.mark.parametrize("pad_type", PADS)
def test_function_preservation_train_mode(pad_type: str) -> None:
    check_preservation(make(pad_type, drop_path_rate=0.5), SCHEMES["tokens_aligned"])
    check_preservation(set_fused(make(pad_type, drop_path_rate=0.5), False), SCHEMES["tl_align"])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("same", drop_path_rate=0.4), scheme)


def test_variants_fast_equal_reference() -> None:
    check_parity(make("", drop_path_rate=0.4), "tl_align")
    check_parity(set_fused(make("", drop_path_rate=0.2), False), "tokens_aligned")
    check_parity(make("", drop_path_rate=0.2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("same"), POOLED)


def test_same_padding_pool_windows() -> None:
    """TF 'same' 3x3/2 on a 4x4 grid pads one row and column after: output (0, 0) sums rows and columns 0-2,
    output (1, 1) rows and columns 2-3 only; the fast sums equal the explicit matrix."""
    pool = make("same").levels[1].pool.pool
    matrix, out = _pool_matrix((4, 4), pool)
    assert out == (2, 2)
    assert matrix[0].reshape(4, 4)[:3, :3].sum() == 9 and matrix[0].sum() == 9
    assert matrix[3].reshape(4, 4)[2:, 2:].sum() == 4 and matrix[3].sum() == 4
    y = torch.rand(2, 16, 3, dtype=torch.float64)
    assert_close(_pool_merge(y, (4, 4), pool)[0], matrix @ y)
    static = make("").levels[1].pool.pool  # padding 1 both sides: output (0, 0) sums rows and columns 0-1
    assert _pool_matrix((4, 4), static)[0][0].sum() == 4


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "nest")
    for name in ("nest_tiny", "nest_tiny_jx", "nest_small_jx", "nest_base"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    maxpooled = make()
    maxpooled.reset_classifier(C, global_pool="max")
    with pytest.raises(TypeError, match="global_pool='max' has no label readout"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"
    avgpooled = make()
    avgpooled.levels[1].pool.pool = torch.nn.AvgPool2d(3, 2, 1)
    with pytest.raises(TypeError, match="level 1's ConvPool pool is AvgPool2d"):
        backbones.adapt(avgpooled, TLAlign())
