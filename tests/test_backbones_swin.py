"""The Swin (v1) adapter: preservation, fast = reference, shifted windows, exact labels on 4-px patches."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import (
    B,
    C,
    IMG,
    POOLED,
    SCHEMES,
    check_parity,
    check_preservation,
    check_unmixed_is_one_hot,
    cutmix_batch,
    set_fused,
    sharpen,
)
from torch.testing import assert_close

from mixlabels import backbones
from mixlabels import TokenLabeling, TokenLabelMap, TransMix
from mixlabels.strategies import BlockwiseMix, CutMix, RandomPatchMix

BASE: dict[str, Any] = dict(img_size=IMG, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 2), num_classes=C)
CONFIGS = ["explicit", "fused"]  # timm's default Swin attention is explicit (fused is "experimental")


def make(config: str, drop_path_rate: float = 0.0, factor: float = 1.0, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, drop_path_rate=drop_path_rate, **{**BASE, **kwargs})
    return sharpen(set_fused(model, config == "fused"), factor)


def test_shifted_blocks_and_merging_are_exercised() -> None:
    model: Any = make("explicit")
    assert tuple(model.layers[0].blocks[1].shift_size) == (2, 2)  # a shifted window block with a mask
    assert model.layers[0].blocks[1].attn_mask is not None


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
@pytest.mark.parametrize("config", CONFIGS)
def test_function_preservation_train_mode(config: str, scheme: str) -> None:
    check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
@pytest.mark.parametrize("config", CONFIGS)
def test_fast_path_equals_reference(config: str, scheme: str) -> None:
    check_parity(make(config, drop_path_rate=0.4, factor=8.0), scheme)


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(make("explicit", drop_path_rate=0.2, factor=8.0), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("fused"), POOLED)


def test_transmix_refused_and_bad_grids_rejected() -> None:
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("explicit"), TransMix())(images, lm)
    odd = make("explicit", img_size=24, window_size=4)  # stage 0: 6x6 tokens, windows of 4 would pad
    lm24 = TokenLabelMap.unmixed(torch.arange(B), C, (24, 24))
    with pytest.raises(ValueError, match="not divisible by its 4x4 windows"):
        backbones.adapt(odd, TokenLabeling())(torch.randn(B, 3, 24, 24), lm24)
    model: Any = make("explicit")
    model.set_grad_checkpointing(True)
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        backbones.adapt(model, TokenLabeling())(images, lm)


def source_fractions(images: torch.Tensor, mixed: torch.Tensor, partner: torch.Tensor, patch: int) -> torch.Tensor:
    """Brute force, without the label map: the fraction of each patch's pixels from the sample itself.

    Every image is constant ``1 + index``, so a mixed pixel ``w v_i + (1 - w) v_j`` gives ``w``.
    """
    own, other = images[:, :1], images[partner, :1]
    w = (mixed[:, :1] - other) / (own - other)  # b 1 H W
    return torch.nn.functional.avg_pool2d(w, patch).flatten(1)  # b n


@pytest.mark.parametrize("mixer", ["cutmix", "random_patch", "blockwise"])
def test_labels_on_4px_patches_are_exact_area_fractions(mixer: str) -> None:
    """Swin's 4-px patches are finer than the mixers' 8-px cells (and CutMix boxes cut anywhere)."""
    g = torch.Generator().manual_seed(4)
    mixers: dict[str, Any] = {
        "cutmix": CutMix(C, generator=g),
        "random_patch": RandomPatchMix(C, cell_size=8, ratio=0.5, generator=g),
        "blockwise": BlockwiseMix(C, cell_size=8, ratio=0.5, min_cells=2, generator=g),
    }
    images = (torch.arange(B, dtype=torch.float32) + 1).view(B, 1, 1, 1).expand(B, 3, IMG, IMG).contiguous()
    labels = torch.arange(B)  # distinct classes: the target's class columns are the source weights
    mixed, lm = mixers[mixer](images, labels)
    partner = lm.sources[:, 1]
    expected = source_fractions(images, mixed, partner, 4)  # b 64
    model = make("explicit", depths=(2,), num_heads=(2,))  # one stage: the final grid is the 4-px grid
    out = backbones.adapt(model, TokenLabeling())(mixed, lm)  # unaligned token targets: the initial labels
    assert out.token_target is not None
    got = out.token_target.gather(2, labels.view(B, 1, 1).expand(B, 64, 1)).squeeze(2)  # b n: own class
    assert_close(got, expected, rtol=0, atol=1e-6)
    assert 0 < float(expected.mean()) < 1  # really mixed
