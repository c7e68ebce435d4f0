"""The CrossViT adapter: preservation, fast = reference (two branches, rescaled and multi-conv starts,
cross-attention, both readouts, TransMix), the per-branch starts, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import B, C, IMG, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, sharpen
from timm.models.crossvit import CrossVit
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabelMap, backbones
from mixlabels.backbones.families.crossvit import AdaptedCrossViT, branch_start_matrices

ALL = list(SCHEMES)
CONFIGS: dict[str, dict[str, Any]] = {
    # branch 1 resized bicubically 32 -> 24 px; a second multi-scale block with two fusion blocks
    "rescaled": {"img_scale": (1.0, 0.75), "patch_size": (4, 8), "depth": ((1, 2, 0), (1, 1, 2))},
    "cropped_avg": {"img_scale": (1.0, 0.75), "patch_size": (4, 8), "depth": ((1, 2, 0),), "crop_scale": True,
                    "global_pool": "avg"},
    # the "dagger" stem: 7x7/4, 3x3/3 (12 px) or 3x3/2 (16 px), then 3x3/1 convs
    "multi_conv": {"img_scale": (1.0, 1.0), "patch_size": (12, 16), "depth": ((1, 1, 0),), "multi_conv": True,
                   "embed_dim": (16, 32)},
}  # fmt: skip


def make(config: str = "rescaled", drop_path_rate: float = 0.0, img_size: int = IMG) -> CrossVit:
    torch.manual_seed(0)
    kwargs = {"embed_dim": (16, 32), **CONFIGS[config]}
    model = CrossVit(img_size=img_size, num_heads=(2, 2), mlp_ratio=(2, 2, 1), num_classes=C,
                     drop_path_rate=drop_path_rate, **kwargs)
    with torch.no_grad():  # sharpen the cross-attention too (wq, wk: not what `sharpen` finds)
        for mod in model.modules():
            if hasattr(mod, "wq"):
                mod.wq.weight.mul_(8.0)
                mod.wk.weight.mul_(8.0)
    return sharpen(model)  # type: ignore[return-value]


@pytest.mark.parametrize("config", ["rescaled", "cropped_avg"])
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned", "transmix") if config == "rescaled" else ("tl_align",):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


def test_multi_conv_function_preservation() -> None:
    model = make("multi_conv", drop_path_rate=0.5, img_size=48).train()  # 12 and 16 px patches tile 48 px
    images = torch.randn(B, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    lm = TokenLabelMap.unmixed(torch.arange(B), C, (48, 48))
    torch.manual_seed(3)
    expected = model(images)
    torch.manual_seed(3)
    assert_close(backbones.adapt(model, TLAlign())(images, lm).output, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ALL)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["cropped_avg"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    for scheme in ("tl_align", "tokens_aligned", "transmix"):
        check_parity(make(config, drop_path_rate=0.4), scheme)


def test_multi_conv_fast_equals_reference() -> None:
    model = make("multi_conv", drop_path_rate=0.3, img_size=48).train()
    g = torch.Generator().manual_seed(4)
    images = torch.randn(B, 3, 48, 48, generator=g)
    mask = torch.ones(B, 48, 48)
    mask[:, 5:30, 11:40] = 0.0
    lm = TokenLabelMap.from_mask(mask, torch.arange(B).roll(1), torch.arange(B), num_classes=C)
    for scheme in ("tl_align", "transmix"):
        torch.manual_seed(1)
        a = backbones.adapt(model, SCHEMES[scheme])(lm.mix_pixels(images), lm)
        torch.manual_seed(1)
        b = backbones.adapt(model, SCHEMES[scheme], reference=True)(lm.mix_pixels(images), lm)
        assert_close(a.target, b.target, rtol=1e-5, atol=1e-5)
        assert (a.target - lm.image_targets()).abs().max() > 1e-3


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), ALL)


def test_branch_starts() -> None:
    """Unscaled branch: exact patch areas; bicubic branch: rows are Norm|taps| distributions over nearby pixels."""
    model = make()
    (h0, w0), (h1, w1) = branch_start_matrices(model, (IMG, IMG))
    assert_close(h0, torch.kron(torch.eye(8, dtype=torch.float64), torch.full((1, 4), 0.25, dtype=torch.float64)))
    assert h1.shape == (3, IMG) and w1.shape == (3, IMG)
    assert_close(h1.sum(-1), torch.ones(3, dtype=torch.float64))
    assert (h1 >= 0).all() and (h1[0, 13:] == 0).all()  # patch 0 of 24 px reads pixels 0..~11 of 32 px
    images, lm = cutmix_batch()
    scheme = TLAlign(layers=(0,))
    out = backbones.adapt(model, scheme, reference=True)(images, lm)
    assert_close(out.target, backbones.adapt(model, scheme)(images, lm).target, rtol=1e-5, atol=1e-5)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "crossvit")
    for name in ("crossvit_tiny_240", "crossvit_9_240", "crossvit_18_240", "crossvit_9_dagger_240", "crossvit_15_dagger_408"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        vit = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    assert family.refusal(vit) == "VisionTransformer is not a timm CrossVit"
    odd = make()
    odd.blocks[0].blocks[1][0].attn = torch.nn.Identity()
    assert family.refusal(odd) == "multi-scale block 0 branch 1 block 0 is not timm's ViT Block with its Attention"
    images, lm = cutmix_batch(token_space=True)
    with pytest.raises(ValueError, match="CrossViT embeds the image twice"):
        backbones.adapt(make(), TLAlign())(images, lm)
    images, lm = cutmix_batch()
    with pytest.raises(TypeError, match="is not a timm CrossVit"):
        AdaptedCrossViT(vit, TLAlign())


def _maps() -> dict[str, TokenLabelMap]:
    """CutMix maps of each mask kind the windowed start weighs: boxes on the pixels (timm's CutMix) and on 4x4 cells
    (snapped to a grid), cells of a per-pixel mask and of a coarse 8x8 one."""
    g = torch.Generator().manual_seed(5)
    partner, labels = torch.arange(B).roll(1), torch.randint(0, C, (B,), generator=g)
    boxes = torch.tensor([[3, 20, 5, 29], [0, 32, 7, 8]] * (B // 2))
    coarse = torch.rand(B, 8, 8, generator=g)
    return {
        "pixel boxes": TokenLabelMap.from_boxes(boxes, (IMG, IMG), partner, labels, num_classes=C),
        "cell boxes": TokenLabelMap.from_boxes(boxes // 8, (4, 4), partner, labels, num_classes=C, image_size=(IMG, IMG)),
        "pixel cells": cutmix_batch()[1],
        "coarse cells": TokenLabelMap.from_mask(coarse, partner, labels, num_classes=C, image_size=(IMG, IMG)),
    }


@pytest.mark.parametrize("kind", ["pixel boxes", "cell boxes", "pixel cells", "coarse cells"])
@pytest.mark.parametrize("scheme", ["tl_align", "transmix"])
def test_windowed_start_of_every_mask_equals_the_pixels_reference(kind: str, scheme: str) -> None:
    """The labels start on both branches' windows at once (``window_weights``, no per-pixel map): the targets and
    TransMix's class-attention weights equal the reference's, which starts on the pixels by explicit matrices."""
    from mixlabels.backbones.families.crossvit import _start

    model, lm = make(drop_path_rate=0.4).train(), _maps()[kind]
    start, sizes = _start(model, lm, (IMG, IMG))
    assert start.pixels is None and start.layout.pixel_windows is not None and sizes == [64, 9]
    images = lm.mix_pixels(torch.randn(B, 3, IMG, IMG, generator=torch.Generator().manual_seed(2)))
    torch.manual_seed(1)
    a = backbones.adapt(model, SCHEMES[scheme])(images, lm)
    torch.manual_seed(1)
    b = backbones.adapt(model, SCHEMES[scheme], reference=True)(images, lm)
    assert_close(a.target, b.target, rtol=1e-5, atol=1e-6)
    assert (a.target - lm.image_targets()).abs().max() > 1e-3


def test_annotator_token_targets_start_on_the_pixels() -> None:
    """Annotator maps start on the pixels (a layout's windows take none): that route equals the reference too."""
    from mixlabels.backbones.families.crossvit import _start

    model = make(drop_path_rate=0.4).train()
    images, lm = cutmix_batch()
    lm = lm.with_token_targets(torch.rand(B, IMG, IMG, C, generator=torch.Generator().manual_seed(3)).softmax(-1))
    start, _ = _start(model, lm, (IMG, IMG))
    assert start.pixels is not None and start.layout.grid == (IMG, IMG)
    for scheme in ("tokens", "tokens_aligned"):
        torch.manual_seed(1)
        a = backbones.adapt(model, SCHEMES[scheme])(images, lm)
        torch.manual_seed(1)
        b = backbones.adapt(model, SCHEMES[scheme], reference=True)(images, lm)
        assert a.token_target is not None and b.token_target is not None
        assert_close(a.target, b.target, rtol=1e-5, atol=1e-6)
        assert_close(a.token_target, b.token_target, rtol=1e-5, atol=1e-6)
