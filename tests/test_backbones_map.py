"""Attention-pooling heads (timm's global_pool='map', AttentionPoolLatent) on ViT and Eva: fast = reference on
every scheme, preservation, unmixed one-hot, the latent row against timm's own attention, refusals, timm names."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, sharpen
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.testing import assert_close

from mixlabels import TokenLabeling, backbones
from mixlabels.backbones._attention_pool import latent_rows, latent_rows_reference

REFUSED = ("transmix", "tokens", "tokens_aligned")  # no class token the head reads; per-token targets pooled away
ALIGNED = [s for s in SCHEMES if s not in REFUSED]
SMALL: dict[str, Any] = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": C}
CONFIGS: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
    # vit_*_siglip_*: no class token, MAP head over the patch tokens
    "vit_siglip": (VisionTransformer, {"class_token": False, "global_pool": "map", "no_embed_class": True}),
    # a class token and registers the head does not read (prefix excluded, as timm's pool does)
    "vit_prefix": (VisionTransformer, {"global_pool": "map", "reg_tokens": 2, "qk_norm": True, "init_values": 0.5}),
    # vit_pe_core_*: Eva with a class token the MAP head attends over too
    "eva_pe": (Eva, {"global_pool": "map", "use_rot_pos_emb": True, "use_abs_pos_emb": False, "attn_type": "rope"}),
}


def make(config: str, drop_path_rate: float = 0.0, latents: int = 1, pool_type: str = "token") -> nn.Module:
    torch.manual_seed(0)
    cls, kwargs = CONFIGS[config]
    model: Any = cls(**SMALL, drop_path_rate=drop_path_rate, **kwargs)
    pool = model.attn_pool
    if latents > 1:  # timm builds latent_len=1; more latents read out as timm's pool_type says
        pool.latent_len, pool.pool = latents, pool_type
        pool.latent = nn.Parameter(torch.randn(1, latents, pool.latent_dim))
    with torch.no_grad():
        pool.latent.normal_()
        if config == "vit_prefix":  # qk norms and an absolute position embedding: both in the latent's row
            pool.q_norm, pool.k_norm = nn.LayerNorm(pool.head_dim), nn.LayerNorm(pool.head_dim)
            pool.pos_embed = nn.Parameter(torch.randn(16, 32))
    return sharpen(model)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tl_official"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("scheme", ALIGNED)
def test_fast_path_equals_reference(config: str, scheme: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("pool_type", ["token", "avg"])
def test_several_latents(pool_type: str) -> None:
    for scheme in ("tl_align", "tl_last"):
        check_parity(make("vit_prefix", drop_path_rate=0.4, latents=3, pool_type=pool_type), scheme)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_unmixed_is_one_hot(config: str) -> None:
    check_unmixed_is_one_hot(make(config), ALIGNED)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_latent_rows_are_timms_attention(config: str) -> None:
    """The rows both walks use are the softmax timm's AttentionPoolLatent computes (its explicit path, hooked)."""
    model: Any = make(config, latents=3).eval()
    pool = model.attn_pool
    pool.fused_attn = False
    seen: list[torch.Tensor] = []
    original = torch.Tensor.softmax

    def spy(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(t, *args, **kwargs)
        if t.ndim == 4 and t.shape[2] == 3:  # b h l n: the latents' scores
            seen.append(out)
        return out

    x = model.forward_features(cutmix_batch()[0])  # b n c, after the final norm
    torch.Tensor.softmax = spy  # type: ignore[method-assign]
    try:
        model.pool(x)
    finally:
        torch.Tensor.softmax = original  # type: ignore[method-assign]
    assert len(seen) == 1
    timm_rows = seen[0].mean(dim=1)  # b l n over the tokens the head reads
    fast, ref = latent_rows(model, x), latent_rows_reference(model, x)
    skipped = x.shape[1] - timm_rows.shape[-1]
    assert skipped == (0 if isinstance(model, Eva) else model.num_prefix_tokens)
    assert_close(fast[..., skipped:], timm_rows)
    assert_close(ref[..., skipped:].float(), timm_rows, rtol=1e-5, atol=1e-6)
    assert (fast[..., :skipped] == 0).all() and (timm_rows.std() > 1e-3)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_refusals(config: str) -> None:
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="MAP head.*TokenLabeling"):
        backbones.adapt(make(config), TokenLabeling(beta=0.5))(images, lm)
    with pytest.raises(ValueError, match="class token"):
        backbones.adapt(make(config), SCHEMES["transmix"])(images, lm)
    model: Any = make(config)
    model.attn_pool.pool = ""
    with pytest.raises(TypeError, match="pool_type='' returns every latent"):
        backbones.adapt(model, SCHEMES["tl_align"])
