"""The RepGhostNet adapter (RepGhost modules: a cheap depthwise conv summed with an identity norm, as the one conv it
fuses into; identity and conv shortcuts; SE), with training-time branches and reparameterised: preservation,
fast = reference, the fused kernel equal to timm's, the same targets before and after ``convert_to_deploy``, refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, scatter_fold_scales, SCHEMES, check_parity, check_parity_moving_statistics, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.repghost import RepGhostModule, RepGhostNet
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, backbones
from mixlabels.backbones._convnet import KernelConv, conv_weights
from mixlabels.backbones.families.ghostnet import TINY_CFGS
from mixlabels.backbones.families.repghost import _ghost_path, repghost_kernel

FAMILY = next(f for f in backbones.FAMILIES if f.name == "repghost")


def make(reparam: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = RepGhostNet(cfgs=TINY_CFGS, num_classes=C, width=1.0, drop_rate=0.2, reparam=reparam)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms: the identity branch's weight differs from the cheap conv's
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                # the fused kernels read the running statistics, which a train-mode forward moves; the parity checks
                # run the fast path, then the reference, on one model: with momentum 0 both see the same kernels
                mod.momentum = 0.0
                mod.weight.copy_(torch.rand(mod.weight.shape, generator=g) * 2 - 0.5)
                mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
    return model


def deployed(model: nn.Module) -> nn.Module:
    fused: Any = copy.deepcopy(model)
    fused.convert_to_deploy()
    return fused  # type: ignore[no-any-return]


@pytest.mark.parametrize("reparam", [True, False])
def test_function_preservation_train_mode(reparam: bool) -> None:
    for scheme in ("none", "tokens_aligned"):
        check_preservation(make(reparam), SCHEMES[scheme])
    check_preservation(deployed(make().eval()), SCHEMES["tl_align"])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(reparam=False), "tl_align")
    check_parity(deployed(make().eval()), "tl_align")
    check_parity(make(), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_fused_kernel_is_timms() -> None:
    """The label kernel of a module with branches is the kernel timm's ``switch_to_deploy`` writes."""
    model: Any = make()
    for blk in model.blocks[:-1]:
        for ghost in (blk[0].ghost1, blk[0].ghost2):
            (op,) = _ghost_path(ghost)
            assert isinstance(op, KernelConv)
            with torch.no_grad():
                expected, _ = ghost.get_equivalent_kernel_bias()
            assert_close(repghost_kernel(ghost), expected)
            assert_close(op.weight, expected)


def test_fused_kernels_built_together_equal_each_alone_bit_for_bit() -> None:
    """``conv_weights`` builds the fused kernels of all alike modules in one pass (``KernelBatch``): the same
    elementwise operations on the weights joined along the channels, so the same bits as one by one."""
    model: Any = make()
    scatter_fold_scales(model)
    ghosts = [ghost for blk in model.blocks[:-1] for ghost in (blk[0].ghost1, blk[0].ghost2)]
    convs = [op for ghost in ghosts for op in _ghost_path(ghost) if isinstance(op, KernelConv)]
    assert len(convs) == len(ghosts) and len({c.batch.key for c in convs if c.batch is not None}) < len(convs)
    for together, ghost in zip(conv_weights(convs), ghosts, strict=True):
        assert torch.equal(together, repghost_kernel(ghost))


@pytest.mark.parametrize("scheme", ["tl_align", "tokens_aligned"])
def test_reparameterised_gives_the_same_targets(scheme: str) -> None:
    """Eval mode (the running statistics timm fuses): the branches and the fused conv give the same logits and targets."""
    model = make().eval()
    fused = deployed(model)
    assert all(type(mod.cheap_operation) is nn.Conv2d for mod in fused.modules() if isinstance(mod, RepGhostModule))
    images, lm = cutmix_batch()
    a = backbones.adapt(model, SCHEMES[scheme])(images, lm)
    b = backbones.adapt(fused, SCHEMES[scheme])(images, lm)
    assert type(backbones.adapt(fused, TLAlign())) is backbones.AdaptedRepGhostNet
    assert_close(b.output, a.output, rtol=1e-4, atol=1e-4)
    assert_close(b.target, a.target, rtol=1e-5, atol=1e-6)
    assert (a.target - lm.image_targets()).abs().max() > 1e-3
    if a.token_target is not None:
        assert b.token_target is not None
        assert_close(b.token_target, a.token_target, rtol=1e-5, atol=1e-6)


def test_timm_names_adapt_and_refusals() -> None:
    for name in timm.list_models(module="repghost"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        maxpool = timm.create_model("repghostnet_050", pretrained=False, global_pool="max")
    with pytest.raises(TypeError, match=r"the head \(global_pool='max'\) has no label readout; use 'avg'"):
        backbones.AdaptedRepGhostNet(maxpool, TLAlign())
    model: Any = make()
    model.blocks[1][0].shortcut[0] = nn.Conv2d(8, 8, 3, stride=2, padding=2, dilation=2, groups=8)
    with pytest.raises(TypeError, match="block 1's shortcut module 0 is a strided dilated convolution"):
        backbones.AdaptedRepGhostNet(model, TLAlign())
    model = make()
    model.blocks[0][0].ghost1.fusion_conv[0] = nn.Conv2d(16, 16, 1, groups=16, bias=False)
    with pytest.raises(TypeError, match="block 0's ghost1's fusion branch is not timm's identity and BatchNorm2d"):
        backbones.AdaptedRepGhostNet(model, TLAlign())
    model = make()
    model.blocks[0][0].ghost2.cheap_operation[0] = nn.Conv2d(8, 8, 3, padding=1, bias=False)
    with pytest.raises(TypeError, match="block 0's ghost2's cheap operation is not a stride-1 undilated depthwise"):
        backbones.AdaptedRepGhostNet(model, TLAlign())
    with pytest.raises(TypeError, match="GhostNet is not a timm RepGhostNet"):
        backbones.AdaptedRepGhostNet(timm.models.ghostnet.GhostNet(cfgs=TINY_CFGS, num_classes=C), TLAlign())


def test_fast_path_reads_the_statistics_the_reference_reads() -> None:
    """In training the forward moves the running statistics the fused kernels read (momentum above 0): the fast
    path, which computes label kernels ahead where it can, reads them where the reference does."""
    check_parity_moving_statistics(make(), "tl_align")
