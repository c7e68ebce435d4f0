"""The NaFlexVit adapter on images: preservation, fast = reference, one-hot, MixToken, timm names, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import B, C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, set_fused, sharpen
from timm.models.naflexvit import NaFlexVit, batch_patchify
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TokenLabelMap, TransMix, backbones
from mixlabels.backbones._count import _meta_build

GAP = {"global_pool": "avg", "fc_norm": True, "reg_tokens": 2, "init_values": 0.5}
TOKEN = {"class_token": True, "global_pool": "token"}
CONFIGS: dict[str, dict[str, Any]] = {
    # naflexvit_*_gap: registers, average pooling under fc_norm, the learned table resampled from 8x8
    "gap": {**GAP, "pos_embed_grid_size": (8, 8)},
    # *_par_gap / *_parfac_gap: aspect-preserving (and factorised) tables; 8x4 patches make the grid 4x8
    "par_gap": {**GAP, "patch_size": (8, 4), "pos_embed_ar_preserving": True},
    "parfac_gap": {**GAP, "patch_size": (8, 4), "pos_embed_ar_preserving": True, "pos_embed": "factorized"},
    # *_map and *_siglip: the MAP head, with a register token or none
    "map": {"global_pool": "map", "reg_tokens": 1, "init_values": 0.5},
    "siglip": {"global_pool": "map", "act_layer": "gelu_tanh", "pos_embed_interp_mode": "bilinear"},
    # *_radio_*: class token read by the head, registers, no final norm, corner-aligned bilinear table
    "radio": {**TOKEN, "reg_tokens": 2, "final_norm": False, "pos_embed_grid_size": (12, 12),
              "pos_embed_interp_mode": "bilinear", "pos_embed_ar_preserving": True, "pos_embed_antialias": False,
              "pos_embed_align_corners": True, "init_values": 0.5},
    # a conv patch embedding (padding only images the input check refuses), average over the prefix tokens too
    "conv_prefix": {**GAP, "embed_proj_type": "conv", "pool_include_prefix": True, "dynamic_img_pad": True},
    # per-patch input norm and embedding norm, channels-first patches, pre-norm, qk norm, attention and MLP scale norms
    "norms": {**TOKEN, "input_norm_layer": "layernorm", "embed_norm_layer": "layernorm", "patchify_channels_last": False,
              "pre_norm": True, "qk_norm": True, "scale_attn_inner_norm": True, "scale_mlp_norm": True},
    # EvaBlocks with a model-level rotary embedding
    "rope_axial": {**TOKEN, "rope_type": "axial", "pos_embed": "none", "attn_type": "rope", "swiglu_mlp": True},
    "rope_mixed": {**GAP, "rope_type": "mixed", "rope_temperature": 10.0, "attn_type": "eva"},
    "rope_mrope": {**TOKEN, "rope_type": "mrope", "rope_mrope_section": (2, 3, 3), "rope_shift_coords": 1.0, "attn_type": "rope"},
    "rope_dinov3_gqa": {**TOKEN, "rope_type": "dinov3", "rope_rotate_half": True, "rope_rescale_coords": 2.0,
                        "attn_type": "rope", "qkv_fused": False, "num_kv_heads": 1, "qk_norm": True, "reg_tokens": 2, "attn_gated": True},
}  # fmt: skip
MAP_CONFIGS = ("map", "siglip")
CLASS_TOKEN_CONFIGS = tuple(c for c in CONFIGS if CONFIGS[c].get("global_pool") == "token")


def make(config: str, drop_path_rate: float = 0.0) -> NaFlexVit:
    torch.manual_seed(0)
    kwargs = {"patch_size": 8, **CONFIGS[config]}
    model = NaFlexVit(img_size=32, num_classes=C, embed_dim=32, depth=2, num_heads=2, drop_path_rate=drop_path_rate, **kwargs)
    with torch.no_grad():  # tiny tables: make the position embedding count
        for name, p in model.named_parameters():
            if "pos_embed" in name:
                p.normal_(0.0, 0.5)
    sharpen(model)
    return model


def schemes_for(config: str) -> list[str]:
    """TransMix needs the class token; a MAP head pools the patch labels away (no token targets)."""
    names = list(SCHEMES) if config in CLASS_TOKEN_CONFIGS else POOLED
    return [s for s in names if not (config in MAP_CONFIGS and s.startswith("tokens"))]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    schemes = ("none", "tl_align", "tokens_aligned") if config in ("gap", "radio", "rope_dinov3_gqa") else ("tl_align",)
    for scheme in schemes:
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("config, scheme", [(c, s) for c in ("gap", "radio") for s in schemes_for(c)])
def test_fast_path_equals_reference(config: str, scheme: str) -> None:
    """Every pooled scheme on a pooled model, every scheme (TransMix too) on one whose head reads the class token."""
    check_parity(make(config, drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c not in ("gap", "radio")])
def test_fast_path_equals_reference_variants(config: str) -> None:
    scheme = "transmix" if config in CLASS_TOKEN_CONFIGS else "tl_official" if config in MAP_CONFIGS else "tokens_aligned"
    check_parity(make(config, drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["gap", "conv_prefix", "rope_dinov3_gqa"])
def test_mixtoken_fast_equals_reference(config: str) -> None:
    model = make(config, drop_path_rate=0.2)
    check_parity(model, "tl_align", token_space=True)
    images, lm = cutmix_batch(token_space=True)
    out = backbones.adapt(model.eval(), TLAlign())(images, lm)
    assert (out.logits - model(images)).abs().max() > 1e-4  # the embeddings were mixed, not the pixels


def test_explicit_attention_fast_equals_reference() -> None:
    """timm's explicit (unfused) attention path: the class row and the labels from the same softmax."""
    check_parity(set_fused(make("radio", drop_path_rate=0.2), False), "transmix")
    check_parity(set_fused(make("rope_mixed", drop_path_rate=0.2), False), "tl_align")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("radio"), list(SCHEMES))
    check_unmixed_is_one_hot(make("map"), ["tl_align", "tl_official"])


def test_other_resolution_resamples_the_table() -> None:
    """A 48x40 batch: the position tables are resampled to a 6x5 grid, and the labels follow the tokens."""
    model = make("par_gap").eval()
    g = torch.Generator().manual_seed(4)
    images = torch.randn(B, 3, 48, 40, generator=g)
    mask = torch.ones(B, 48, 40)
    mask[:, 5:30, 3:21] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.arange(B).roll(1), torch.arange(B), num_classes=C)
    mixed = lm.mix_pixels(images)
    fast = backbones.adapt(model, TLAlign())(mixed, lm)
    ref = backbones.adapt(model, TLAlign(), reference=True)(mixed, lm)
    assert_close(fast.logits, model(mixed), rtol=1e-5, atol=1e-6)
    assert_close(fast.target, ref.target, rtol=1e-5, atol=1e-6)
    assert (fast.target - lm.image_targets()).abs().max() > 1e-3


def test_patchify_matches_the_conv_layout() -> None:
    """The linear embedding's patches are the conv's: patch (i, j) is the image's block (i, j)."""
    images = torch.arange(2 * 3 * 16 * 8, dtype=torch.float32).view(2, 3, 16, 8)
    patches, grid = batch_patchify(images, (8, 4), channels_last=False)
    assert grid == (2, 2)
    assert_close(patches[1, 2], images[1, :, 8:16, 0:4].flatten())  # row 1, column 0


def test_timm_names_adapt() -> None:
    """Every naflexvit name (gap, par_gap, parfac_gap, map, siglip, radio): this family, and no other, accepts it."""
    names = timm.list_models(module="naflexvit")
    assert len(names) == 14
    refused, others = {}, {}
    for name in names:
        model = _meta_build(name)
        assert model is not None, name
        accepting = [f.name for f in backbones.FAMILIES[:-1] if f.refusal(model) is None]  # not the NoAlign fallback
        if "naflexvit" not in accepting:
            refused[name] = next(f for f in backbones.FAMILIES if f.name == "naflexvit").refusal(model)
        if accepting != ["naflexvit"]:
            others[name] = accepting
    assert not refused, refused
    assert not others, others


def test_naflex_batches_are_refused() -> None:
    model = make("gap")
    images, lm = cutmix_batch()
    adapted = backbones.adapt(model, TLAlign())
    patches, _ = batch_patchify(images, (8, 8))
    batch = {"patches": patches, "patch_coord": torch.zeros(B, 16, 2, dtype=torch.long),
             "patch_valid": torch.ones(B, 16, dtype=torch.bool)}  # fmt: skip
    with pytest.raises(ValueError, match=r"a NaFlex batch \(a dict of patch_coord, patch_valid, patches\) has no fixed"):
        adapted(batch, lm)
    with pytest.raises(ValueError, match="look pre-patchified"):
        adapted(patches, lm)
    model.eval()
    assert_close(adapted(batch), model(batch), rtol=0, atol=0)  # without a label map: timm's own NaFlex forward
    assert_close(adapted(images), model(images), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        adapted(torch.randn(B, 3, 36, 36), TokenLabelMap.unmixed(torch.arange(B), C, (36, 36)))


def test_refusals() -> None:
    maxed = NaFlexVit(img_size=32, num_classes=C, patch_size=8, embed_dim=32, depth=1, num_heads=2, global_pool="avgmax")
    with pytest.raises(TypeError, match="global_pool='avgmax' has no label readout"):
        backbones.adapt(maxed, TLAlign())
    assert type(backbones.adapt(maxed, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    dropping = NaFlexVit(img_size=32, num_classes=C, patch_size=8, embed_dim=32, depth=1, num_heads=2, patch_drop_rate=0.5)
    with pytest.raises(TypeError, match=r"patch dropout \(patch_drop_rate > 0\) drops tokens"):
        backbones.adapt(dropping, TLAlign())
    diff = NaFlexVit(img_size=32, num_classes=C, patch_size=8, embed_dim=32, depth=1, num_heads=2, attn_layer="diff")
    with pytest.raises(TypeError, match="block 0 is Block with DiffAttention; only Block with Attention or EvaBlock"):
        backbones.adapt(diff, TLAlign())
    with pytest.raises(ValueError, match=r"pools the tokens \(global_pool='avg', or 'map' attention pooling\) and reads none of its 2 prefix"):
        backbones.adapt(make("gap"), TransMix())(*cutmix_batch())
    with pytest.raises(ValueError, match="a MAP head"):
        backbones.adapt(make("map"), SCHEMES["tokens"])(*cutmix_batch())
