"""The EfficientFormerV2 adapter: preservation, fast = reference, the steps that are timm's, the two-path rule, every
timm name, the image size its attention biases fix, refusals."""

from __future__ import annotations

import pytest
import timm
import torch
from test_backbones_common import POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch import nn
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TokenLabelMap, TransMix, backbones
from mixlabels.backbones.families.efficientformer_v2 import (
    _attention2d,
    _attention2d_labels,
    _attention_downsample,
    _bilinear_matrix,
    _upsample,
    tiny_efficientformer_v2,
)


def make(drop: float = 0.0, distilled_training: bool = False) -> nn.Module:
    """The registry's tiny EfficientFormerV2 with large attention biases and sharper queries and keys (their batch
    norms' scales: a train-mode norm would undo scaled conv weights); near-uniform attention at init otherwise."""
    model = tiny_efficientformer_v2(drop_path_rate=drop, drop_rate=0.1)
    model.set_distilled_training(distilled_training)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ in ("Attention2d", "Attention2dDownsample"):
                mod.attention_biases.normal_(0.0, 3.0)
                mod.k.bn.weight.mul_(3.0)
                (mod.q.bn if type(mod).__name__ == "Attention2d" else mod.q.proj.bn).weight.mul_(3.0)
    return model


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(drop=0.5), SCHEMES[scheme])


def test_function_preservation_eval_and_distilled() -> None:
    images, lm = cutmix_batch()
    model = make().eval()
    assert_close(backbones.adapt(model, TLAlign())(images, lm).output, model(images), rtol=1e-5, atol=1e-6)
    model = make(distilled_training=True).train()
    torch.manual_seed(3)
    expected = model(images)
    torch.manual_seed(3)
    out = backbones.adapt(model, TLAlign())(images, lm)
    assert isinstance(expected, tuple) and isinstance(out.output, tuple)
    for got, want in zip(out.output, expected):
        assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_close(out.logits, expected[0])  # the loss reads head's logits, as timm's distillation tasks do


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop=0.4), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(drop=0.4), "tokens_aligned", token_space=True)
    check_parity(make(distilled_training=True), "tl_align")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_attention_steps_are_timms() -> None:
    """Both attentions step by step are timm's modules bit for bit; the talking heads' weights are no distribution
    (their normalised absolute values are what the labels take)."""
    model = make().eval()
    x = torch.randn(2, 16, 8, 8)
    strided = model.stages[2].blocks[1].token_mixer
    out, a = _attention2d(strided, x)
    assert_close(out, strided(x), rtol=0, atol=0)
    assert a.shape == (2, strided.num_heads, 16, 16) and not torch.allclose(a.sum(-1), torch.ones(()))
    down = model.stages[3].downsample.attn
    out, a = _attention_downsample(down, x)
    assert_close(out, down(x), rtol=0, atol=0)
    assert a.shape == (2, down.num_heads, 16, 64)
    assert_close(a.sum(-1), torch.ones(2, down.num_heads, 16))


def test_two_path_rule_and_upsample() -> None:
    """With identity talking heads, a bias peaked on each token itself and a v_local kernel peaked on its centre,
    both paths keep every token's labels; with the v_local kernel on the centre and the right neighbour, the conv path
    is half of each (the last column, whose right tap is outside the grid, its own) and the sum of the two paths
    three quarters own, one quarter neighbour's. The bilinear label upsample is timm's weights, rows summing to 1."""
    model = make().eval()
    attn = model.stages[3].blocks[1].token_mixer  # 4x4 grid, no stride
    with torch.no_grad():
        for th in (attn.talking_head1, attn.talking_head2):
            th.weight.copy_(torch.eye(attn.num_heads).view(attn.num_heads, attn.num_heads, 1, 1))
            th.bias.zero_()
        attn.attention_biases.zero_()
        attn.attention_biases[:, 0] = 60.0  # offset (0, 0): each token on itself
        attn.v_local.conv.weight.zero_()
        attn.v_local.conv.weight[:, :, 1, 1] = 1.0
    attn.attention_bias_cache = {}
    labels = torch.softmax(torch.randn(2, 16, 3), -1)
    _, a = _attention2d(attn, torch.zeros(2, 32, 4, 4))
    assert_close(_attention2d_labels(attn, a, labels, (4, 4)), labels, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        attn.v_local.conv.weight[:, :, 1, 2] = 1.0  # and the right neighbour
    mixed = _attention2d_labels(attn, a, labels, (4, 4))
    grid = labels.view(2, 4, 4, 3)
    right = torch.cat([grid[:, :, 1:], grid[:, :, -1:]], dim=2).reshape(2, 16, 3)  # the last column: its own
    assert_close(mixed, 0.75 * labels + 0.25 * right, rtol=1e-4, atol=1e-4)
    low = torch.softmax(torch.randn(2, 4, 3), -1)
    up = _upsample(low, (2, 2), 2.0)
    assert_close(up.double(), _bilinear_matrix((2, 2), 2.0) @ low.double(), rtol=1e-6, atol=1e-6)
    assert_close(up.sum(-1), torch.ones(2, 16))


def test_every_timm_name_adapts_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "efficientformer_v2")
    names = timm.list_models(module="efficientformer_v2")
    assert names == ["efficientformerv2_l", "efficientformerv2_s0", "efficientformerv2_s1", "efficientformerv2_s2"]
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        nopool = timm.create_model("efficientformerv2_s0", pretrained=False, global_pool="")
        v1 = timm.create_model("efficientformer_l1", pretrained=False)
    assert family.refusal(nopool) == "global_pool='' returns per-position outputs, no image logits to align; use 'avg'"
    assert family.refusal(v1) == "EfficientFormer is not a timm EfficientFormerV2"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    # timm's own models fix the attention biases for 224 px: other sizes are refused before any compute; NoAlign works
    torch.manual_seed(0)
    s0 = timm.create_model("efficientformerv2_s0", pretrained=False, num_classes=10)
    with pytest.raises(ValueError, match=r"stage 2 are for a 7x7 grid, but 32x32 images give 1x1.*use 224x224 images"):
        backbones.adapt(s0, TLAlign())(images, lm)
    mask = torch.ones(2, 224, 224)
    mask[:, 40:150, 20:90] = 0.0
    lm224 = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([3, 5]), num_classes=10)
    big = lm224.mix_pixels(torch.randn(2, 3, 224, 224))
    s0.eval()
    out = backbones.adapt(s0, TLAlign())(big, lm224)
    assert_close(out.output, s0(big), rtol=1e-5, atol=1e-5)
    assert_close(out.target.sum(-1), torch.ones(2))
    with torch.no_grad():
        assert_close(backbones.adapt(s0, NoAlign())(big), s0(big))
