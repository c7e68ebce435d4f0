"""The ResNet adapter and the CNN label rules (``backbones._convnet``): preservation, fast = reference, the rules."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
import torch.nn.functional as F
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.layers import BlurPool2d
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from torch import nn
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TransMix, backbones
from mixlabels.backbones._convnet import Window, apply_path, path_matrix, path_of

# 32 px: stems to 8x8, then 8, 4, 2, 1 positions a side. Between them: both block types, both stems,
# conv and avg-pool (ResNet-D) shortcuts, a 3x3 shortcut, grouped convs, SE, both anti-aliasing pools,
# the conv replacing the stem pool, DropBlock, head dropout.
CONFIGS: dict[str, dict[str, Any]] = {
    "resnet_d": {"block": BasicBlock, "channels": (8, 16, 24, 32), "stem_width": 8, "stem_type": "deep", "avg_down": True},
    "resnext": {"block": Bottleneck, "layers": (2, 1, 1, 1), "channels": (8, 8, 8, 8), "cardinality": 2, "base_width": 8,
                "drop_rate": 0.2},
    "se_aa": {"block": Bottleneck, "channels": (8, 8, 8, 8), "aa_layer": nn.AvgPool2d, "stem_type": "deep", "stem_width": 8,
              "block_args": {"attn_layer": "se"}},
    "blur": {"block": BasicBlock, "channels": (8, 8, 8, 8), "aa_layer": BlurPool2d, "replace_stem_pool": True,
             "down_kernel_size": 3, "drop_block_rate": 0.2},
}  # fmt: skip


def make(config: str, drop_path_rate: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    kwargs = {"layers": (1, 1, 1, 1), **CONFIGS[config]}
    # zero_init_last=False: timm zeroes each branch's last norm, which would make every branch 0 at init
    return ResNet(num_classes=C, drop_path_rate=drop_path_rate, zero_init_last=False, **kwargs)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("resnet_d", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", ["resnext", "se_aa", "blur"])
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")
    check_parity(make(config, drop_path_rate=0.4), "tokens_aligned")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make("resnet_d", drop_path_rate=0.2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("se_aa"), POOLED)


def test_conv_rule() -> None:
    """A full conv mixes by mean over (out, in) of |K| / sum|K|, renormalised over the in-grid taps."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 2, 3, padding=1, bias=False)
    y = torch.rand(2, 12, 4)
    y = y / y.sum(-1, keepdim=True)
    k = conv.weight.detach().abs()
    k = (k / k.sum(dim=(-2, -1), keepdim=True)).mean(dim=(0, 1))  # 3 3
    got, grid = apply_path(path_of([conv]), y, (3, 4))
    assert grid == (3, 4)
    # position (0, 0): taps (1, 1) (itself), (1, 2), (2, 1), (2, 2) of the kernel fall inside the grid
    taps = {0: k[1, 1], 1: k[1, 2], 4: k[2, 1], 5: k[2, 2]}
    expected = sum(w * y[:, j] for j, w in taps.items()) / sum(taps.values())
    assert_close(got[:, 0], expected)
    assert_close(got.sum(-1), torch.ones(2, 12))
    assert_close(path_matrix(path_of([conv]), (3, 4))[0].float() @ y, got)


def test_window_rule_and_shortcuts() -> None:
    """A 1x1 stride-2 conv carries one position of each cell; ResNet-D's ceil-mode 2x2 pool sums the cell."""
    y = torch.rand(1, 15, 2)
    y = y / y.sum(-1, keepdim=True)
    sub, grid = apply_path(path_of([nn.Conv2d(1, 1, 1, stride=2)]), y, (3, 5))
    assert grid == (2, 3)
    assert_close(sub, y[:, [0, 2, 4, 10, 12, 14]])
    pool = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
    summed, grid = apply_path(path_of([pool]), y, (3, 5))
    assert grid == tuple(pool(torch.zeros(1, 1, 3, 5)).shape[-2:]) == (2, 3)
    assert_close(summed[:, 0], y[:, [0, 1, 5, 6]].mean(1))
    assert_close(summed[:, 5], y[:, 14])  # the last cell of an odd grid holds one position
    for w in (Window((3, 3), (2, 2), (1, 1)), Window((3, 3), (2, 2), (1, 1), ceil_mode=True), Window((2, 2), (2, 2), (0, 0), True)):
        for g in ((7, 6), (8, 8), (5, 3)):
            torch_grid = F.max_pool2d(torch.zeros(1, 1, *g), w.kernel, w.stride, w.padding, ceil_mode=w.ceil_mode).shape[-2:]
            assert w.out_grid(g) == tuple(torch_grid), (w, g)


def test_timm_names_adapt_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "resnet")
    for name in ("resnet50", "resnet18d", "resnext50_32x4d", "seresnet50", "ecaresnet50t", "resnetrs50", "resnetblur50",
                 "resnetaa50d", "senet154", "resnet50_gn", "wide_resnet50_2"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("resnet_d"), TransMix())(images, lm)
    maxpooled = ResNet(BasicBlock, (1, 1, 1, 1), num_classes=C, global_pool="max")
    with pytest.raises(TypeError, match="global_pool='max' has no label readout"):
        backbones.adapt(maxpooled, TLAlign())
    assert type(backbones.adapt(maxpooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    gc = ResNet(BasicBlock, (1, 1, 1, 1), num_classes=C, block_args={"attn_layer": "gca"})  # 'gc' is a gate: adapts
    with pytest.raises(TypeError, match=r"block 0's branch module 7 is GlobalContext with fuse_add \('gca'\)"):
        backbones.adapt(gc, TLAlign())
    circular = make("resnet_d")
    circular.layer1[0].conv2.padding_mode = "circular"
    with pytest.raises(TypeError, match="block 0's branch module 5 .* only static zero padding"):
        backbones.adapt(circular, TLAlign())
    with torch.device("meta"):
        resnest = timm.create_model("resnest14d", pretrained=False)
    with pytest.raises(TypeError, match="block 0 is ResNestBottleneck; only timm's BasicBlock and Bottleneck"):
        backbones.AdaptedResNet(resnest, TLAlign())


class _ClassLevel(nn.Module):
    grad_checkpointing = True  # a class-level switch, not set on the instance


class _Property(nn.Module):
    @property
    def grad_checkpointing(self) -> bool:
        return True


@pytest.mark.parametrize("where", ["model", "instance", "class", "property"])
def test_gradient_checkpointing_anywhere_is_refused(where: str) -> None:
    """The check reads each module's own dict (the fast way): a switch set by timm, on any module, at class level or
    as a property is found all the same, and the step refused."""
    model = make("resnet_d")
    if where == "model":
        model.set_grad_checkpointing(True)  # type: ignore[operator]
    elif where == "instance":
        model.layer2[0].grad_checkpointing = True
    else:
        model.layer3[0].extra = _ClassLevel() if where == "class" else _Property()
    images, lm = cutmix_batch()
    with pytest.raises(RuntimeError, match="gradient checkpointing re-runs block forwards"):
        backbones.adapt(model, TLAlign())(images, lm)
    model_off = make("resnet_d")
    model_off.layer3[0].extra = _ClassLevel()
    _ClassLevel.grad_checkpointing = False
    try:
        backbones.adapt(model_off, TLAlign())(images, lm)  # off everywhere: runs
    finally:
        _ClassLevel.grad_checkpointing = True


def test_checkpointing_walk_reads_every_module_as_modules_does() -> None:
    """The check's own walk of the ``_modules`` dicts finds what a plain ``getattr`` over ``modules()`` finds, on
    every family's example model, off and with timm's switch on (where the model has one), on a module shared by
    two parents and on one only a shared module's child holds."""
    from mixlabels.backbones import FAMILIES
    from mixlabels.backbones._common import _checkpointing

    def plain(model: nn.Module) -> bool:
        return any(getattr(mod, "grad_checkpointing", False) for mod in model.modules())

    for family in FAMILIES:
        model = family.example()
        assert _checkpointing(model) is plain(model) is False, family.name
        if hasattr(model, "set_grad_checkpointing"):
            try:
                model.set_grad_checkpointing(True)
            except AssertionError:  # timm's models without checkpointing (CrossViT) refuse the switch
                continue
            assert _checkpointing(model) is plain(model) is True, family.name
    shared = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    model = nn.Sequential(shared, nn.Sequential(shared))  # one module, two parents: visited once
    assert _checkpointing(model) is plain(model) is False
    shared[1][0].grad_checkpointing = True  # deepest, under the shared module
    assert _checkpointing(model) is plain(model) is True
