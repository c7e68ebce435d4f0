"""The rel-pos ViT adapter: preservation, fast = reference with every bias variant, timm names, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, set_fused, sharpen
from timm.layers.pos_embed_rel import RelPosBias
from timm.models.vision_transformer_relpos import ResPostRelPosBlock, VisionTransformerRelPos
from torch import nn

from mixlabels import NoAlign, TLAlign, backbones

CLS = {"class_token": True, "global_pool": "token"}
CONFIGS: dict[str, dict[str, Any]] = {
    "cls_mlp": {**CLS, "rel_pos_type": "mlp"},  # RelPosMlp 'cr': zero bias on the class token's row and column
    "cls_bias": {**CLS, "rel_pos_type": "bias"},  # RelPosBias: the class token's row and column are learned
    "gap_bias_fc_norm": {"rel_pos_type": "bias", "fc_norm": True},
    "shared_swin_mlp": {"rel_pos_type": "mlp_swin", "shared_rel_pos": True},  # sigmoid-gained log-space MLP, shared
    "shared_bias_cls": {**CLS, "rel_pos_type": "bias", "shared_rel_pos": True},
    "res_post": {**CLS, "rel_pos_type": "bias", "block_fn": ResPostRelPosBlock, "init_values": 0.5},
    "clsgap_qk_norm": {"class_token": True, "global_pool": "avg", "fc_norm": True, "qk_norm": True},
}


def make(config: str, drop_path_rate: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = VisionTransformerRelPos(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=C,
                                    rel_pos_dim=16, drop_path_rate=drop_path_rate,
                                    **{"init_values": 0.5, **CONFIGS[config]})  # fmt: skip
    with torch.no_grad():  # a random-init table (std 0.02) would hardly move attention: make the bias count
        for mod in model.modules():
            if isinstance(mod, RelPosBias):
                mod.relative_position_bias_table.normal_(0.0, 2.0)
    return sharpen(model)


def test_bias_covers_the_class_token() -> None:
    """The bias handed to attention is (1, h, n, n) over prefix + patches, whatever the module."""
    for config, prefix_bias_zero in (("cls_mlp", True), ("cls_bias", False)):
        model: Any = make(config)
        bias = model.blocks[0].attn.rel_pos.get_bias()
        assert bias.shape == (1, 2, 17, 17), config
        assert bool((bias[..., 0, :] == 0).all() and (bias[..., :, 0] == 0).all()) is prefix_bias_zero, config


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("cls_bias", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "cls_bias"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "transmix" if CONFIGS[config].get("global_pool") == "token" else "tl_align")
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned")


def test_explicit_attention_and_mixtoken_fast_equal_reference() -> None:
    check_parity(set_fused(make("shared_bias_cls", drop_path_rate=0.2), False), "tl_align")
    check_parity(set_fused(make("cls_mlp", drop_path_rate=0.2), False), "transmix")
    check_parity(make("cls_mlp", drop_path_rate=0.2), "tl_align", token_space=True)


def test_frozen_bias_takes_the_fused_kernel() -> None:
    """No grad on the bias (frozen tables, eval): the widened fused call, still equal to the reference."""
    model = make("cls_bias")
    for p in model.parameters():
        p.requires_grad_(False)
    check_parity(model, "tl_align")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("cls_mlp"), list(SCHEMES))
    check_unmixed_is_one_hot(make("gap_bias_fc_norm"), POOLED)


def test_timm_names_adapt() -> None:
    names = timm.list_models(module="vision_transformer_relpos")
    assert len(names) >= 10 and any("srelpos" in n for n in names) and any("_cls_" in n for n in names)
    family = next(f for f in backbones.FAMILIES if f.name == "vit_relpos")
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name


def test_refusals() -> None:
    unpooled: Any = make("cls_bias")
    unpooled.global_pool = ""
    with pytest.raises(TypeError, match="global_pool='' has no label readout; use 'token'"):
        backbones.adapt(unpooled, TLAlign())
    assert type(backbones.adapt(unpooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    odd: Any = make("cls_bias")
    odd.blocks[1].attn.rel_pos = nn.Identity()
    with pytest.raises(TypeError, match="block 1's relative position module is Identity; only RelPosBias and RelPosMlp"):
        backbones.adapt(odd, TLAlign())
    odd = make("cls_bias")
    odd.blocks[0] = nn.Identity()
    with pytest.raises(TypeError, match="block 0 is Identity with NoneType; only RelPosBlock or ResPostRelPosBlock"):
        backbones.adapt(odd, TLAlign())
    odd = make("cls_bias")
    odd.patch_embed.dynamic_img_pad = True
    with pytest.raises(TypeError, match="dynamic_img_pad pads images"):
        backbones.adapt(odd, TLAlign())
