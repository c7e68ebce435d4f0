"""The VGG adapter (plain conv and max-pool features, with or without batch norm; ConvMlp's unpadded 7x7 conv on the
map; timm's ClassifierHead): preservation, fast = reference, the head conv's rule by hand, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.vgg import VGG
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, backbones
from mixlabels.backbones._convnet import apply_path, path_matrix
from mixlabels.backbones._dense import conv_matrix, row_normalise
from mixlabels.backbones.families.vgg import TINY_CFG

FAMILY = next(f for f in backbones.FAMILIES if f.name == "vgg")

# 32 px. "plain": an 8x8 map, the 7x7 head conv to 2x2; "bn": batch norm, a 16x16 map to 10x10; "one": five max
# pools to a 1x1 map, which ConvMlp copies to 7x7.
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "bn": {"cfg": [8, "M", 8, 16], "norm_layer": nn.BatchNorm2d},
    "one": {"cfg": [8, "M", 8, "M", 16, "M", 16, "M", 16, "M"]},
}


def make(variant: str = "plain") -> nn.Module:
    torch.manual_seed(0)
    args: dict[str, Any] = {"cfg": TINY_CFG, "mlp_ratio": 1 / 256, "drop_rate": 0.2} | VARIANTS[variant]
    return VGG(num_classes=C, **args)


@pytest.mark.parametrize("variant", VARIANTS)
def test_function_preservation_train_mode(variant: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(variant), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make("bn"), "tl_align")
    check_parity(make("one"), "tl_align")
    check_parity(make(), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_head_conv_is_the_unpadded_conv_rule() -> None:
    """``pre_logits``' path on an 8x8 map equals the unpadded 7x7 conv's own row-normalised matrix (2x2 outputs,
    every tap inside the map), in both walks."""
    model: Any = make()
    adapted: Any = backbones.AdaptedVGG(model, TLAlign())
    adapted._pre_logits_grid = (8, 8)
    path, shortcut = adapted._paths(model.pre_logits)
    assert shortcut is None
    k = model.pre_logits.fc1.weight.detach().double().abs()
    k = (k / k.sum(dim=(-2, -1), keepdim=True)).mean(dim=(0, 1))
    by_hand, out = conv_matrix((8, 8), k)  # no padding: (2x2, 8x8)
    assert out == (2, 2)
    m, grid = path_matrix(path, (8, 8))
    assert grid == (2, 2)
    assert_close(m, row_normalise(by_hand))
    labels = torch.rand(2, 64, 5).softmax(-1)
    fast, grid = apply_path(path, labels, (8, 8))
    assert grid == (2, 2)
    assert_close(fast, torch.einsum("mn,bnl->bml", row_normalise(by_hand).float(), labels), rtol=1e-5, atol=1e-6)


def test_timm_names_adapt_and_refusals() -> None:
    names = timm.list_models(module="vgg")
    assert len(names) == 8
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        maxpool = timm.create_model("vgg11", pretrained=False, global_pool="max")
    with pytest.raises(TypeError, match=r"the head \(global_pool='max', use_conv=False\) has no label readout"):
        backbones.AdaptedVGG(maxpool, TLAlign())
    circular: Any = make()
    circular.features[3] = nn.Conv2d(8, 16, 3, padding=1, padding_mode="circular")
    with pytest.raises(TypeError, match=r"features module 3 \(Conv2d\) uses padding \(1, 1\) \(circular\)"):
        backbones.adapt(circular, TLAlign())
    shrinking: Any = make()
    shrinking.features[3] = nn.Conv2d(8, 16, 3)
    with pytest.raises(TypeError, match=r"features module 3 is a stride-1 \(3, 3\) conv with padding \(0, 0\) \(dilation \(1, 1\)\): it changes the grid"):
        backbones.adapt(shrinking, TLAlign())
    padded: Any = make()
    padded.pre_logits.fc1.padding = (1, 1)
    assert "is not an unpadded odd stride-1 conv" in str(FAMILY.refusal(padded))
    images, lm = cutmix_batch()
    torch.manual_seed(0)
    small = backbones.adapt(VGG([8, "M", 8, "M", 8, "M"], num_classes=C, mlp_ratio=1 / 256), TLAlign())  # a 4x4 map
    with pytest.raises(ValueError, match=r"pools the \(4, 4\) map up to 7x7 .* which has no label rule here"):
        small(images, lm)
