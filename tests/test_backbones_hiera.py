"""The Hiera adapter: preservation, fast = reference, labels unrolled with the tokens, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, set_fused, sharpen
from torch.testing import assert_close

from mixlabels import TLAlign, TransMix, backbones

# 32 px: an 8x8 patch grid in 4x4 mask units, query-pooled twice (4x4, then 2x2 with global attention).
BASE: dict[str, Any] = {"img_size": 32, "embed_dim": 16, "num_heads": 1, "stages": (1, 2, 1), "q_pool": 2,
                        "mask_unit_size": (4, 4), "mask_unit_attn": (True, True, False)}  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    "base": {},
    "no_expand_proj": {"q_pool": 1, "use_expand_proj": False, "init_values": 0.5},  # pooled once: tokens stay unrolled
    "abswin": {"abs_win_pos_embed": True, "global_pos_size": (8, 8)},
}


def make(config: str, drop_path_rate: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = {**BASE, **CONFIGS[config]}
    return sharpen(timm.create_model("hiera_tiny_224", pretrained=False, num_classes=C, drop_path_rate=drop_path_rate, **kwargs))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


def test_function_preservation_eval_mode() -> None:
    model = make("base").eval()
    images, lm = cutmix_batch()
    assert_close(backbones.adapt(model, TLAlign())(images, lm).output, model(images), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("base", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["no_expand_proj", "abswin"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned", token_space=True)


def test_explicit_attention_fast_equals_reference() -> None:
    check_parity(set_fused(make("base", drop_path_rate=0.2), False), "tokens_aligned")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("base"), POOLED)


def test_labels_follow_the_unrolled_tokens() -> None:
    """Token targets without alignment, from a map on the patch grid (exact area labels), are the area labels
    of the final tokens: the poolings of the unrolled 8x8 grid sum 2x2 blocks, and the final 2x2 tokens are
    in raster order. A permutation missing or different from the features' would pool the wrong tokens."""
    model = make("base")
    images, lm = cutmix_batch(token_space=True)
    out = backbones.adapt(model, SCHEMES["tokens"])(images, lm)
    assert out.token_target is not None
    assert_close(out.token_target, lm.targets(lm.token_weights((2, 2))), rtol=1e-5, atol=1e-6)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "hiera")
    for name in timm.list_models(module="hiera"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("base"), TransMix())(images, lm)
    dropping = timm.create_model("hiera_tiny_224", pretrained=False, num_classes=C, patch_drop_rate=0.5, **BASE)
    with pytest.raises(TypeError, match="patch_drop_rate=0.5 drops random mask units"):
        backbones.adapt(dropping, TLAlign())
    maxpooled = timm.create_model("hiera_tiny_224", pretrained=False, num_classes=C, global_pool="max", **BASE)
    with pytest.raises(TypeError, match="global_pool='max' has no label readout"):
        backbones.adapt(maxpooled, TLAlign())
    wrong_size = timm.create_model("hiera_tiny_224", pretrained=False, num_classes=C, **{**BASE, "img_size": 64})
    with pytest.raises(ValueError, match=r"built for a \(16, 16\) patch grid, not \(8, 8\)"):
        backbones.adapt(wrong_size, TLAlign())(images, lm)
