"""The BEiT adapter: preservation, fast = reference with per-block and shared biases, timm names, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, set_fused, sharpen
from timm.models.beit import Beit
from torch import nn

from mixlabels import NoAlign, TLAlign, backbones

BEIT = {"use_abs_pos_emb": False, "use_rel_pos_bias": True, "init_values": 0.1}  # timm's beit_* / beitv2_*
CONFIGS: dict[str, dict[str, Any]] = {
    "beit_avg": BEIT,
    "beit_token": {**BEIT, "global_pool": "token"},
    "shared_abs": {"use_shared_rel_pos_bias": True, "global_pool": "token"},
    "both_biases": {**BEIT, "use_shared_rel_pos_bias": True},
    "swiglu_no_qkv_bias": {**BEIT, "swiglu_mlp": True, "scale_mlp": True, "qkv_bias": False, "init_values": None},
}


def make(config: str, drop_path_rate: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = Beit(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=C,
                 drop_path_rate=drop_path_rate, **CONFIGS[config])  # fmt: skip
    with torch.no_grad():  # zero-initialised tables and q/v biases: make them count
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name:
                p.normal_(0.0, 2.0)
            if name.endswith(("q_bias", "v_bias")):
                p.normal_(0.0, 0.5)
    return sharpen(model)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("beit_token", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "beit_token"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "transmix" if CONFIGS[config].get("global_pool") == "token" else "tl_align")
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned")


def test_explicit_attention_separate_qkv_bias_and_mixtoken_fast_equal_reference() -> None:
    check_parity(set_fused(make("both_biases", drop_path_rate=0.2), False), "tl_align")
    model: Any = make("beit_token", drop_path_rate=0.2)
    for blk in model.blocks:
        blk.attn.qkv_bias_separate = True
    check_preservation(model, SCHEMES["tl_align"])
    check_parity(model, "transmix")
    check_parity(make("beit_avg", drop_path_rate=0.2), "tl_align", token_space=True)


def test_frozen_bias_takes_the_fused_kernel() -> None:
    model = make("both_biases")
    for p in model.parameters():
        p.requires_grad_(False)
    check_parity(model, "tl_align")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("beit_token"), list(SCHEMES))
    check_unmixed_is_one_hot(make("beit_avg"), POOLED)


def test_timm_names_adapt() -> None:
    names = timm.list_models(module="beit")
    assert any(n.startswith("beitv2_") for n in names) and any(n.startswith("beit_") for n in names)
    family = next(f for f in backbones.FAMILIES if f.name == "beit")
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name


def test_refusals() -> None:
    unpooled: Any = make("beit_avg")
    unpooled.global_pool = ""
    with pytest.raises(TypeError, match="global_pool='' has no label readout; use 'token'"):
        backbones.adapt(unpooled, TLAlign())
    assert type(backbones.adapt(unpooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    odd: Any = make("beit_avg")
    odd.blocks[1].attn = nn.Identity()
    with pytest.raises(TypeError, match="block 1 is Block with Identity; only timm's Beit Block with its Attention"):
        backbones.adapt(odd, TLAlign())
    odd = make("beit_avg")
    odd.patch_embed.dynamic_img_pad = True
    with pytest.raises(TypeError, match="dynamic_img_pad pads images"):
        backbones.adapt(odd, TLAlign())
