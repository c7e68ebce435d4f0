"""The RepViT adapter: preservation, fast = reference, the fused token mixer's kernel, fuse()d models, every timm name,
refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, scatter_fold_scales, SCHEMES, check_parity, check_parity_moving_statistics, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.repvit import RepVggDw, RepVit
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabeling, TransMix, backbones
from mixlabels.backbones._convnet import conv_weights
from mixlabels.backbones.families.repvit import _fused_conv, repvgg_kernel

FAMILY = next(f for f in backbones.FAMILIES if f.name == "repvit")


def make(drop_rate: float = 0.0, **kwargs: Any) -> nn.Module:
    """Stages of 2, 1, 1 blocks (widths 8..24; grids 8, 4, 2 at 32 px), with non-trivial batch-norm statistics: the
    fused kernel reads the running statistics, at init 0 and 1 with unit weights, which would hide a wrong fusion."""
    torch.manual_seed(0)
    model = RepVit(embed_dim=(8, 16, 24), depth=(2, 1, 1), num_classes=C, drop_rate=drop_rate, **kwargs)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
                # a train-mode forward moves the running statistics the fused kernels read; the parity checks run
                # the fast path, then the reference, on one model: with momentum 0 both see the same kernels
                mod.momentum = 0.0
                mod.running_mean.normal_(0.0, 0.5, generator=g)
                mod.running_var.uniform_(0.5, 2.0, generator=g)
                mod.weight.normal_(1.0, 0.5, generator=g)
                mod.bias.normal_(0.0, 0.2, generator=g)
    return model


VARIANTS: dict[str, dict[str, Any]] = {"default": {}, "legacy": {"legacy": True}, "one_head": {"distillation": False}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_function_preservation_train_mode(variant: str) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(drop_rate=0.3, **VARIANTS[variant]), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_rate=0.3), scheme)


@pytest.mark.parametrize("variant", ["legacy", "one_head"])
def test_fast_path_equals_reference_variants(variant: str) -> None:
    check_parity(make(**VARIANTS[variant]), "tl_align")
    check_parity(make(**VARIANTS[variant]), "tokens_aligned")


def test_mixtoken_on_the_stem_grid() -> None:
    check_parity(make(), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


@pytest.mark.parametrize("legacy", [False, True])
def test_repvgg_kernel_is_timms_fuse(legacy: bool) -> None:
    mixers = [mod for mod in make(legacy=legacy).modules() if isinstance(mod, RepVggDw)]
    assert len(mixers) == 6  # four blocks, and the two downsamplings' pre-blocks
    for dw in mixers:
        assert_close(repvgg_kernel(dw), dw.fuse().weight)


@pytest.mark.parametrize("legacy", [False, True])
def test_repvgg_kernels_built_together_equal_each_alone_bit_for_bit(legacy: bool) -> None:
    """``conv_weights`` builds the fused kernels of all alike ``RepVggDw`` in one pass (``KernelBatch``): the same
    elementwise operations on the weights joined along the channels, so the same bits as one by one."""
    model = make(legacy=legacy)
    scatter_fold_scales(model)
    mixers = [mod for mod in model.modules() if isinstance(mod, RepVggDw)]
    convs = [_fused_conv(dw) for dw in mixers]
    assert len({c.batch.key for c in convs if c.batch is not None}) < len(convs)  # some are built together
    for conv, together, dw in zip(convs, conv_weights(convs), mixers, strict=True):
        assert torch.equal(together, repvgg_kernel(dw))
        assert_close(together, dw.fuse().weight)


@pytest.mark.parametrize("legacy", [False, True])
def test_fused_model_has_the_branched_models_labels(legacy: bool) -> None:
    """The rule is the reparameterised conv's: a fuse()d model (one conv per token mixer, one linear head) gives the
    targets and token targets of its branched self; both walks agree on it."""
    model = make(legacy=legacy).eval()
    images, lm = cutmix_batch()
    scheme = TokenLabeling(beta=0.5, aligned=True)
    branched = backbones.adapt(model, scheme)(images, lm)
    model.fuse()
    assert type(model.head) is nn.Linear and not any(isinstance(mod, RepVggDw) for mod in model.modules())
    fused = backbones.adapt(model, scheme)(images, lm)
    assert_close(fused.logits, branched.logits, rtol=1e-4, atol=1e-4)
    assert_close(fused.target, branched.target, rtol=1e-5, atol=1e-5)
    assert fused.token_target is not None and branched.token_target is not None
    assert_close(fused.token_target, branched.token_target, rtol=1e-5, atol=1e-5)
    assert fused.token_logits is not None and branched.token_logits is not None
    assert_close(fused.token_logits, branched.token_logits, rtol=1e-4, atol=1e-4)
    model.train()
    check_parity(model, "tl_align")
    check_preservation(model, SCHEMES["tl_align"])


def test_position_logits_average_to_the_logits() -> None:
    """Token logits: both heads per position with the pooled features' batch statistics, so their mean is the logits;
    in distilled training (timm returns both heads) the loss reads ``head``'s."""
    model = make()
    images, lm = cutmix_batch()
    out = backbones.adapt(model, SCHEMES["tokens_aligned"])(images, lm)
    assert out.token_logits is not None
    assert_close(out.token_logits.mean(dim=1), out.logits, rtol=1e-4, atol=1e-5)
    model.set_distilled_training(True)
    out = backbones.adapt(model, SCHEMES["tokens_aligned"])(images, lm)
    assert isinstance(out.output, tuple) and out.logits is out.output[0]
    assert out.token_logits is not None
    assert_close(out.token_logits.mean(dim=1), out.logits, rtol=1e-4, atol=1e-5)
    check_parity(model, "tokens_aligned")


def test_every_timm_name_adapts_and_refusals() -> None:
    names = timm.list_models(module="repvit")
    assert len(names) == 8
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert FAMILY.refusal(model) is None, name
    with torch.device("meta"):
        unpooled = timm.create_model("repvit_m1", pretrained=False, global_pool="")
        headless = timm.create_model("repvit_m1", pretrained=False, num_classes=0)
        assert FAMILY.refusal(timm.create_model("fastvit_t8", pretrained=False)) == "FastVit is not a timm RepVit"
    assert FAMILY.refusal(unpooled) == "global_pool='' has no label readout; use 'avg'"
    assert FAMILY.refusal(headless) == "the classifier has no head (num_classes=0?); adapt a model with a classifier"
    strided: Any = copy.deepcopy(make())
    strided.stages[0].blocks[0].token_mixer.conv.c.stride = (2, 2)
    assert FAMILY.refusal(strided) == (
        "stage 0 block 0's token mixer is not timm's RepVggDw (stride-1 depthwise odd kxk and 1x1 convs beside the identity)"
    )
    spatial_mlp: Any = copy.deepcopy(make())
    spatial_mlp.stages[1].downsample.ffn.conv1.c = nn.Conv2d(16, 32, 3, padding=1)
    assert FAMILY.refusal(spatial_mlp) == (
        "stage 1's downsampling's FFN mixes positions: only 1x1 stride-1 convs keep the MLP residual's labels"
    )
    circular: Any = copy.deepcopy(make())
    circular.stages[2].blocks[0].token_mixer.conv.c.padding_mode = "circular"
    with pytest.raises(TypeError, match="stage 2 block 0's token mixer module 0 .* only static zero padding has a label rule"):
        backbones.adapt(circular, TLAlign())
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)


def test_fast_path_reads_the_statistics_the_reference_reads() -> None:
    """In training the forward moves the running statistics the fused kernels read (momentum above 0): the fast
    path, which computes label kernels ahead where it can, reads them where the reference does."""
    check_parity_moving_statistics(make(), "tl_align")
