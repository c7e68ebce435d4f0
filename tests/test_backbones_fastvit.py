"""The FastViT adapter: preservation, fast = reference, the reparameterised kernels' rule, every timm name, refusals."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from test_backbones_common import POOLED, scatter_fold_scales, SCHEMES, check_parity, check_parity_moving_statistics, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.models.fastvit import Attention, FastVit, MobileOneBlock, RepMixer
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLayout, TransMix, backbones
from mixlabels.backbones._common import kernel_labels
from mixlabels.backbones._convnet import KernelConv, conv_weights
from mixlabels.backbones.families.fastvit import _label_convs, _repmixer_kernel, fused_kernel, tiny_fastvit


def make(drop: float = 0.0, **kwargs: object) -> nn.Module:
    """The registry's tiny FastViT with sharpened attention and non-trivial batch-norm statistics (the fused
    kernels read the running statistics: at init they are 0 and 1, which would hide a wrong fusion)."""
    model = tiny_fastvit(drop_path_rate=drop, **kwargs)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                # a train-mode forward moves the running statistics the fused kernels read; the parity checks run
                # the fast path, then the reference, on one model: with momentum 0 both see the same kernels
                mod.momentum = 0.0
                mod.running_mean.normal_(0.0, 0.5, generator=g)
                mod.running_var.uniform_(0.5, 2.0, generator=g)
                mod.weight.normal_(1.0, 0.5, generator=g)
            if isinstance(mod, Attention):
                mod.qkv.weight[: 2 * mod.qkv.out_features // 3] *= 6.0
    return model


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(drop=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop=0.4), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(drop=0.4), "tl_align", token_space=True)
    reparam = make().eval()
    images, lm = cutmix_batch()
    branched = backbones.adapt(reparam, TLAlign())(images, lm).target
    timm.utils.model.reparameterize_model(reparam, inplace=True)  # every block one conv, as for inference
    reparam_targets = backbones.adapt(reparam, TLAlign())(images, lm).target
    assert_close(reparam_targets, branched, rtol=1e-5, atol=1e-5)  # the rule is the reparameterised conv's
    check_parity(reparam, "tl_align")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_fused_kernels_are_the_reparameterised_convs() -> None:
    """``fused_kernel`` is the weight timm's reparameterize writes; RepMixer's branch is ``K_mixer - K_norm``."""
    model = make().eval()
    blocks = [m for m in model.modules() if isinstance(m, MobileOneBlock) and m.reparam_conv is None]
    mixers = [m for m in model.modules() if isinstance(m, RepMixer)]
    expected = {id(b): fused_kernel(b).clone() for b in blocks}
    branches = {id(m): _repmixer_kernel(m).clone() for m in mixers}
    for b in blocks:
        b.reparameterize()
        assert_close(b.reparam_conv.weight, expected[id(b)])
    for m in mixers:
        m.reparameterize()  # one conv: identity + s (K_mixer - K_norm); s scales whole channels
        # s is 1e-5 at init, so the branch is 1e-5 of the identity's centre tap in fp32: the folded conv keeps it to
        # about 1e-3 (a trained s is orders larger); the labels of the folded model are the folded conv's
        assert_close(kernel_labels(_repmixer_kernel(m)), kernel_labels(branches[id(m)]), rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("reparameterised", [False, True])
def test_repmixer_kernels_built_together_equal_each_alone_bit_for_bit(reparameterised: bool) -> None:
    """``conv_weights`` builds the kernels of all alike RepMixers in one pass (``KernelBatch``): the same
    elementwise operations on the weights joined along the channels, so the same bits as one by one."""
    torch.manual_seed(0)  # two RepMixer stages of two blocks each, of two widths
    model = FastVit(layers=(2, 2), embed_dims=(16, 32), mlp_ratios=(2.0, 2.0), downsamples=(False, True),
                    token_mixers=("repmixer", "repmixer"), num_classes=10)
    scatter_fold_scales(model)
    mixers = [m for m in model.modules() if isinstance(m, RepMixer)]
    if reparameterised:
        for m in mixers:
            m.reparameterize()
    assert len(mixers) == 4
    tracker = TLAlign().start(cutmix_batch()[1], TokenLayout(grid=(8, 8), num_prefix=0, depth=99, class_token=False))
    ops = _label_convs(model, tracker)
    convs = [ops[m] for m in mixers]
    assert all(isinstance(c, KernelConv) and c.batch is not None for c in convs)
    assert len({c.batch.key for c in convs if isinstance(c, KernelConv) and c.batch is not None}) < len(convs)
    for together, m in zip(conv_weights(convs), mixers, strict=True):
        assert torch.equal(together, _repmixer_kernel(m))


def test_every_timm_name_adapts_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "fastvit")
    names = timm.list_models("fastvit*")
    assert len(names) >= 12
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        forked = timm.create_model("fastvit_t8", pretrained=False)
    forked.fork_feat = True
    assert family.refusal(forked) == "a FastVit built with fork_feat=True returns feature maps, no logits to align"
    odd = copy.deepcopy(make())
    odd.stages[1].blocks[0].norm = nn.GroupNorm(4, 32)
    assert family.refusal(odd) == (
        "stage 1 block 0 is not timm's attention block (a batch or per-position layer norm, then Attention)"
    )
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)


def test_fast_path_reads_the_statistics_the_reference_reads() -> None:
    """In training the forward moves the running statistics the fused kernels read (momentum above 0): the fast
    path, which computes label kernels ahead where it can, reads them where the reference does."""
    check_parity_moving_statistics(make(drop=0.4), "tl_align")
