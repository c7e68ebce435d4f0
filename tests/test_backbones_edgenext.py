"""The EdgeNeXt adapter: preservation, fast = reference, the SDTA split chain by hand, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones._convnet import path_matrix, path_of
from mixlabels.backbones._count import _meta_build
from mixlabels.backbones.families.edgenext import _sdta_paths

# 32 px: the stem to 8x8, then 8, 4, 2, 1 positions a side; a conv encoder then an SDTA block per stage from stage 1
# (SDTA's split: 2, 3, 3 and 4 groups; the positional encoding in stage 1). ls_init_value 0.5: branches that matter.
CONFIGS: dict[str, dict[str, Any]] = {
    "patch": {},
    "overlap": {"stem_type": "overlap", "use_pos_emb": (True, True, True, False), "global_block_counts": (1, 1, 1, 1)},
    "downsample_block": {"downsample_block": True, "head_norm_first": True, "conv_bias": False, "dims": (8, 16, 32, 32)},
}
TINY = {"dims": (8, 16, 24, 32), "depths": (1, 2, 2, 1), "heads": (2, 2, 2, 2), "d2_scales": (2, 3, 3, 4), "ls_init_value": 0.5}


def make(config: str = "patch", drop: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("edgenext_xx_small", pretrained=False, num_classes=C, drop_path_rate=drop, **{**TINY, **CONFIGS[config]})


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop=0.4), scheme)


@pytest.mark.parametrize("config", ["overlap", "downsample_block"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop=0.4), "tl_align")
    check_parity(make(config, drop=0.4), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)
    check_unmixed_is_one_hot(make("downsample_block"), ["tl_align", "tokens_aligned"])


def test_sdta_split_chain_by_hand() -> None:
    """Stage 1's SDTA (16 channels in 3 groups of 6, 6, 4): ``(6 C0 + 6 C1 (C0 + I)/2 + 4 I) / 16``, each ``C_i`` its
    3x3 depthwise conv's row-normalised matrix; the positional encoding and XCA add nothing."""
    model: Any = make()
    blk = model.stages[1].blocks[1]
    assert type(blk).__name__ == "SplitTransposeBlock" and blk.pos_embd is not None
    grid, eye = (4, 4), torch.eye(16, dtype=torch.float64)
    c = [path_matrix(path_of([conv]), grid)[0] for conv in blk.convs]
    expected = (6 * c[0] + 6 * c[1] @ (c[0] + eye) / 2 + 4 * eye) / 16
    assert_close(path_matrix(_sdta_paths(blk), grid)[0], expected)


def test_downsample_block_shortcut_after_the_strided_conv() -> None:
    """With ``downsample_block`` a stage's first ConvBlock strides its depthwise conv and takes the shortcut after it:
    both sides are its windows, so an unaligned layer still merges the labels (TLAlign on the last layer only)."""
    model: Any = make("downsample_block")
    assert model.stages[1].blocks[0].shortcut_after_dw
    check_parity(model, "tl_last")


def test_timm_names_adapt_and_refusals() -> None:
    names = timm.list_models(module="edgenext")
    assert len(names) == 5
    for name in names:
        model = _meta_build(name)
        assert model is not None
        assert [f.name for f in backbones.FAMILIES if f.name != "any" and f.refusal(model) is None] == ["edgenext"], name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    family = next(f for f in backbones.FAMILIES if f.name == "edgenext")
    maxpool = timm.create_model("edgenext_xx_small", pretrained=False, num_classes=C, global_pool="max", **TINY)
    assert family.refusal(maxpool) == "only the classifier head with global average pooling ('avg') has a label readout"
    circular: Any = make()
    circular.stages[2].blocks[1].convs[0].padding_mode = "circular"
    assert family.refusal(circular) == (
        "stage 2 block 1's split conv 0 module 0 (Conv2d) uses padding (1, 1) (circular); only static zero padding has a label rule"
    )
    swapped: Any = make()
    swapped.stages[3].blocks[0].xca = nn.Identity()
    assert family.refusal(swapped) == "stage 3 block 0's xca is Identity, not timm's CrossCovarianceAttn (a channel op)"
    with pytest.raises(TypeError, match="is not a timm EdgeNeXt"):
        backbones.AdaptedEdgeNeXt(timm.create_model("convnext_atto", num_classes=C), TLAlign())
    assert backbones.adapt(make(), TLAlign()).__class__.__name__ == "AdaptedEdgeNeXt"
