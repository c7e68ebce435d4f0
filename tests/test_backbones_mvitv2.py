"""The MViTv2 adapter: preservation, fast = reference, pooled labels, the class-token variants, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, sharpen
from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg
from torch.testing import assert_close

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones.families.mvitv2 import pooled_labels

# Two stages on 32 px: an 8x8 patch grid, keys/values pooled to 4x4 (stride 2), then query
# pooling to 4x4 with a stride-1 key/value conv. "cls": class token, token readout.
CONFIGS: dict[str, dict[str, Any]] = {
    "conv": {},
    "cls": {"use_cls_token": True, "use_abs_pos": True},
    "max": {"mode": "max", "residual_pooling": False, "use_cls_token": True},
    "avg": {"mode": "avg", "rel_pos_type": "none", "expand_attn": False},
}


def make(config: str, drop_path_rate: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = MultiScaleVitCfg(depths=(2, 2), embed_dim=16, num_heads=1, stride_kv_adaptive=(2, 2), **CONFIGS[config])
    return sharpen(MultiScaleVit(cfg=cfg, img_size=32, num_classes=C, drop_path_rate=drop_path_rate))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


def test_function_preservation_eval_mode() -> None:
    model = make("cls").eval()
    images, lm = cutmix_batch()
    assert_close(backbones.adapt(model, TLAlign())(images, lm).output, model(images), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("conv", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["cls", "max", "avg"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("conv"), POOLED)
    check_unmixed_is_one_hot(make("cls"), POOLED)


def test_pooled_labels() -> None:
    """Strided pools sum each window and renormalise; the class token passes; a stride-1 conv mixes by its kernel."""
    y = torch.rand(2, 1 + 16, 3).softmax(-1)
    pooled, grid = pooled_labels(torch.nn.MaxPool2d(3, 2, 1), y, (4, 4), 1)
    assert grid == (2, 2) and pooled.shape == (2, 5, 3)
    assert_close(pooled[:, 0], y[:, 0])
    window = y[:, 1:].reshape(2, 4, 4, 3)[:, 0:2, 0:2].sum(dim=(1, 2))  # token (0, 0): the in-grid taps of its 3x3 window
    assert_close(pooled[:, 1], window / window.sum(-1, keepdim=True))
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[:, :, 1, 2] = -2.0  # every channel reads its right neighbour (negative: |K| counts)
    shifted, grid = pooled_labels(conv, y, (4, 4), 1)
    tokens = y[:, 1:].reshape(2, 4, 4, 3)
    assert grid == (4, 4)
    assert_close(shifted[:, 1:].reshape(2, 4, 4, 3)[:, :, :3], tokens[:, :, 1:])


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "mvitv2")
    for name in timm.list_models(module="mvitv2"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("conv"), TransMix())(images, lm)
    with pytest.raises(ValueError, match="MViTv2 pools the keys"):
        backbones.adapt(make("cls"), TransMix())(images, lm)
    first = MultiScaleVit(cfg=MultiScaleVitCfg(depths=(1,), embed_dim=16, num_heads=1, pool_first=True), img_size=32, num_classes=C)
    with pytest.raises(TypeError, match="stage 0 block 0's attention is MultiScaleAttentionPoolFirst"):
        backbones.adapt(first, TLAlign())
    bare = make("conv")
    bare.reset_classifier(C, global_pool="")
    with pytest.raises(TypeError, match="global_pool='' has no label readout"):
        backbones.adapt(bare, TLAlign())
    odd = make("conv")
    odd.stages[0].blocks[0].attn.pool_k = torch.nn.LPPool2d(2, 3, 2)
    with pytest.raises(TypeError, match="stage 0 block 0's pool_k is LPPool2d"):
        backbones.adapt(odd, TLAlign())
