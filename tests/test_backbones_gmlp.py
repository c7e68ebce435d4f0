"""The gMLP adapter: preservation, fast = reference, the spatial-gating rule Norm(|W| + diag|b|), refusals."""

from __future__ import annotations

import pytest
import timm
import torch
from test_backbones_common import C, IMG, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.layers.mlp import GatedMlp
from timm.models.mlp_mixer import MlpMixer, SpatialGatingBlock
from torch.testing import assert_close

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones.families.gmlp import gating_mixing_matrices


def make(drop_path_rate: float = 0.0, trained: bool = True) -> MlpMixer:
    """``trained``: token projections of a trained scale (timm initialises W ~ 1e-6, b = 1: no mixing yet)."""
    torch.manual_seed(0)
    model = MlpMixer(img_size=IMG, patch_size=8, embed_dim=32, num_blocks=2, mlp_ratio=2, block_layer=SpatialGatingBlock,
                     mlp_layer=GatedMlp, num_classes=C, drop_path_rate=drop_path_rate)
    if trained:
        with torch.no_grad():
            for blk in model.blocks:
                blk.mlp_channels.gate.proj.weight.normal_(0.0, 0.5)
                blk.mlp_channels.gate.proj.bias.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
def test_function_preservation_train_mode(scheme: str) -> None:
    check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(make(drop_path_rate=0.2), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_gating_unit_is_the_combination_the_rule_weighs() -> None:
    """SGU(z)_i = sum_j W_ij (u_i * v_j) + b_i u_i: the values and weights Norm(|W| + diag|b|) reads."""
    sgu = make().blocks[0].mlp_channels.gate
    z = torch.randn(2, (IMG // 8) ** 2, 64, generator=torch.Generator().manual_seed(2))
    u, v = z.chunk(2, dim=-1)
    v = sgu.norm(v)
    w, b = sgu.proj.weight, sgu.proj.bias
    expected = torch.einsum("ij,bijc->bic", w, u[:, :, None] * v[:, None]) + b[None, :, None] * u  # b n c
    assert_close(sgu(z), expected)
    n = w.shape[0]
    matrix = gating_mixing_matrices([sgu.proj])[0]
    assert_close(matrix.sum(-1), torch.ones(n))
    assert_close(torch.diagonal(matrix), (w.diagonal().abs() + b.abs()) / (w.abs().sum(-1) + b.abs()))


def test_timm_init_is_channel_only() -> None:
    """At timm's init (W ~ 1e-6, b = 1) the unit is u_i itself: labels stay (Norm(|W|) alone would spread them)."""
    model = make(trained=False)
    proj = model.blocks[0].mlp_channels.gate.proj
    assert_close(gating_mixing_matrices([proj])[0], torch.eye(proj.weight.shape[0]), atol=1e-4, rtol=0)
    images, lm = cutmix_batch()
    out = backbones.adapt(model, TLAlign())(images, lm)
    assert_close(out.target, lm.image_targets(), atol=1e-4, rtol=0)
    w = proj.weight.detach().abs()
    assert (w / w.sum(-1, keepdim=True) - torch.eye(w.shape[0])).abs().max() > 0.5  # what |W| alone would do


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "gmlp")
    for name in ("gmlp_ti16_224", "gmlp_s16_224", "gmlp_b16_224"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        resmlp = timm.create_model("resmlp_12_224", pretrained=False)
    assert family.refusal(resmlp) is not None and "block 0 is ResBlock, not SpatialGatingBlock" in family.refusal(resmlp)  # type: ignore[operator]
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    odd = make()
    odd.blocks[0].mlp_channels.gate.norm = torch.nn.Identity()
    with pytest.raises(TypeError, match="block 0's spatial gating unit is not an nn.Linear over tokens after a per-token LayerNorm"):
        backbones.adapt(odd, TLAlign())
