"""The torchvision Swin adapter (v1 and v2): preservation, fast = reference, one-hot when unmixed, torchvision's
shift rule and mask, refusals (padded grids, foreign blocks), every builder accepted."""

from __future__ import annotations

import math
import types
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import B, C, IMG, POOLED, SCHEMES, check_parity, check_preservation, check_torchvision_builders, check_unmixed_is_one_hot, cutmix_batch, sharpen
from test_compile import check_compiles_whole
from torch import nn
from torch.testing import assert_close
from torchvision.models.swin_transformer import PatchMergingV2, ShiftedWindowAttentionV2, SwinTransformer, SwinTransformerBlockV2

from mixlabels import TLAlign, TokenLabeling, TokenLabelMap, TransMix, backbones
from mixlabels.backbones.families.tv_swin import kept_shift, shift_mask, tv_window_attention

FAMILY = next(f for f in backbones.FAMILIES if f.name == "tv_swin")
BASE: dict[str, Any] = dict(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4], num_classes=C)
V2: dict[str, Any] = dict(block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2)


def make(v2: bool = False, sd: float = 0.0, sharp: float = 0.0, **kwargs: Any) -> nn.Module:
    """A seeded tiny torchvision Swin on 32x32 images (grids 8x8 then 4x4, windows 4x4). ``sharp``: v1 scales q and k,
    v2 (cosine attention ignores their scale) sets the logit scale, so that the attention moves the labels."""
    torch.manual_seed(0)
    model: nn.Module = SwinTransformer(**{**BASE, **(V2 if v2 else {}), "stochastic_depth_prob": sd, **kwargs})
    if sharp and v2:
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, ShiftedWindowAttentionV2):
                    mod.logit_scale.fill_(math.log(sharp))
    elif sharp:
        sharpen(model, sharp)
    return model


def test_shifts_masks_and_merges_are_exercised() -> None:
    """Stage 0 (8x8 grid) keeps its shift; stage 1 (4x4, one window) drops it, as torchvision does; a 4x8 window on
    the 8x8 grid keeps the row shift and drops the column shift."""
    model: Any = make()
    assert list(model.features[1][1].attn.shift_size) == [2, 2] and kept_shift((8, 8), (4, 4), [2, 2]) == (2, 2)
    assert list(model.features[3][1].attn.shift_size) == [2, 2] and kept_shift((4, 4), (4, 4), [2, 2]) == (0, 0)
    assert kept_shift((8, 8), (4, 8), [2, 4]) == (2, 0)
    assert type(model.features[2]).__name__ == "PatchMerging" and isinstance(getattr(make(v2=True), "features")[2], PatchMergingV2)


@pytest.mark.parametrize("v2", [False, True])
def test_window_attention_is_torchvisions(v2: bool) -> None:
    """The attention on rolled windows with ``shift_mask`` (and its label mix) is torchvision's module, shifted, on a
    grid it tiles and on one where only the rows shift."""
    model: Any = make(v2=v2, sharp=100.0 if v2 else 8.0)
    attn = model.features[1][1].attn
    for grid, window in (((8, 8), (4, 4)), ((8, 4), (4, 4))):
        x = torch.randn(2, *grid, 16)
        shift = kept_shift(grid, window, attn.shift_size)
        mask = shift_mask(grid, window, shift, x)
        assert (mask == -100).any() and set(mask.flatten().tolist()) == {-100.0, 0.0}
        rolled = torch.roll(x, (-shift[0], -shift[1]), (1, 2))
        windows = torch.cat([rolled[:, i : i + 4, j : j + 4].flatten(1, 2) for i in range(0, grid[0], 4) for j in range(0, grid[1], 4)])
        windows = windows.view(-1, 2, 16, 16).transpose(0, 1).flatten(0, 1)  # (b nw) n c, batch-major as torchvision
        with torch.no_grad():
            eye = torch.eye(16).expand(windows.shape[0], 16, 16)
            out, mixed = tv_window_attention(attn, windows, mask, eye)
            unmasked = tv_window_attention(attn, windows, None, eye)[1]
            expected = attn(x)  # torchvision's forward (it rolls back)
        got = torch.roll(out.view(2, grid[0] // 4, grid[1] // 4, 4, 4, 16).transpose(2, 3).reshape(2, *grid, 16), shift, (1, 2))
        assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert mixed is not None and mixed.amax(-1).mean() > 2 / 16  # a sharp matrix (uniform: 1/16) mixes the labels
        assert_close(mixed.sum(-1), torch.ones(windows.shape[0], 16))
        far = mask.repeat(2, 1, 1) < 0  # -100 is not -inf: at v2's logit scale 100 a masked key keeps some weight
        assert unmasked is not None and (mixed[far] <= unmasked[far]).all() and (mixed[far] < 1e-3).float().mean() > 0.9


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
def test_function_preservation_train_mode(v2: bool, scheme: str) -> None:
    check_preservation(make(v2=v2, sd=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("v2", [False, True])
def test_function_preservation_dropouts_and_batch_mode_drop(v2: bool) -> None:
    check_preservation(make(v2=v2, sd=0.3, dropout=0.2, attention_dropout=0.2), SCHEMES["tl_align"])
    model: Any = make(v2=v2, sd=0.5)
    for mod in model.modules():
        if type(mod).__name__ == "StochasticDepth":
            mod.mode = "batch"
    check_preservation(model, SCHEMES["tl_align"])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference_v1(scheme: str) -> None:
    check_parity(make(sd=0.4, sharp=8.0), scheme)


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference_v2(scheme: str) -> None:
    check_parity(make(v2=True, sd=0.4, sharp=100.0), scheme)


@pytest.mark.parametrize("v2", [False, True])
def test_mixtoken_dropouts_and_one_axis_shift_fast_equal_reference(v2: bool) -> None:
    sharp = 100.0 if v2 else 8.0
    check_parity(make(v2=v2, sd=0.2, sharp=sharp), "tokens_aligned", token_space=True)
    check_parity(make(v2=v2, sd=0.2, sharp=sharp, attention_dropout=0.3, dropout=0.1), "tl_align")
    one_stage: dict[str, Any] = dict(depths=[2], num_heads=[2], window_size=[4, 8])  # 8x8 grid: rows shift by 2, columns do not
    check_parity(make(v2=v2, sd=0.0, sharp=sharp, **one_stage), "tl_align")
    check_preservation(make(v2=v2, sd=0.5, **one_stage), SCHEMES["tl_align"])


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)
    check_unmixed_is_one_hot(make(v2=True), ["tl_align", "tokens_aligned"])


def test_v2_compiles_as_one_graph_once_and_equals_eager() -> None:
    """The family's example (v1) runs in tests/test_compile.py; v2's cosine attention and bias MLP here."""
    check_compiles_whole(types.SimpleNamespace(example=lambda: make(v2=True, sd=0.2)), "eager", tol=1e-5)


def test_every_builder_adapts() -> None:
    check_torchvision_builders("tv_swin")


def test_padded_grids_are_refused_per_input() -> None:
    """Where torchvision would pad (windows that do not tile a grid, an odd grid at a merge), the input is refused,
    naming the grid, the window and an image size that tiles; the same model takes 32x32 images."""
    model = make()
    lm24 = TokenLabelMap.unmixed(torch.arange(B), C, (24, 24))
    for reference in (False, True):
        adapted = backbones.adapt(model, TokenLabeling(), reference=reference)
        with pytest.raises(ValueError, match="24x24 images give stage 0 a 6x6 grid, not divisible by its 4x4 windows.*e.g. 32x32"):
            adapted(torch.randn(B, 3, 24, 24), lm24)
    images, lm = cutmix_batch()
    backbones.adapt(model, TLAlign())(images, lm)
    odd = make(patch_size=[8, 8], window_size=[5, 5])  # 40x40 images: a 5x5 grid, merged with padding
    lm40 = TokenLabelMap.unmixed(torch.arange(B), C, (40, 40))
    with pytest.raises(ValueError, match="merging before stage 1 a 5x5 grid.*e.g. 80x80"):
        backbones.adapt(odd, TLAlign())(torch.randn(B, 3, 40, 40), lm40)


def test_refusals() -> None:
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False)) == (
            "SwinTransformer is not a torchvision SwinTransformer"
        )
    assert next(f for f in backbones.FAMILIES if f.name == "swin").refusal(make()) == "SwinTransformer is not a timm SwinTransformer (v1)"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    foreign: Any = make()
    foreign.features[3][0] = nn.Identity()
    with pytest.raises(TypeError, match="feature 3's block 0 is Identity, not torchvision's SwinTransformerBlock"):
        backbones.adapt(foreign, TLAlign())
    conv_mlp: Any = make()
    conv_mlp.features[1][0].mlp[1] = nn.Conv1d(64, 64, 3, padding=1)
    with pytest.raises(TypeError, match="feature 1's block 0's MLP is not torchvision's"):
        backbones.adapt(conv_mlp, TLAlign())
    max_pool: Any = make()
    max_pool.avgpool = nn.AdaptiveMaxPool2d(1)
    with pytest.raises(TypeError, match="only global average pooling"):
        backbones.adapt(max_pool, TLAlign())
    conv_downsample: Any = make()
    conv_downsample.features[2] = nn.Conv2d(16, 32, 2, 2)
    with pytest.raises(TypeError, match="feature 2 is Conv2d, neither a stage of blocks nor PatchMerging"):
        backbones.adapt(conv_downsample, TLAlign())
    padded_stem: Any = make()
    padded_stem.features[0][0].padding = (1, 1)
    with pytest.raises(TypeError, match="the stem is not torchvision's patch embedding"):
        backbones.adapt(padded_stem, TLAlign())
