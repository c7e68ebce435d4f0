"""The PiT adapter: preservation, fast = reference, the distilled heads, MixToken, TransMix's grids, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, sharpen
from torch.testing import assert_close

import torch.nn.functional as F
from einops import rearrange

from mixlabels import TLAlign, TokenLabeling, TokenLabelMap, TransMix, backbones
from mixlabels.backbones._count import _meta_build
from mixlabels.backbones.families.pit import AdaptedPiT

# 32 px: "overlap" embeds 8x8 windows at stride 4 (a 7x7 grid, overlapping as pit_*'s 16/8), pooled to 4x4 and 2x2;
# "tiled" embeds 4x4 patches (8x8, 4x4, 2x2: MixToken); "distilled" adds the distillation token and head.
CONFIGS: dict[str, dict[str, Any]] = {
    "overlap": {"patch_size": 8, "stride": 4},
    "tiled": {"patch_size": 4, "stride": 4},
    "distilled": {"patch_size": 8, "stride": 4, "distilled": True},
}
TINY = {"img_size": 32, "base_dims": (8, 8, 8), "depth": (1, 2, 1), "heads": (2, 2, 4)}


def make(config: str = "overlap", drop: float = 0.0, sharp: bool = True, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    args = {**TINY, **CONFIGS[config], **kwargs}
    model = timm.create_model("pit_ti_224", pretrained=False, num_classes=C, drop_path_rate=drop, **args)
    return sharpen(model) if sharp else model


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop=0.5, sharp=False), SCHEMES[scheme])


def test_function_preservation_eval_mode() -> None:
    for config in CONFIGS:
        model = make(config).eval()
        images, lm = cutmix_batch()
        assert_close(backbones.adapt(model, TLAlign())(images, lm).output, model(images), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", [*POOLED, "transmix"])
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop=0.4), scheme)


@pytest.mark.parametrize("config", ["tiled", "distilled"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    for scheme in ("tl_align", "transmix"):
        check_parity(make(config, drop=0.4), scheme)


def test_mixtoken_on_the_tiled_patch_grid() -> None:
    check_parity(make("tiled", drop=0.4), "tokens_aligned", token_space=True)
    check_parity(make("tiled"), "tl_align", token_space=True)
    images, lm = cutmix_batch(token_space=True)
    with pytest.raises(ValueError, match=r"MixToken needs the patch embedding's \(7, 7\) grid to tile the image \(\(8, 8\)"):
        backbones.adapt(make("overlap"), TLAlign())(images, lm)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), [*POOLED, "transmix"])
    check_unmixed_is_one_hot(make("distilled"), ["tl_align", "transmix", "tokens_aligned"])


def test_patch_labels_are_the_windows_of_the_pixels() -> None:
    """Unaligned token targets: the pixels averaged over the 8x8 stride-4 embedding windows, then over each pooling's
    3x3 stride-2 windows (padding 1: only in-grid positions), computed here by average pooling."""
    model = make()
    images, lm = cutmix_batch()
    out = backbones.adapt(model, TokenLabeling(beta=0.5))(images, lm)
    pixels = lm.targets(rearrange(lm.pixel_weights(), "b k h w -> b (h w) k"))  # b (h w) c
    y = rearrange(pixels, "b (h w) c -> b c h w", h=32).double()
    y = F.avg_pool2d(y, 8, 4)
    for _ in range(2):
        y = F.avg_pool2d(y, 3, 2, 1, count_include_pad=False)
    assert out.token_target is not None
    assert_close(out.token_target, rearrange(y, "b c h w -> b (h w) c").float(), rtol=1e-5, atol=1e-6)


def test_distilled_heads() -> None:
    """As DeiT's (``vit``): the target is the class token's label; in distilled training timm returns both heads and
    the logits are ``head``'s, else the heads' average, which is the model's output."""
    model = make("distilled", drop=0.3)
    images, lm = cutmix_batch()
    model.set_distilled_training(True)
    out = backbones.adapt(model, TLAlign())(images, lm)
    assert isinstance(out.output, tuple) and len(out.output) == 2
    assert out.logits is out.output[0]
    out.loss().backward()
    assert model.head.weight.grad is not None
    model.set_distilled_training(False)
    torch.manual_seed(3)
    averaged = backbones.adapt(model, TLAlign())(images, lm)
    torch.manual_seed(3)
    assert_close(averaged.logits, model(images), rtol=1e-5, atol=1e-6)
    # the class token is token 0: a distillation token's label moving differently leaves the target alone
    assert (out.target - lm.image_targets()).abs().max() > 1e-3


def test_transmix_needs_a_grid_that_tiles() -> None:
    """One stage of 16x16 windows at stride 8 on 32 px: a 3x3 grid of 8-pixel strides covers 24 px, no exact areas."""
    model = make(patch_size=16, stride=8, base_dims=(8,), depth=(1,), heads=(2,))
    images, lm = cutmix_batch()
    for reference in (False, True):
        with pytest.raises(ValueError, match="reads a 3x3 patch grid of 8-pixel strides, which does not tile the 32x32 image"):
            backbones.adapt(model, TransMix(), reference=reference)(images, lm)
    check_parity(model, "tl_align")


def test_image_size_must_match_the_position_embedding() -> None:
    lm = TokenLabelMap.unmixed(torch.arange(4), C, (64, 64))
    with pytest.raises(ValueError, match="give a 15x15 patch grid but the position embedding is 7x7"):
        backbones.adapt(make(), TLAlign())(torch.randn(4, 3, 64, 64), lm)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "pit")
    names = timm.list_models(module="pit")
    assert len(names) == 8
    for name in names:
        model = _meta_build(name)
        assert model is not None and family.refusal(model) is None, name
        assert [f.name for f in backbones.FAMILIES if f.name != "any" and f.refusal(model) is None] == ["pit"], name  # "any": NoAlign
    pooled = make()
    pooled.global_pool = ""
    assert family.refusal(pooled) == "global_pool='' has no label readout; use 'token' (the class token)"
    reflect = make()
    reflect.transformers[1].pool.conv.padding_mode = "reflect"
    assert family.refusal(reflect) == "stage 1's Pooling module 0 (Conv2d) uses padding (1, 1) (reflect); only static zero padding has a label rule"
    swapped = make()
    swapped.transformers[2].blocks[0].attn = torch.nn.Identity()
    assert family.refusal(swapped) == "stage 2 block 0 is Block with Identity; only timm's Block with its Attention is supported"
    embed = make()
    embed.patch_embed.conv.padding = "same"
    assert family.refusal(embed) == "patch_embed.conv uses padding 'same' (zeros); only static zero padding is supported"
    with pytest.raises(TypeError, match="is not a timm PoolingVisionTransformer"):
        AdaptedPiT(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1), TLAlign())
