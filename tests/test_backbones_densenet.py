"""The DenseNet adapter (dense layers appended to a running concatenation, transitions, 7x7 or deep blur-pool stems):
preservation, fast = reference, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.layers import BlurPool2d
from timm.models.densenet import DenseNet
from torch import nn

from mixlabels import TLAlign, backbones
from mixlabels.backbones._convnet import Parallel


def make(**kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    args: dict[str, Any] = dict(growth_rate=4, block_config=(2, 2, 1), bn_size=2, proj_drop_rate=0.2, drop_rate=0.2)
    return DenseNet(num_classes=C, **(args | kwargs))


VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "deep_blur": {"stem_type": "deep", "aa_layer": BlurPool2d},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_function_preservation_train_mode(variant: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(**VARIANTS[variant]), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(), scheme)


def test_fast_path_equals_reference_blur_and_token_space() -> None:
    check_parity(make(**VARIANTS["deep_blur"]), "tl_align")
    check_parity(make(), "tl_align", token_space=True)


def test_memory_efficient_is_refused_loudly() -> None:
    """timm's memory_efficient checkpoints the dense layers: a re-run would move the labels twice."""
    from test_backbones_common import cutmix_batch

    images, lm = cutmix_batch()
    with pytest.raises(RuntimeError, match=r"gradient checkpointing re-runs block forwards"):
        backbones.adapt(make(memory_efficient=True), TLAlign())(images, lm)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_dense_layer_joins_the_concatenation_by_channels() -> None:
    adapted: Any = backbones.adapt(make(), TLAlign())
    layers = [u for u in adapted._blocks() if type(u).__name__ == "DenseLayer"]
    second = adapted._paths(layers[1])[0][0]  # 8 stem channels and the first layer's 4, then 4 new ones
    assert isinstance(second, Parallel) and second.weights == (12.0, 4.0)
    assert second.branches[0] == () and second.branches[1] == (layers[1].conv2,)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "densenet")
    names = timm.list_models(module="densenet")
    assert len(names) == 6
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        maxpool = timm.create_model("densenet121", pretrained=False, global_pool="max")
    with pytest.raises(TypeError, match=r"the head \(global_pool='max'\) has no label readout; use 'avg'"):
        backbones.AdaptedDenseNet(maxpool, TLAlign())
    model: Any = make()
    model.features.transition1.pool = nn.AvgPool2d(2, 2, padding=1, count_include_pad=False, ceil_mode=False)
    assert family.refusal(model) is None  # a padded window: still a window
    model.features.transition1.conv = nn.Conv2d(12, 6, 3, padding=1, padding_mode="reflect")
    with pytest.raises(TypeError, match=r"unit 2 \(DenseTransition\) module 1 \(Conv2d\) uses padding"):
        backbones.AdaptedDenseNet(model, TLAlign())
