"""The PVT v2 adapter: spatial reduction (reduced key labels), dwconv in the MLP, overlapping embeddings."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_backbones_common import B, C, IMG, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, set_fused, sharpen
from timm.models.pvt_v2 import PyramidVisionTransformerV2
from torch.testing import assert_close

from mixlabels import backbones
from mixlabels.backbones.families.pvt_v2 import reduced_key_labels
from mixlabels import TokenLabeling, TransMix
from mixlabels.strategies import BlockwiseMix, CutMix, RandomPatchMix

CONFIGS: dict[str, dict[str, Any]] = {"fused": {}, "explicit": {}, "linear": {"linear": True}}


def make(config: str, drop_path_rate: float = 0.0, factor: float = 1.0, **kwargs: Any) -> PyramidVisionTransformerV2:
    torch.manual_seed(0)
    args: dict[str, Any] = dict(depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), sr_ratios=(2, 1), mlp_ratios=(2, 2))
    model = PyramidVisionTransformerV2(num_classes=C, drop_path_rate=drop_path_rate, **{**args, **CONFIGS[config], **kwargs})
    sharpen(set_fused(model, config != "explicit"), factor)
    return model


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str, scheme: str) -> None:
    check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fast_path_equals_reference(config: str, scheme: str) -> None:
    check_parity(make(config, drop_path_rate=0.4, factor=8.0), scheme)


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(make("fused", drop_path_rate=0.2, factor=8.0), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("linear"), POOLED)


def test_transmix_refused() -> None:
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("fused"), TransMix())(images, lm)


def own_fraction(images: torch.Tensor, mixed: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
    """Per-pixel weight of the sample itself, read off constant images ``1 + index`` (no label map)."""
    own, other = images[:, :1], images[partner, :1]
    return (mixed[:, :1] - other) / (own - other)  # b 1 H W


@pytest.mark.parametrize("mixer", ["cutmix", "random_patch", "blockwise"])
def test_reduced_grid_and_stem_labels_are_exact(mixer: str) -> None:
    """Coarser than the mixers' 8-px cells: sr_ratio 4 on the 4-px stem grid makes 16-px keys, whose
    labels are the exact area fractions; the stem's tokens get the exact fractions of their 7x7 window."""
    g = torch.Generator().manual_seed(5)
    mixers: dict[str, Any] = {
        "cutmix": CutMix(C, generator=g),
        "random_patch": RandomPatchMix(C, cell_size=8, ratio=0.5, generator=g),
        "blockwise": BlockwiseMix(C, cell_size=8, ratio=0.5, min_cells=2, generator=g),
    }
    images = (torch.arange(B, dtype=torch.float32) + 1).view(B, 1, 1, 1).expand(B, 3, IMG, IMG).contiguous()
    labels = torch.arange(B)
    mixed, lm = mixers[mixer](images, labels)
    w = own_fraction(images, mixed, lm.sources[:, 1])  # b 1 H W
    model = make("fused", depths=(1,), embed_dims=(16,), num_heads=(1,), sr_ratios=(4,), mlp_ratios=(2,))
    # the reduced keys' labels, from the 4-px token labels (exact fractions of each 4-px cell)
    tokens = lm.token_weights((8, 8))
    keys = reduced_key_labels(model.stages[0].blocks[0].attn, tokens, (8, 8))  # b 4 k
    assert keys.shape == (B, 4, 2)
    assert_close(keys[..., 0], F.avg_pool2d(w, 16).flatten(1), rtol=0, atol=1e-6)
    # the stem's tokens: every 7x7 stride-4 window (clipped to the image) from the pixels
    out = backbones.adapt(model, TokenLabeling())(mixed, lm)  # unaligned: the labels after the stem
    assert out.token_target is not None
    window = F.avg_pool2d(w, 7, 4, 3, count_include_pad=False).flatten(1)  # b 64
    assert_close(out.token_target.gather(2, labels.view(B, 1, 1).expand(B, 64, 1)).squeeze(2), window, rtol=0, atol=1e-6)
