"""The VOLO adapter: preservation, fast = reference, outlook attention's label fold, the aux head, every timm name."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from test_backbones_common import SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.volo import VOLO, OutlookAttention
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabeling, backbones
from mixlabels.backbones.families.volo import _outlook, outlook_labels, outlook_matrix

TINY = dict(img_size=32, patch_size=4, stem_hidden_dim=16, layers=(1, 1), embed_dims=(16, 32), num_heads=(1, 2),
            downsamples=(True, False), outlook_attention=(True, False), mlp_ratio=(2.0, 2.0))  # fmt: skip
ALL = list(SCHEMES)


def make(drop: float = 0.0, **kwargs: object) -> nn.Module:
    """A tiny VOLO (outlook attention on 8x8, self-attention on 4x4, class attention) with sharpened attention."""
    torch.manual_seed(0)
    options = {**TINY, "post_layers": ("ca", "ca"), "drop_path_rate": drop, **kwargs}
    model = VOLO(num_classes=10, **options)  # type: ignore[arg-type]
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, OutlookAttention):
                mod.attn.weight.mul_(8.0)  # the window attentions come from a linear layer: near uniform at init
            elif hasattr(mod, "qkv"):
                mod.qkv.weight[: 2 * mod.qkv.out_features // 3] *= 4.0
            elif hasattr(mod, "kv"):
                mod.q.weight.mul_(4.0)
                mod.kv.weight[: mod.kv.out_features // 2] *= 4.0
    return model


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tl_align", "transmix", "tokens_aligned"):
        check_preservation(make(drop=0.5), SCHEMES[scheme])
    check_preservation(make(use_aux_head=False, global_pool="avg"), SCHEMES["tl_align"])


@pytest.mark.parametrize("scheme", ALL)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop=0.4), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(drop=0.4), "tl_align", token_space=True)
    check_parity(make(use_aux_head=False, global_pool="avg"), "tl_align")
    check_parity(make(patch_size=8), "tokens_aligned")  # a 4x4 outlook grid: windows at the border everywhere


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), ALL)


def test_outlook_step_is_timms_and_its_label_fold_is_the_explicit_matrix() -> None:
    model = make().eval()
    attn = model.network[0][0].attn
    g = torch.Generator().manual_seed(0)
    for grid in ((8, 8), (7, 5)):  # odd sides: the last window overhangs the grid
        x = torch.randn(2, *grid, 16, generator=g)
        out, a = _outlook(attn, x)
        assert_close(out, attn(x), rtol=0, atol=0)
        y = torch.rand(2, grid[0] * grid[1], 3, generator=g).softmax(-1)
        mixed = outlook_labels(attn, a, y, grid)
        assert_close(mixed.double(), outlook_matrix(attn, a, grid) @ y.double(), rtol=1e-6, atol=1e-6)
        assert_close(mixed.sum(-1), torch.ones(2, grid[0] * grid[1]))


def test_a_window_peaked_on_its_centre_keeps_each_tokens_labels_at_stride_1() -> None:
    """Stride 1, every window's tap i attending to its own position: the fold is the identity on labels."""
    attn = OutlookAttention(8, num_heads=2, kernel_size=3, padding=1, stride=1)
    a = torch.full((1, 2, 16, 9, 9), -30.0)
    a[..., range(9), range(9)] = 30.0
    y = torch.rand(1, 16, 3).softmax(-1)
    assert_close(outlook_labels(attn, a.softmax(-1), y, (4, 4)), y, rtol=1e-5, atol=1e-5)


def test_aux_head_logits_and_token_logits() -> None:
    """timm's logits keep the aux head's max term; token labeling reads the aux head on every patch token."""
    model = make().eval()
    images, lm = cutmix_batch()
    out = backbones.adapt(model, TokenLabeling(beta=0.5))(images, lm)
    feats = model.forward_features(images)
    assert_close(out.output, model.forward_head(feats), rtol=1e-5, atol=1e-6)
    assert out.token_logits is not None
    assert_close(out.token_logits, model.aux_head(feats[:, 1:]), rtol=1e-5, atol=1e-6)
    expected = model.head(feats[:, 0]) + 0.5 * out.token_logits.max(dim=1)[0]
    assert_close(out.output, expected, rtol=1e-5, atol=1e-6)


def test_every_timm_name_adapts_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "volo")
    names = timm.list_models("volo*")
    assert len(names) >= 10
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    torch.manual_seed(0)
    no_cls = VOLO(num_classes=10, **TINY, post_layers=None, global_pool="avg")  # type: ignore[arg-type]
    assert family.refusal(no_cls) == "a VOLO without class-attention post layers has no class token to read; build it with post_layers"
    with pytest.raises(TypeError, match="class-attention post layers"):
        backbones.adapt(no_cls, TLAlign())
    assert backbones.adapt(no_cls, SCHEMES["none"]) is not None  # NoAlign takes any classifier
    images, lm = cutmix_batch()
    assert F.softmax(backbones.adapt(make(), TLAlign())(images, lm).logits, -1).shape == (4, 10)


def test_transmix_refuses_a_last_grid_that_does_not_tile_the_image() -> None:
    """40 px with patch 4: 10x10 patches, then a 2x2 stride-2 conv: 5x5 patches of 8 px tile it (TransMix runs); with
    patch 8 the 5x5 grid becomes 2x2 patches of 16 px over a 40 px image: no exact areas, refused by name."""
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(2, 3, 40, 40, generator=g), torch.tensor([1, 2])
    from mixlabels import TransMix
    from mixlabels.strategies import CutMix

    mixed, lm = CutMix(10, generator=g)(images, labels)
    backbones.adapt(make(img_size=40), TransMix())(mixed, lm)
    with pytest.raises(ValueError, match=r"2x2 patch grid of 16-pixel patches, which does not tile the 40x40 image"):
        backbones.adapt(make(img_size=40, patch_size=8), TransMix())(mixed, lm)
    backbones.adapt(make(img_size=40, patch_size=8), TLAlign())(mixed, lm)  # the labels' own windows: no areas needed
