"""The FocalNet adapter: preservation, fast = reference, the gated-levels rule, names, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.focalnet import FocalNet
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TransMix, backbones
from mixlabels.backbones.families.focalnet import focal_mix, gate_weights

# Three stages on 32 px: 8x8, 4x4, 2x2 tokens.
CONFIGS: dict[str, dict[str, Any]] = {
    "srf": {},  # two focal levels (timm's default, the *_srf models)
    "lrf": {"focal_levels": (3, 3, 3), "normalize_modulator": True, "head_hidden_size": 16},
    # the large/xlarge models: post norms, overlapping stem and downsampling, layer scale
    "large": {"use_post_norm": True, "use_overlap_down": True, "layerscale_value": 1e-1, "use_post_norm_in_modulation": True},
}


def make(config: str, drop_path_rate: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return FocalNet(num_classes=C, embed_dim=8, depths=(1, 2, 1), drop_path_rate=drop_path_rate, **CONFIGS[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("srf", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["lrf", "large"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")
    check_parity(make(config, drop_path_rate=0.2), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("large"), POOLED)


def test_gated_levels_rule() -> None:
    """Identity (delta) kernels: every level's labels are the token's own, the global level's the mean
    over all tokens; token i takes them by its normalised absolute gates."""
    mod = make("srf").layers[0].blocks[0].modulation
    with torch.no_grad():
        for level in mod.focal_layers:
            level[0].weight.zero_()
            level[0].weight[:, :, level[0].kernel_size[0] // 2, level[0].kernel_size[1] // 2] = -2.0  # |K|: sign-free
    g = torch.Generator().manual_seed(0)
    y = torch.rand(2, 12, 3, generator=g)
    y = y / y.sum(-1, keepdim=True)
    gates = torch.randn(2, 3, 3, 4, generator=g)  # b, levels + global, h, w
    w = gate_weights(gates)
    assert_close(w.sum(-1), torch.ones(2, 12))
    assert_close(w[0, 5], gates[0, :, 1, 1].abs() / gates[0, :, 1, 1].abs().sum())
    expected = (w[:, :, :2].sum(-1, keepdim=True)) * y + w[:, :, 2:] * y.mean(1, keepdim=True)
    assert_close(focal_mix(mod, y, (3, 4), gates), expected)
    assert_close(gate_weights(torch.zeros(1, 3, 1, 1)), torch.full((1, 1, 3), 1 / 3))


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "focalnet")
    for name in ("focalnet_tiny_srf", "focalnet_tiny_lrf", "focalnet_large_fl3", "focalnet_xlarge_fl4"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("srf"), TransMix())(images, lm)
    maxpooled = make("srf")
    maxpooled.reset_classifier(C, global_pool="max")
    with pytest.raises(TypeError, match="global_pool='max' has no label readout"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"
    dense = make("srf")
    dense.layers[0].blocks[0].modulation.focal_layers[1][0] = torch.nn.Conv2d(8, 8, 5, padding=2)
    with pytest.raises(TypeError, match="stage 0 block 0's focal level 1 conv must be a stride-1 depthwise"):
        backbones.adapt(dense, TLAlign())
