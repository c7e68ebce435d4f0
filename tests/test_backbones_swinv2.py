"""The Swin V2 adapter: preservation, fast = reference (fused and explicit attention), refusals, timm names."""

from __future__ import annotations

import math
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import B, C, IMG, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.swin_transformer_v2 import WindowAttention
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabeling, TokenLabelMap, TransMix, backbones
from mixlabels.backbones.families.swinv2 import cosine_window_attention

BASE: dict[str, Any] = dict(img_size=IMG, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 2), num_classes=C)
FAMILY = next(f for f in backbones.FAMILIES if f.name == "swinv2")


def make(drop_path_rate: float = 0.0, sharp: float = 0.0, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("swinv2_tiny_window8_256", pretrained=False, drop_path_rate=drop_path_rate, **{**BASE, **kwargs})
    if sharp:  # cosine attention ignores q/k scale: sharpen through the logit scale (timm caps it at 100)
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, WindowAttention):
                    mod.logit_scale.fill_(math.log(sharp))
    return model


def test_shifted_blocks_and_merging_are_exercised() -> None:
    model: Any = make()
    assert tuple(model.layers[0].blocks[1].shift_size) == (2, 2) and model.layers[0].blocks[1].attn_mask is not None
    assert type(model.layers[1].downsample).__name__ == "PatchMerging"


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
def test_function_preservation_train_mode(scheme: str) -> None:
    check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


def test_function_preservation_attention_dropout_and_dynamic_mask() -> None:
    check_preservation(make(drop_path_rate=0.3, attn_drop_rate=0.2), SCHEMES["tl_align"])
    check_preservation(make(drop_path_rate=0.3, strict_img_size=False), SCHEMES["tl_align"])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4, sharp=100.0), scheme)


def test_mixtoken_and_attention_dropout_fast_equal_reference() -> None:
    check_parity(make(drop_path_rate=0.2, sharp=100.0), "tokens_aligned", token_space=True)
    check_parity(make(drop_path_rate=0.2, sharp=100.0, attn_drop_rate=0.3), "tl_align")


def test_cosine_attention_equals_timm_and_mixes_by_its_matrix() -> None:
    """The SDPA route (normalised q pre-scaled by the logit scale, scale 1, bias as mask) = timm's forward."""
    model: Any = make(sharp=100.0)
    blk = model.layers[0].blocks[1]
    x = torch.randn(2 * 4, 16, 16)  # 2 images x 4 windows of 4x4 tokens
    y = torch.rand(2 * 4, 16, 3)
    with torch.no_grad():
        out, mixed = cosine_window_attention(blk.attn, x, blk.attn_mask, y)
        assert_close(out, blk.attn(x, mask=blk.attn_mask), rtol=1e-5, atol=1e-6)
        captured: list[torch.Tensor] = []
        handle = blk.attn.softmax.register_forward_hook(lambda mod, i, o: captured.append(o))
        blk.attn(x, mask=blk.attn_mask)
        handle.remove()
    assert_close(mixed, captured[0].mean(1) @ y, rtol=1e-5, atol=1e-6)
    assert captured[0].amax(-1).mean() > 0.3  # sharpened: the mix is far from uniform


def test_fused_route_without_gradients_equals_reference() -> None:
    """Without gradients the attention is one fused SDPA call (logit scale on q, bias as mask). The fused
    kernel rounds differently from the explicit matrix, so the attention is sharpened less than elsewhere."""
    with torch.no_grad():
        check_parity(make(drop_path_rate=0.4, sharp=30.0), "tl_align")
        check_parity(make(drop_path_rate=0.4, sharp=30.0), "tokens_aligned")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_timm_names_adapt_and_refusals() -> None:
    for name in ("swinv2_tiny_window8_256", "swinv2_small_window16_256", "swinv2_base_window12to16_192to256"):
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
    swapped.layers[1].downsample = torch.nn.Conv2d(16, 32, 2, 2)
    with pytest.raises(TypeError, match="stage 1 downsamples with Conv2d, not PatchMerging"):
        backbones.adapt(swapped, TLAlign())
    with pytest.raises(TypeError, match="is not a timm SwinTransformerV2"):
        backbones.AdaptedSwinV2(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, **BASE), TLAlign())
    model: Any = make()
    model.set_grad_checkpointing(True)
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        backbones.adapt(model, TokenLabeling())(images, lm)
