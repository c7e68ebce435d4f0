"""The torchvision ViT adapter: preservation, fast = reference, one-hot when unmixed, every builder accepted."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, SCHEMES, check_parity, check_preservation, check_torchvision_builders, check_unmixed_is_one_hot
from torch import nn
from torch.testing import assert_close
from torchvision.models.vision_transformer import ConvStemConfig, VisionTransformer

from mixlabels import TLAlign, backbones
from mixlabels.backbones import reference_forward as timm_vit_reference
from mixlabels.backbones.families.tv_vit import tiny_tv_vit

FAMILY = next(f for f in backbones.FAMILIES if f.name == "tv_vit")
CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "dropout": {"dropout": 0.2, "attention_dropout": 0.2},  # preservation only: the reference draws attention dropout by F.dropout
    "pre_logits": {"representation_size": 16, "num_layers": 3, "num_heads": 4},
}


def make(config: str, sharpen: float = 8.0) -> nn.Module:
    """A seeded tiny ViT (its head drawn at random); q and k scaled so that random-init attention is far from
    uniform (the targets move)."""
    model = tiny_tv_vit(C, **CONFIGS[config])
    with torch.no_grad():
        for blk in model.encoder.layers:
            blk.self_attention.in_proj_weight[: 2 * blk.self_attention.embed_dim] *= sharpen
    return model


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "transmix", "tokens_aligned"):
        check_preservation(make(config, sharpen=1.0), SCHEMES[scheme])  # as built: sharp attention amplifies fp32 noise


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("plain"), scheme)


def test_fast_path_equals_reference_pre_logits() -> None:
    for scheme in ("tl_align", "transmix", "tokens_aligned"):
        check_parity(make("pre_logits"), scheme)


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(make("plain"), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("plain"), list(SCHEMES))


def test_equals_the_timm_vit_reference_on_the_same_weights() -> None:
    """An independent oracle: timm's ViT given torchvision's weights, walked by the paper's equations (_vit_reference)."""
    tv = make("plain").eval()
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2,
                            num_heads=2, mlp_ratio=2.0, num_classes=C).eval()  # fmt: skip
    with torch.no_grad():
        vit.patch_embed.proj.load_state_dict(tv.conv_proj.state_dict())
        vit.cls_token.copy_(tv.class_token)
        vit.pos_embed.copy_(tv.encoder.pos_embedding)
        for blk, tb in zip(vit.blocks, tv.encoder.layers):
            blk.norm1.load_state_dict(tb.ln_1.state_dict())
            blk.norm2.load_state_dict(tb.ln_2.state_dict())
            blk.attn.qkv.weight.copy_(tb.self_attention.in_proj_weight)
            blk.attn.qkv.bias.copy_(tb.self_attention.in_proj_bias)
            blk.attn.proj.load_state_dict(tb.self_attention.out_proj.state_dict())
            blk.mlp.fc1.load_state_dict(tb.mlp[0].state_dict())
            blk.mlp.fc2.load_state_dict(tb.mlp[3].state_dict())
        vit.norm.load_state_dict(tv.encoder.ln.state_dict())
        vit.head.load_state_dict(tv.heads.head.state_dict())
    from test_backbones_common import cutmix_batch

    images, lm = cutmix_batch()
    for name in ("tl_align", "transmix", "tokens_aligned"):
        want = timm_vit_reference(vit, SCHEMES[name], images, lm)
        got = backbones.adapt(tv, SCHEMES[name])(images, lm)
        assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
        assert_close(got.target, want.target.float(), rtol=1e-5, atol=1e-5)


def test_every_builder_adapts() -> None:
    check_torchvision_builders("tv_vit")


def test_refusals() -> None:
    with torch.device("meta"):
        assert FAMILY.refusal(timm.create_model("vit_tiny_patch16_224", pretrained=False)) == (
            "VisionTransformer is not a torchvision VisionTransformer")
    stem = VisionTransformer(32, 8, 2, 2, 32, 64, num_classes=C, conv_stem_configs=[ConvStemConfig(out_channels=8, kernel_size=3, stride=2)])
    with pytest.raises(TypeError, match="conv_proj is a conv stem"):
        backbones.adapt(stem, TLAlign())
    model = make("plain")
    model.encoder.layers[1].self_attention = nn.MultiheadAttention(32, 2, batch_first=True, add_bias_kv=True)
    with pytest.raises(TypeError, match="encoder layer 1's self_attention is not batch-first self-attention"):
        backbones.adapt(model, TLAlign())
