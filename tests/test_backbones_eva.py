"""The Eva adapter (EVA, EVA02, rope ViTs): preservation, fast = reference for every rope type, timm names, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, set_fused, sharpen
from timm.layers import RmsNorm
from timm.models.eva import Eva
from torch import nn

from mixlabels import NoAlign, TLAlign, backbones

ROPE = {"use_rot_pos_emb": True, "use_abs_pos_emb": False}
TOKEN = {"global_pool": "token"}
CONFIGS: dict[str, dict[str, Any]] = {
    # eva02_*: abs + 'cat' rope, SwiGLU (packed GluMlp), average pooling under fc_norm
    "eva02": {"use_rot_pos_emb": True, "swiglu_mlp": True, "mlp_ratio": 4 * 2 / 3, "ref_feat_shape": (4, 4)},
    # vit_*_rope_*: AttentionRope, class-token readout, layer scale
    "rope_token": {**ROPE, **TOKEN, "attn_type": "rope", "init_values": 0.5, "rope_grid_indexing": "xy"},
    "rope_mixed": {**ROPE, **TOKEN, "attn_type": "rope", "rope_type": "mixed", "rope_temperature": 10.0},
    # vit_*_rope_reg*_gap: register tokens, no class token, average pooling
    "reg_gap": {**ROPE, "class_token": False, "num_reg_tokens": 2, "init_values": 0.5},
    # Sapiens2-like: dinov3 rope (half rotation, train-time rescale), grouped-query heads, qk norm, registers
    "dinov3_gqa": {**ROPE, **TOKEN, "attn_type": "rope", "qkv_fused": False, "num_kv_heads": (2, 1), "qk_norm": True,
                   "rope_type": "dinov3", "rope_rotate_half": True, "rope_rescale_coords": 2.0, "num_reg_tokens": 2,
                   "swiglu_mlp": True, "init_values": 1.0, "attn_only_layer_scale": True, "use_fc_norm": False,
                   "norm_layer": RmsNorm, "dynamic_img_size": True},
    "post_norm_gated": {**TOKEN, "use_post_norm": True, "use_rot_pos_emb": True,
                        "scale_attn_inner": True, "scale_mlp": True},
}  # fmt: skip


def make(config: str, drop_path_rate: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = Eva(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=C,
                drop_path_rate=drop_path_rate, **CONFIGS[config])  # fmt: skip
    with torch.no_grad():  # zero-initialised q/v biases: make them count
        for name, p in model.named_parameters():
            if name.endswith(("q_bias", "v_bias")):
                p.normal_(0.0, 0.5)
    if config.endswith("_gated"):  # Eva does not pass gated_attn to its blocks: the attention's sigmoid gate by hand
        for blk in model.blocks:
            blk.attn.gate = nn.Linear(32, 32)
    return sharpen(model)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("rope_token", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "rope_token"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "transmix" if CONFIGS[config].get("global_pool") == "token" else "tl_align")
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned")


def test_rope_moves_the_labels() -> None:
    """Rotating q/k changes the attention rows and so the aligned targets: the rotation is not skipped."""
    model: Any = make("rope_token")
    images, lm = cutmix_batch()
    model.train()
    with_rope = backbones.adapt(model, TLAlign())(images, lm).target
    model.rope = None
    without = backbones.adapt(model, TLAlign())(images, lm).target
    assert (with_rope - without).abs().max() > 1e-4


def test_explicit_attention_and_mixtoken_fast_equal_reference() -> None:
    check_parity(set_fused(make("dinov3_gqa", drop_path_rate=0.2), False), "transmix")
    check_parity(set_fused(make("eva02", drop_path_rate=0.2), False), "tl_align")
    check_parity(make("eva02", drop_path_rate=0.2), "tl_align", token_space=True)
    check_parity(make("dinov3_gqa", drop_path_rate=0.2), "tl_align", token_space=True)  # NHWC patch tokens


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("rope_token"), list(SCHEMES))
    check_unmixed_is_one_hot(make("reg_gap"), POOLED)


def test_timm_names_adapt() -> None:
    """Every eva.py name, the attention-pooled (global_pool='map') Perception Encoder ones included."""
    names = timm.list_models(module="eva")
    family = next(f for f in backbones.FAMILIES if f.name == "eva")
    refused = {}
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        why = family.refusal(model)
        if why is not None:
            refused[name] = why
    assert not refused, refused
    assert sum(n.startswith("vit_pe_core") for n in names) == 5  # the MAP-pooled ones, now accepted


def test_refusals() -> None:
    pooled_by_max: Any = make("eva02")
    pooled_by_max.global_pool = "avgmax"
    with pytest.raises(TypeError, match="global_pool='avgmax' has no label readout; use 'token'"):
        backbones.adapt(pooled_by_max, TLAlign())
    assert type(backbones.adapt(pooled_by_max, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    dropping = Eva(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=C, patch_drop_rate=0.5)
    with pytest.raises(TypeError, match=r"patch dropout \(patch_drop_rate > 0\) drops tokens"):
        backbones.adapt(dropping, TLAlign())
    odd: Any = make("eva02")
    odd.blocks[1].attn = nn.Identity()
    with pytest.raises(TypeError, match="block 1 is EvaBlock with Identity; only EvaBlock or EvaBlockPostNorm"):
        backbones.adapt(odd, TLAlign())
    padded = Eva(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=C, dynamic_img_pad=True)
    with pytest.raises(TypeError, match="dynamic_img_pad pads images"):
        backbones.adapt(padded, TLAlign())
