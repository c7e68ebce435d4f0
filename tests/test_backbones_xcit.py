"""The XCiT adapter: preservation, fast = reference (LPI convs, class attention), refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, set_fused, sharpen
from timm.models.xcit import Xcit
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, backbones
from mixlabels.backbones._convnet import Kernels
from mixlabels.backbones.families.xcit import _lpi_matrix, _lpi_mix

# 32 px, patch 8: a 4x4 grid. "avg": mean readout, tokens_norm, no layer scale in class attention.
CONFIGS: dict[str, dict[str, Any]] = {
    "token": {},
    "avg": {"global_pool": "avg", "tokens_norm": True, "use_pos_embed": False},
}


def make(config: str, drop_path_rate: float = 0.0, fused: bool = True) -> Xcit:
    torch.manual_seed(0)
    model = Xcit(img_size=32, patch_size=8, num_classes=C, embed_dim=32, depth=2, num_heads=2, cls_attn_layers=2,
                 drop_path_rate=drop_path_rate, **CONFIGS[config])  # fmt: skip
    sharpen(set_fused(model, fused))
    return model


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str, fused: bool) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned") + (("transmix",) if config == "token" else ()):
        check_preservation(make(config, drop_path_rate=0.5, fused=fused), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("token", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4, fused=False), "tl_align")
    check_parity(make(config, drop_path_rate=0.2), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("token"), list(SCHEMES))


def test_lpi_rule_is_two_border_renormalised_convs() -> None:
    lpi = make("token").blocks[0].local_mp
    matrix = _lpi_matrix(lpi, (4, 4))
    assert_close(matrix.sum(-1), torch.ones(16, dtype=torch.float64))
    assert (matrix[0].view(4, 4)[3:, :] == 0).all() and (matrix[0].view(4, 4)[:, 3:] == 0).all()  # a 5x5 reach
    # on a small grid (tap matrices) and on a larger one (depthwise convs on the grid layout); the kernels computed
    # for this block alone (None: FSDP2's per-block sharding) or with others of their shape, their in-grid tap
    # weights in one conv (five alike, Kernels' threshold: three copies of conv1 join the two)
    others = [copy.deepcopy(lpi.conv1) for _ in range(3)]
    for grid in ((4, 4), (12, 12)):
        matrix = _lpi_matrix(lpi, grid).float()
        y = torch.rand(2, grid[0] * grid[1], 3)
        y = y / y.sum(-1, keepdim=True)
        for kernels in (None, Kernels([lpi.conv1, lpi.conv2, *others])):
            assert_close(_lpi_mix(lpi, y, grid, kernels), matrix @ y)


def test_timm_names_adapt_and_refusals() -> None:
    names = timm.list_models("xcit_*")
    assert names
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert next(f for f in backbones.FAMILIES if f.name == "xcit").refusal(model) is None, name
    pooled = make("token")
    pooled.global_pool = ""
    with pytest.raises(TypeError, match="global_pool='' has no label readout; use 'token' or 'avg'"):
        backbones.adapt(pooled, TLAlign())
    assert type(backbones.adapt(pooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    no_cls = Xcit(img_size=32, patch_size=8, num_classes=C, embed_dim=32, depth=1, num_heads=2, cls_attn_layers=0)
    with pytest.raises(TypeError, match=r"without class-attention layers \(cls_attn_layers=0\).*use global_pool='avg'"):
        backbones.adapt(no_cls, TLAlign())
    strided = make("token")
    strided.blocks[1].local_mp.conv2.stride = (2, 2)
    with pytest.raises(TypeError, match="block 1's LPI conv2 must be a stride-1 depthwise convolution"):
        backbones.adapt(strided, TLAlign())
