"""The Res2Net adapter (ResNet with Bottle2neck blocks: split groups, each group's conv reading the previous group's
output summed with its own split, concatenated): preservation, fast = reference, the group rule by hand, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.layers import SEModule
from timm.models.res2net import Bottle2neck
from timm.models.resnet import ResNet
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, backbones
from mixlabels.backbones._convnet import path_matrix, path_of

# 32 px: the stem to 8x8, then 8, 4, 2, 1 positions a side. layer1 has a second (not first) block: its groups chain.
CONFIGS: dict[str, dict[str, Any]] = {
    "res2net": {"block_args": {"scale": 4}},
    "res2next_deep_d": {"cardinality": 2, "stem_type": "deep", "stem_width": 8, "avg_down": True,
                        "block_args": {"scale": 3, "attn_layer": SEModule}},
    "scale8": {"base_width": 48, "block_args": {"scale": 8}, "drop_rate": 0.2},
}  # fmt: skip


def make(config: str, drop_path_rate: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    kwargs = {"layers": (2, 1, 1, 1), "channels": (8, 16, 24, 32), "base_width": 26, **CONFIGS[config]}
    # zero_init_last=False: timm zeroes each branch's last norm, which would make every branch 0 at init
    return ResNet(block=Bottle2neck, num_classes=C, drop_path_rate=drop_path_rate, zero_init_last=False, **kwargs)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("res2net", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["res2next_deep_d", "scale8"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")


def test_fast_path_equals_reference_token_space() -> None:
    check_parity(make("res2net", drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("res2next_deep_d"), POOLED)


def test_group_chain_by_hand() -> None:
    """A block past the first: ``(C0 + C1 (C0 + I)/2 + C2 (C1 (C0 + I)/2 + I)/2 + I) / 4``, each ``C_i`` its conv's
    row-normalised matrix; a first block: ``(C0 + C1 + C2 + pool) / 4``."""
    from mixlabels.backbones.families.res2net import _res2_paths

    model: Any = make("res2net")
    grid, eye = (8, 8), torch.eye(64, dtype=torch.float64)
    later, first = model.layer1[1], model.layer1[0]
    c = [path_matrix(path_of([conv]), grid)[0] for conv in later.convs]
    g0 = c[0]
    g1 = c[1] @ (g0 + eye) / 2
    g2 = c[2] @ (g1 + eye) / 2
    assert_close(path_matrix(_res2_paths(later)[0], grid)[0], (g0 + g1 + g2 + eye) / 4)
    assert first.is_first and not later.is_first
    c = [path_matrix(path_of([conv]), grid)[0] for conv in first.convs]
    pool = path_matrix(path_of([first.pool]), grid)[0]
    assert_close(path_matrix(_res2_paths(first)[0], grid)[0], (c[0] + c[1] + c[2] + pool) / 4)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "res2net")
    resnet = next(f for f in backbones.FAMILIES if f.name == "resnet")
    names = timm.list_models(module="res2net")
    assert len(names) == 9
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
        assert resnet.refusal(model) is not None, name  # one family a model
    with torch.device("meta"):
        plain = timm.create_model("resnet18", pretrained=False)
    assert "is not a Res2Net" in str(family.refusal(plain))
    with pytest.raises(TypeError, match=r"global_pool='max' has no label readout; use 'avg'"):
        backbones.AdaptedRes2Net(ResNet(block=Bottle2neck, layers=(1, 1, 1, 1), channels=(8, 16, 24, 32),
                                        num_classes=C, global_pool="max"), TLAlign())  # fmt: skip
    model: Any = make("res2net")
    model.layer2[0].convs[1] = nn.Conv2d(6, 6, 3, stride=2, padding=1, padding_mode="circular")
    with pytest.raises(TypeError, match=r"block 2's branch module 6 \(Conv2d\) uses padding \(1, 1\) \(circular\)"):
        backbones.adapt(model, TLAlign())
