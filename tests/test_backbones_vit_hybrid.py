"""The hybrid ViT adapter (a CNN's feature map as the patch embedding: ResNetV2 with TF 'same' weight-standardised
convs, its stem alone, a features_only ResNet-D, MobileCLIP's ConvStem): preservation, fast = reference, one-hot
when unmixed, every timm name, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, sharpen
from timm.layers.std_conv import StdConv2dSame
from torch import nn

from mixlabels import TLAlign, backbones
from mixlabels.backbones.families.vit_hybrid import tiny_hybrid

FAMILY = next(f for f in backbones.FAMILIES if f.name == "vit_hybrid")
BACKBONES = ["resnetv2", "stem", "resnet", "convstem"]


@pytest.mark.parametrize("backbone", BACKBONES)
def test_function_preservation_train_mode(backbone: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(tiny_hybrid(backbone, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(sharpen(tiny_hybrid("resnetv2", drop_path_rate=0.4)), scheme)


@pytest.mark.parametrize("backbone", ["stem", "resnet", "convstem"])
def test_fast_path_equals_reference_backbones(backbone: str) -> None:
    for scheme in ("tl_align", "transmix"):
        check_parity(sharpen(tiny_hybrid(backbone, drop_path_rate=0.4)), scheme)


def test_fast_path_equals_reference_avg_pool_and_registers() -> None:
    check_parity(sharpen(tiny_hybrid("resnet", drop_path_rate=0.4, global_pool="avg", class_token=False)), "tl_align")
    check_parity(sharpen(tiny_hybrid("resnetv2", drop_path_rate=0.4, reg_tokens=2)), "tl_align")


@pytest.mark.parametrize("backbone", ["resnetv2", "convstem"])
def test_fast_path_equals_reference_token_space(backbone: str) -> None:
    check_parity(sharpen(tiny_hybrid(backbone, drop_path_rate=0.4)), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(tiny_hybrid("resnetv2"), list(SCHEMES))


def test_every_timm_name_adapts_and_only_here() -> None:
    names = timm.list_models(module="vision_transformer_hybrid")
    assert len(names) == 14
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
        assert [f.name for f in backbones.FAMILIES[:-1] if f.refusal(model) is None] == ["vit_hybrid"], name  # "any": the fallback


def test_refusals() -> None:
    with torch.device("meta"):
        plain = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    assert FAMILY.refusal(plain) == "patch_embed is PatchEmbed, not timm's HybridEmbed (the vit family takes PatchEmbed)"
    even: Any = tiny_hybrid("resnetv2")
    even.patch_embed.backbone.stages[0].blocks[0].conv2 = StdConv2dSame(8, 8, 2)
    with pytest.raises(TypeError, match="block 0's branch module 2 is a stride-1 StdConv2dSame with kernel \\(2, 2\\)"):
        backbones.AdaptedViTHybrid(even, TLAlign())
    attn_pool: Any = tiny_hybrid("resnetv2")
    attn_pool.patch_embed.backbone.stem.conv = nn.Conv2d(3, 8, 7, 2, padding=3, padding_mode="circular")
    with pytest.raises(TypeError, match=r"the backbone's stem module 0 \(Conv2d\) uses padding"):
        backbones.AdaptedViTHybrid(attn_pool, TLAlign())
    vit = next(f for f in backbones.FAMILIES if f.name == "vit")
    assert "patch_embed is HybridEmbed, not timm's PatchEmbed" in str(vit.refusal(tiny_hybrid("resnetv2")))


def test_blocks_the_reference_does_not_walk_are_refused() -> None:
    """vit's refusal takes post-norm and parallel blocks (the vit family's reference walks them); a hybrid's walks
    take timm's pre-norm ``Block`` with a per-token MLP only."""
    from timm.layers.mlp import Mlp
    from timm.models.vision_transformer import ResPostBlock

    post: Any = tiny_hybrid("resnetv2", block_fn=ResPostBlock)
    assert FAMILY.refusal(post) == "block 0 is ResPostBlock; only timm's Block is supported after a hybrid's CNN"
    mixing: Any = tiny_hybrid("resnetv2")
    mixing.blocks[1].mlp = nn.Sequential(Mlp(32, 64))  # a module of no rule standing where the MLP is
    assert FAMILY.refusal(mixing) == (
        "block 1's MLP is Sequential; only Mlp, GluMlp, SwiGLU or GeGluMlp (per-token channel mixing) has a rule here"
    )
    assert FAMILY.refusal(tiny_hybrid("resnetv2")) is None
