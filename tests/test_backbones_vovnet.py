"""The VoVNet adapter (one-shot aggregation blocks: a concatenation of the input and a conv chain, residual or not;
full and depthwise convs; ESE and ECA gates): preservation, fast = reference, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.models.vovnet import VovNet
from torch import nn

from mixlabels import TLAlign, backbones
from mixlabels.backbones.families.vovnet import TINY_CFG


def make(drop_path_rate: float = 0.0, **cfg: Any) -> nn.Module:
    torch.manual_seed(0)
    return VovNet(cfg=TINY_CFG | cfg, num_classes=C, drop_path_rate=drop_path_rate, drop_rate=0.2)


VARIANTS: dict[str, dict[str, Any]] = {
    "ese": {},
    "depthwise_eca": {"depthwise": True, "attn": "eca", "stage_conv_chs": [8, 16, 24, 24]},  # reductions where widths change
    "no_residual_stem2": {"residual": False, "stem_stride": 2},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_function_preservation_train_mode(variant: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(drop_path_rate=0.5, **VARIANTS[variant]), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("variant", ["depthwise_eca", "no_residual_stem2"])
def test_fast_path_equals_reference_variants(variant: str) -> None:
    check_parity(make(drop_path_rate=0.4, **VARIANTS[variant]), "tl_align")


def test_fast_path_equals_reference_token_space() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_concatenation_weighs_branches_by_channels() -> None:
    """A block's labels: its input's and each chain prefix's labels weighed by their channel counts."""
    from mixlabels.backbones._convnet import Parallel
    from mixlabels.backbones.families.vovnet import _osa_branch

    blk: Any = make().stages[0].blocks[0]
    concat = _osa_branch(blk)[0]
    assert isinstance(concat, Parallel)
    assert concat.weights == (16.0, 8.0, 8.0)  # the stem's 16 channels, then two 8-channel convs
    assert [len(b) for b in concat.branches] == [0, 1, 2]


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "vovnet")
    names = timm.list_models(module="vovnet")
    assert len(names) == 10
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name  # ese_vovnet39b_evos too: EvoNorms are channel ops
    with torch.device("meta"):
        maxpool = timm.create_model("ese_vovnet19b_dw", pretrained=False, global_pool="max")
    with pytest.raises(TypeError, match=r"the head \(global_pool='max', use_conv=False\) has no label readout; use 'avg'"):
        backbones.AdaptedVovNet(maxpool, TLAlign())
    model: Any = make()
    model.stages[1].blocks[0].conv_mid[0].conv = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")
    with pytest.raises(TypeError, match=r"stage 1 block 0 module 0 \(Conv2d\) uses padding \(1, 1\) \(circular\)"):
        backbones.AdaptedVovNet(model, TLAlign())
