"""The Swin V2-CR adapter: preservation, fast = reference, extra norms, refusals, timm names."""

from __future__ import annotations

import math
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import B, C, IMG, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.swin_transformer_v2_cr import WindowMultiHeadAttention

from mixlabels import TLAlign, TokenLabeling, TokenLabelMap, TransMix, backbones

# init_values=1: timm's default 0 zeroes every post-norm branch at init, which would hide a wrong branch output
BASE: dict[str, Any] = dict(img_size=IMG, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 2),
                            num_classes=C, init_values=1.0)
FAMILY = next(f for f in backbones.FAMILIES if f.name == "swinv2_cr")


def make(drop_path_rate: float = 0.0, sharp: float = 0.0, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("swinv2_cr_tiny_224", pretrained=False, drop_path_rate=drop_path_rate, **{**BASE, **kwargs})
    if sharp:  # cosine attention ignores q/k scale: sharpen through the logit scale (timm caps it at 100)
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, WindowMultiHeadAttention):
                    mod.logit_scale.fill_(math.log(sharp))
    return model


def test_shifted_blocks_merging_and_extra_norms_are_exercised() -> None:
    model: Any = make(extra_norm_period=1)
    assert tuple(model.stages[0].blocks[1].shift_size) == (2, 2) and model.stages[0].blocks[1].attn_mask is not None
    assert type(model.stages[1].downsample).__name__ == "PatchMerging"
    assert all(type(blk.norm3).__name__ == "LayerNorm" for stage in model.stages for blk in stage.blocks)


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
def test_function_preservation_train_mode(scheme: str) -> None:
    """Train mode also draws the position-bias MLP's own dropout: the adapter draws it in timm's order."""
    check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


def test_function_preservation_variants() -> None:
    check_preservation(make(drop_path_rate=0.3, attn_drop_rate=0.2, extra_norm_period=1), SCHEMES["tl_align"])
    check_preservation(make(drop_path_rate=0.3, strict_img_size=False, init_values=None), SCHEMES["tl_align"])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4, sharp=100.0, extra_norm_stage=True), scheme)


def test_mixtoken_and_attention_dropout_fast_equal_reference() -> None:
    check_parity(make(drop_path_rate=0.2, sharp=100.0), "tokens_aligned", token_space=True)
    check_parity(make(drop_path_rate=0.2, sharp=100.0, attn_drop_rate=0.3), "tl_align")


def test_fused_route_without_gradients_equals_reference() -> None:
    """Without gradients the attention is one fused SDPA call (logit scale on q, bias as mask). The fused
    kernel rounds differently from the explicit matrix, so the attention is sharpened less than elsewhere."""
    with torch.no_grad():
        check_parity(make(drop_path_rate=0.4, sharp=30.0), "tl_align")
        check_parity(make(drop_path_rate=0.4, sharp=30.0), "tokens_aligned")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_timm_names_adapt_and_refusals() -> None:
    for name in ("swinv2_cr_tiny_224", "swinv2_cr_tiny_ns_224", "swinv2_cr_huge_224"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    odd = make(img_size=24)  # stage 0: 6x6 tokens, windows of 4 would pad
    lm24 = TokenLabelMap.unmixed(torch.arange(B), C, (24, 24))
    with pytest.raises(ValueError, match="not divisible by its 4x4 windows"):
        backbones.adapt(odd, TokenLabeling())(torch.randn(B, 3, 24, 24), lm24)
    with pytest.raises(TypeError, match="global_pool='max' has no label readout; use 'avg'"):
        backbones.adapt(make(global_pool="max"), TLAlign())
    swapped: Any = make()
    swapped.stages[1].downsample = torch.nn.Conv2d(16, 32, 2, 2)
    with pytest.raises(TypeError, match="stage 1 downsamples with Conv2d, not PatchMerging"):
        backbones.adapt(swapped, TLAlign())
    with pytest.raises(TypeError, match="is not a timm SwinTransformerV2Cr"):
        backbones.AdaptedSwinV2Cr(timm.create_model("swinv2_tiny_window8_256", pretrained=False, img_size=IMG, window_size=4), TLAlign())
    model: Any = make()
    model.set_grad_checkpointing(True)
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        backbones.adapt(model, TokenLabeling())(images, lm)
