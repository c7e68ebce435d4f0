"""The TNT adapter: preservation, fast = reference (pixel and patch tokens, legacy and current pixel
embeddings, per-patch stochastic depth, TransMix, MixToken), the starts, refusals."""

from __future__ import annotations

import pytest
import timm
import torch
from test_backbones_common import C, IMG, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.tnt import TNT
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, backbones
from mixlabels.backbones.families.tnt import tnt_start_matrices

ALL = list(SCHEMES)


def make(drop_path_rate: float = 0.0, legacy: bool = False, global_pool: str = "token") -> TNT:
    torch.manual_seed(0)
    model = TNT(img_size=IMG, patch_size=8, embed_dim=32, inner_dim=8, depth=2, num_heads_inner=2, num_heads_outer=2,
                num_classes=C, drop_path_rate=drop_path_rate, legacy=legacy, global_pool=global_pool)
    with torch.no_grad():  # sharpen: random-init attention is near uniform (TNT's Attention has `qk`)
        for mod in model.modules():
            if hasattr(mod, "qk"):
                mod.qk.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("legacy", [False, True])
def test_function_preservation_train_mode(legacy: bool) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned") if not legacy else ("tl_align",):
        check_preservation(make(drop_path_rate=0.5, legacy=legacy), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", ALL)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_variants_fast_equal_reference() -> None:
    for scheme in ("tl_align", "transmix", "tokens"):
        check_parity(make(drop_path_rate=0.4, legacy=True), scheme)
    check_parity(make(drop_path_rate=0.4, global_pool="avg"), "tl_align")
    check_parity(make(drop_path_rate=0.2), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), ALL)


def test_starts() -> None:
    """Pixel tokens start on their conv windows inside the patch (current) or across patch borders
    (legacy); a patch token on the aggregate (mean) of its pixel tokens' rows, inside the patch."""
    (th, _), (ph, _) = tnt_start_matrices(make(), (IMG, IMG))
    assert th.shape == (8, IMG) and (th[1, 8:] == 0).all()  # 7x7/4 pad 3 inside an 8 px patch: taps 1..7
    assert_close(th[1, 1:8], torch.full((7,), 1 / 7, dtype=torch.float64))
    assert_close(th[0, :4], torch.full((4,), 1 / 4, dtype=torch.float64))  # taps -3..3: 4 inside the patch
    assert_close(ph, (th[0::2] + th[1::2]) / 2)  # 2 pixel tokens per patch along an axis
    assert (ph[0, 8:] == 0).all() and (ph[0, :8] > 0).all()
    (lh, _), _ = tnt_start_matrices(make(legacy=True), (IMG, IMG))
    assert lh[2, 7] > 0 and th[2, 7] == 0  # legacy: patch 1's first token reads pixel 7 of patch 0


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "tnt")
    for name in ("tnt_s_patch16_224", "tnt_s_legacy_patch16_224", "tnt_b_patch16_224"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        vit = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    assert family.refusal(vit) == "VisionTransformer is not a timm TNT"
    odd = make()
    odd.blocks[1].mlp_in = torch.nn.Identity()
    with pytest.raises(TypeError, match="block 1's MLPs are not timm Mlps"):
        backbones.adapt(odd, TLAlign())
    assert type(backbones.adapt(odd, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    pooled = make()
    pooled.global_pool = ""
    assert family.refusal(pooled) == "global_pool='' has no label readout; use 'token' or 'avg'"
    images, lm = cutmix_batch()
    assert backbones.adapt(make(), TLAlign())(images, lm).target.shape == (images.shape[0], C)
