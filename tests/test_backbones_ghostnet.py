"""The GhostNet adapter (ghost modules: a primary conv's output and its cheap depthwise conv concatenated; v2's DFC
gate; identity and conv shortcuts): preservation, fast = reference, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.models.ghostnet import GhostNet
from torch import nn

from mixlabels import TLAlign, backbones
from mixlabels.backbones._convnet import Parallel
from mixlabels.backbones.families.ghostnet import TINY_CFGS, _ghost_path


def make(version: str = "v1") -> nn.Module:
    torch.manual_seed(0)
    return GhostNet(cfgs=TINY_CFGS, num_classes=C, width=1.0, drop_rate=0.2, version=version)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_function_preservation_train_mode(version: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(version), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(), scheme)


def test_fast_path_equals_reference_v2_and_token_space() -> None:
    check_parity(make("v2"), "tl_align")
    check_parity(make(), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("v2"), POOLED)


def test_ghost_module_concatenates_by_channels() -> None:
    ghost: Any = make().blocks[0][0].ghost1  # 16 wide: 8 primary channels, 8 cheap
    (concat,) = _ghost_path(ghost)
    assert isinstance(concat, Parallel) and concat.weights == (8.0, 8.0)
    assert concat.branches[0] == () and concat.branches[1] == (ghost.cheap_operation[0],)
    odd: Any = make().blocks[2][1].ghost2  # 24 wide from 12 primary channels, the cheap ones cut to 12
    assert _ghost_path(odd)[0] == Parallel.concat([(), (odd.cheap_operation[0],)], [12, 12])


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "ghostnet")
    names = timm.list_models(module="ghostnet")
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        why = family.refusal(model)
        if name.startswith("ghostnetv3"):  # v3's reparameterisable modules have no rule yet
            assert why is not None and "GhostBottleneckV3" in why, name
        else:
            assert why is None, name
    with torch.device("meta"):
        maxpool = timm.create_model("ghostnet_100", pretrained=False, global_pool="max")
    with pytest.raises(TypeError, match=r"the head \(global_pool='max'\) has no label readout; use 'avg'"):
        backbones.AdaptedGhostNet(maxpool, TLAlign())
    model: Any = make()
    model.blocks[1][0].shortcut[0] = nn.Conv2d(8, 8, 3, stride=2, padding=2, dilation=2, groups=8)
    with pytest.raises(TypeError, match="block 1's shortcut module 0 is a strided dilated convolution"):
        backbones.AdaptedGhostNet(model, TLAlign())
