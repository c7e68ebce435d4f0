"""The ConvNeXt adapter: preservation, fast = reference, the depthwise-conv label rule."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, IMG, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch.testing import assert_close

from mixlabels import backbones
from mixlabels.backbones._common import conv_label_kernel, conv_mix
from mixlabels import TLAlign, TransMix

CONFIGS: dict[str, dict[str, Any]] = {
    "v1": {},
    "conv_mlp": {"conv_mlp": True},
    "v2_grn": {"use_grn": True, "ls_init_value": None},
    "head_norm_first": {"head_norm_first": True},
}


def make(config: str, drop_path_rate: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model: torch.nn.Module = timm.create_model(
        "convnext_atto", pretrained=False, depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), num_classes=C,
        drop_path_rate=drop_path_rate, **{"ls_init_value": 1.0, **CONFIGS[config]},
    )  # fmt: skip
    return model


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("v1", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["conv_mlp", "v2_grn", "head_norm_first"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned")


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(make("v1", drop_path_rate=0.2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("v1"), POOLED)


def test_conv_label_rule() -> None:
    """Norm(T(K)): a delta kernel is the identity; any kernel keeps rows on the simplex, border-aware."""
    y = torch.rand(2, 16, 3)
    y = y / y.sum(-1, keepdim=True)
    delta = torch.zeros(4, 1, 3, 3)
    delta[:, :, 1, 1] = -2.0  # sign and scale do not matter: |K_c| / sum |K_c|
    assert_close(conv_mix(y, (4, 4), conv_label_kernel(delta), (1, 1), (1, 1)), y)
    mixed = conv_mix(y, (4, 4), conv_label_kernel(torch.randn(4, 1, 3, 3)), (1, 1), (1, 1))
    assert_close(mixed.sum(-1), torch.ones(2, 16))
    uniform = torch.ones(1, 16, 1)  # border tokens see fewer real taps, yet keep their mass
    assert_close(conv_mix(uniform, (4, 4), torch.ones(3, 3), (1, 1), (1, 1)), uniform)


def test_transmix_refused_and_overlap_stem_refused() -> None:
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("v1"), TransMix())(images, lm)
    overlap = timm.create_model("convnext_atto", pretrained=False, stem_type="overlap", num_classes=C)
    with pytest.raises(TypeError, match="patch"):
        backbones.adapt(overlap, TLAlign())
    assert IMG % 32 == 0  # four stages: 8x8 -> 1x1 tokens
