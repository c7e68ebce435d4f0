"""The ViTamin adapter (vit_hybrid's walks over MbConvStages: a conv stem, MbConvLNBlocks, a strided-conv pool, then
ViT blocks with GeGluMlp): preservation, fast = reference, one-hot when unmixed, every timm name, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import POOLED, SCHEMES, check_parity, check_preservation, cutmix_batch, check_unmixed_is_one_hot, sharpen
from timm.layers.mlp import Mlp
from timm.models.vision_transformer import ResPostBlock
from torch import nn

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones.families.vitamin import AdaptedViTamin, tiny_vitamin

FAMILY = next(f for f in backbones.FAMILIES if f.name == "vitamin")
CONFIGS: dict[str, dict[str, Any]] = {
    "small": {},  # vitamin_small_224's layout: GeGluMlp, no class token, 'avg'
    "mlp_no_pos": {"mlp_layer": Mlp, "pos_embed": "none"},  # the xlarge names have no position embedding
    "class_token": {"class_token": True, "global_pool": "token", "reg_tokens": 1},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned") if config == "small" else ("tl_align",):
        check_preservation(tiny_vitamin(0.5, 0.5, **CONFIGS[config]), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(sharpen(tiny_vitamin(0.4, 0.4)), scheme)


@pytest.mark.parametrize("scheme", ["transmix", "tl_align"])
def test_fast_path_equals_reference_class_token(scheme: str) -> None:
    check_parity(sharpen(tiny_vitamin(0.4, 0.4, **CONFIGS["class_token"])), scheme)


def test_fast_path_equals_reference_mlp_no_pos_embed() -> None:
    check_parity(sharpen(tiny_vitamin(0.4, 0.4, **CONFIGS["mlp_no_pos"])), "tl_align")


def test_fast_path_equals_reference_token_space() -> None:
    check_parity(sharpen(tiny_vitamin(0.4, 0.4)), "tl_align", token_space=True)  # MixToken on the stem's 16x16 grid


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(tiny_vitamin(), POOLED)
    check_unmixed_is_one_hot(tiny_vitamin(**CONFIGS["class_token"]), list(SCHEMES))


def test_transmix_refused_without_a_class_token() -> None:
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="TransMix reads the class token's attention, but this model has no class token"):
        backbones.adapt(tiny_vitamin(), TransMix())(images, lm)


def test_every_timm_name_adapts_and_only_here() -> None:
    names = timm.list_models(module="vitamin")
    assert len(names) == 13
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
        assert [f.name for f in backbones.FAMILIES[:-1] if f.refusal(model) is None] == ["vitamin"], name  # "any": the fallback


def test_refusals() -> None:
    hybrid = next(f for f in backbones.FAMILIES if f.name == "vit_hybrid")
    assert "the backbone is MbConvStages" in str(hybrid.refusal(tiny_vitamin()))
    with torch.device("meta"):
        plain = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        r26 = timm.create_model("vit_small_r26_s32_224", pretrained=False)
    assert FAMILY.refusal(plain) == "patch_embed is PatchEmbed, not timm's HybridEmbed over ViTamin's MbConvStages"
    assert "HybridEmbed's backbone is ResNetV2, not ViTamin's MbConvStages" in str(FAMILY.refusal(r26))
    circular: Any = tiny_vitamin()
    circular.patch_embed.backbone.stages[1][1].conv2_kxk.padding_mode = "circular"
    with pytest.raises(TypeError, match=r"the backbone's block 2's branch module 4 \(Conv2d\) uses padding"):
        AdaptedViTamin(circular, TLAlign())
    shortcut: Any = tiny_vitamin()
    shortcut.patch_embed.backbone.stages[0][0].shortcut.pool = nn.AdaptiveAvgPool2d(8)
    assert FAMILY.refusal(shortcut) == ("the backbone's block 0's shortcut module 0 is AdaptiveAvgPool2d, which has no "
                                        "label rule here (a conv, pool, norm, activation or channel gate)")
    stem: Any = tiny_vitamin()
    stem.patch_embed.backbone.stem.conv2 = nn.Conv2d(8, 8, 2, padding=1)
    assert "the backbone's stem module 2 is a stride-1 (2, 2) conv with padding (1, 1)" in str(FAMILY.refusal(stem))
    post: Any = tiny_vitamin()
    post.blocks[1] = ResPostBlock(32, 2)
    assert FAMILY.refusal(post) == "block 1 is ResPostBlock; only timm's Block is supported after a hybrid's CNN"
    mlp: Any = tiny_vitamin()
    mlp.blocks[0].mlp = nn.Sequential()
    assert "block 0's MLP is Sequential" in str(FAMILY.refusal(mlp))
    map_pool: Any = tiny_vitamin(global_pool="map")
    assert "global_pool='map' has no label readout in a hybrid" in str(FAMILY.refusal(map_pool))
