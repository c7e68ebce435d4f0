"""The ResNeSt adapter (split attention: one grouped conv, a per-channel softmax over the radix as a gate):
preservation, fast = reference, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot
from timm.models.resnest import ResNestBottleneck
from timm.models.resnet import ResNet
from torch import nn

from mixlabels import backbones

# 32 px: stems to 8x8, then 8, 4, 2, 1 positions a side. Between them: radix 2 and 4 (softmax), radix 1 (sigmoid),
# avd pools before or after the split attention, DropBlock, head dropout.
CONFIGS: dict[str, dict[str, Any]] = {
    "radix2_last": {"block_args": {"radix": 2, "avd": True}, "drop_rate": 0.2},
    "radix4_first": {"cardinality": 2, "block_args": {"radix": 4, "avd": True, "avd_first": True}, "drop_block_rate": 0.2},
    "radix1": {"block_args": {"radix": 1, "avd": True, "avd_first": True}},
}


def make(config: str) -> nn.Module:
    torch.manual_seed(0)
    kwargs = {"block": ResNestBottleneck, "layers": (2, 1, 1, 1), "channels": (8, 8, 8, 8), "stem_type": "deep",
              "stem_width": 8, "avg_down": True, "base_width": 64, **CONFIGS[config]}
    # zero_init_last=False: timm zeroes each branch's last norm, which would make every branch 0 at init
    return ResNet(num_classes=C, zero_init_last=False, **kwargs)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("radix2_last"), scheme)


@pytest.mark.parametrize("config", ["radix4_first", "radix1"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config), "tl_align")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("radix2_last"), POOLED)


def test_refusals() -> None:
    families = {f.name: f for f in backbones.FAMILIES}
    assert families["resnest"].refusal(make("radix2_last")) is None
    assert families["resnet"].refusal(make("radix2_last")) is not None
    assert "ResNestBottleneck" in str(families["resnest"].refusal(timm.create_model("resnet18", pretrained=False)))
    torch.manual_seed(0)
    dropped = ResNet(block=ResNestBottleneck, layers=(1, 1, 1, 1), channels=(8, 8, 8, 8), num_classes=C, drop_path_rate=0.1)
    assert "drop_path" in str(families["resnest"].refusal(dropped))


@pytest.mark.parametrize("name", ["resnest14d", "resnest50d_4s2x40d", "resnest50d_1s4x24d"])
def test_timm_names_accepted(name: str) -> None:
    with torch.device("meta"):
        model = timm.create_model(name)
    accepted = [f for f in backbones.FAMILIES[:-1] if f.refusal(model) is None]  # the last: "any", NoAlign only
    assert [f.name for f in accepted] == ["resnest"]
