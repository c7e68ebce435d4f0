"""MixPro's progressive attention labeling against an independent re-implementation on explicit attention."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
import torch.nn.functional as F
from pydantic import TypeAdapter
from torch.testing import assert_close

from mixlabels import MixPro, MixProConfig, SchemeConfig, TokenLabelMap, TransMix, backbones

C, IMG, PATCH = 5, 16, 4


def _vit(**kwargs: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMG, patch_size=PATCH, embed_dim=16,
                              depth=2, num_heads=2, num_classes=C, **kwargs)
    with torch.no_grad():  # sharper than random-init attention, so attention and area lambdas differ
        for blk in model.blocks:
            blk.attn.qkv.weight[:32] *= 6.0
    return model.eval()


def _batch(progress: float | None) -> tuple[torch.Tensor, TokenLabelMap]:
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(2, IMG, IMG)
    mask[0, 2:11, 5:16] = 0.0  # boxes that cut through patches
    mask[1, 0:7, 0:9] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([2, 4]), num_classes=C, label_smoothing=0.1)
    lm = lm if progress is None else lm.with_progress(progress)
    return lm.mix_pixels(torch.randn(2, 3, IMG, IMG, generator=g)), lm


def _reference(model: torch.nn.Module, images: torch.Tensor, mask: torch.Tensor, a: float) -> torch.Tensor:
    """The formula, written out: a * lambda_area + (1 - a) * lambda_attn from the last block's explicit attention."""
    m: Any = model  # timm is untyped
    x = m.norm_pre(m._pos_embed(m.patch_embed(images)))
    for blk in m.blocks[:-1]:
        x = blk(x)
    blk = m.blocks[-1]
    q, k, _ = blk.attn.qkv(blk.norm1(x)).reshape(2, x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
    attn = torch.softmax(q @ k.transpose(-2, -1) * blk.attn.scale, dim=-1).mean(dim=1)  # b n n, head mean
    row = attn[:, 0, 1:] / attn[:, 0, 1:].sum(dim=-1, keepdim=True)  # class token over the patches
    own_area = F.avg_pool2d(mask[:, None], PATCH).flatten(1)  # b n: fraction of each patch from the sample itself
    lam_attn = (row * own_area).sum(dim=-1)  # b
    lam_area = mask.mean(dim=(1, 2))  # b
    lam = a * lam_area + (1 - a) * lam_attn
    own, partner = F.one_hot(torch.tensor([2, 4]), C).float(), F.one_hot(torch.tensor([4, 2]), C).float()
    target = lam[:, None] * own + (1 - lam[:, None]) * partner
    return 0.9 * target + 0.1 / C


@pytest.mark.parametrize("progress", [0.0, 0.3, 1.0])
def test_targets_match_the_formula_on_explicit_attention(progress: float) -> None:
    model = _vit()
    images, lm = _batch(progress)
    mask = lm.pixel_weights()[:, 0]  # b H W, the sample's own share
    want = _reference(model, images, mask, a=1.0 - progress)  # the default schedule: a falls from 1 to 0
    with torch.no_grad():
        fast = backbones.adapt(model, MixPro())(images, lm)
        ref = backbones.adapt(model, MixPro(), reference=True)(images, lm)
    assert_close(fast.target, want, rtol=0, atol=2e-6)
    assert_close(ref.target, want, rtol=0, atol=2e-6)
    if progress == 0.0:  # a = 1: the area (CutMix) target
        assert_close(fast.target, lm.image_targets(), rtol=0, atol=1e-6)
    else:
        assert not torch.allclose(fast.target, lm.image_targets(), atol=1e-3)


def test_half_weight_is_transmix_and_config_builds_it() -> None:
    model = _vit()
    images, lm = _batch(0.7)
    scheme = TypeAdapter(SchemeConfig).validate_python({"kind": "mixpro", "initial": 0.5, "final": 0.5}).build()
    assert scheme == MixPro(initial=0.5, final=0.5) and MixProConfig().build() == MixPro()
    with torch.no_grad():
        assert torch.equal(backbones.adapt(model, scheme)(images, lm).target, backbones.adapt(model, TransMix())(images, lm).target)


def test_cait_fast_path_equals_reference() -> None:
    torch.manual_seed(0)
    model = timm.create_model("cait_xxs24_224", pretrained=False, img_size=IMG, patch_size=PATCH, embed_dim=16, depth=2,
                              num_heads=2, num_classes=C).eval()
    images, lm = _batch(0.4)
    with torch.no_grad():
        fast = backbones.adapt(model, MixPro())(images, lm)
        ref = backbones.adapt(model, MixPro(), reference=True)(images, lm)
    assert_close(fast.target, ref.target, rtol=0, atol=1e-6)


def test_bad_uses_are_named() -> None:
    images, lm = _batch(None)
    with pytest.raises(ValueError, match=r"with_progress\(step / total_steps\)"):
        backbones.adapt(_vit(), MixPro())(images, lm)
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(_vit(class_token=False, global_pool="avg"), MixPro())(images, lm.with_progress(0.5))
    with pytest.raises(ValueError, match="progress must lie in"):
        lm.with_progress(1.5)
    with pytest.raises(ValueError, match="area weights in"):
        MixPro(initial=1.2)
