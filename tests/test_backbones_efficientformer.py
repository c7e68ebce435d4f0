"""The EfficientFormer (v1) adapter: preservation, fast = reference, the attention step, every timm name, refusals."""

from __future__ import annotations

import pytest
import timm
import torch
from test_backbones_common import POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TransMix, backbones
from mixlabels.backbones.families.efficientformer import _attend, tiny_efficientformer


def make(drop: float = 0.0, distilled_training: bool = False) -> nn.Module:
    """The registry's tiny EfficientFormer with large attention biases and sharpened q, k (near-uniform at init:
    alignment would hardly move the labels)."""
    model = tiny_efficientformer(drop_path_rate=drop, drop_rate=0.1)
    model.set_distilled_training(distilled_training)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ == "Attention" and hasattr(mod, "attention_biases"):
                mod.attention_biases.normal_(0.0, 3.0)
                qkv = mod.qkv.weight.view(mod.num_heads, -1, mod.qkv.in_features)  # per head: q, k, v rows
                qkv[:, : 2 * mod.key_dim] *= 4.0
    return model


def test_function_preservation_train_mode() -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(drop=0.5), SCHEMES[scheme])


def test_distilled_training_returns_both_heads_and_aligns_heads_logits() -> None:
    model = make(distilled_training=True).train()
    images, lm = cutmix_batch()
    torch.manual_seed(3)
    expected = model(images)
    torch.manual_seed(3)
    out = backbones.adapt(model, TLAlign())(images, lm)
    assert isinstance(expected, tuple) and isinstance(out.output, tuple)
    for got, want in zip(out.output, expected):
        assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_close(out.logits, expected[0])  # the loss reads head's logits, as timm's distillation tasks do


def test_function_preservation_eval_mode() -> None:
    model = make().eval()
    images, lm = cutmix_batch()
    assert_close(backbones.adapt(model, TLAlign())(images, lm).output, model(images), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop=0.4), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(drop=0.4), "tokens_aligned", token_space=True)
    check_parity(make(distilled_training=True), "tl_align")


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_attention_step_is_timms() -> None:
    """``_attend`` is timm's Attention (bit for bit) and returns its softmax matrix; a bias peaked on offset 0
    makes every token keep its own labels."""
    model = make().eval()
    attn = next(m for m in model.modules() if type(m).__name__ == "Attention" and hasattr(m, "attention_biases"))
    x = torch.randn(2, 16, 32)
    out, a = _attend(attn, x)
    assert_close(out, attn(x), rtol=0, atol=0)
    assert_close(a.sum(-1), torch.ones(2, attn.num_heads, 16))
    with torch.no_grad():
        attn.attention_biases.zero_()
        attn.attention_biases[:, 0] = 60.0  # offset (0, 0): each token on itself
    attn.attention_bias_cache = {}
    _, a = _attend(attn, torch.zeros(2, 16, 32))
    assert_close(a.mean(1), torch.eye(16).expand(2, -1, -1), rtol=1e-4, atol=1e-4)


def test_every_timm_name_adapts_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "efficientformer")
    names = [n for n in timm.list_models("efficientformer*") if "v2" not in n]
    assert names == ["efficientformer_l1", "efficientformer_l3", "efficientformer_l7"]
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
    with torch.device("meta"):
        nopool = timm.create_model("efficientformer_l1", pretrained=False, global_pool="")
        v2 = timm.create_model("efficientformerv2_s0", pretrained=False)
    assert family.refusal(nopool) == "global_pool='' returns per-token outputs, no image logits to align; use 'avg'"
    assert family.refusal(v2) == "EfficientFormerV2 is not a timm EfficientFormer (v1)"
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)
    # timm's own models fix the attention biases at 7x7: other image sizes are refused before any compute
    torch.manual_seed(0)
    l1 = timm.create_model("efficientformer_l1", pretrained=False, num_classes=10)
    with pytest.raises(ValueError, match=r"attention biases are for a 7x7 grid \(49 tokens\) but the last stage has 1"):
        backbones.adapt(l1, TLAlign())(images, lm)
