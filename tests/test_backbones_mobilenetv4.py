"""The MobileNetV4 adapter (UniversalInvertedResidual blocks, norm_head on the pooled vector): preservation,
fast = reference, per-position logits through norm_head, every timm name, refusals."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from test_backbones_common import POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from torch import nn
from torch.testing import assert_close

from mixlabels import TLAlign, TokenLabeling, TransMix, backbones
from mixlabels.backbones.families.mobilenetv4 import tiny_mobilenetv4


def make(drop_path_rate: float = 0.0, **kwargs: object) -> nn.Module:
    # EdgeResidual; UIR: ExtraDW (strided dw_mid), ExtraDW, IB, ConvNeXt-like, FFN, strided dw_start; ConvBnAct.
    return tiny_mobilenetv4(drop_path_rate=drop_path_rate, drop_rate=0.2, **kwargs)


def _unfused(model: nn.Module) -> nn.Module:
    for mod in model.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = False
    return model


def test_function_preservation_train_mode() -> None:
    # timm's unfused multi-query attention: the adapter runs the same ops, so gradients match bit for bit
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(_unfused(make(drop_path_rate=0.5)), SCHEMES[scheme])


def test_function_preservation_with_fused_attention() -> None:
    """Fused: the labels ride a widened call over the shared key/value head expanded to every query head, where
    timm broadcasts it in SDPA; the logits are equal, the gradients equal up to float rounding (relative to the
    largest gradient: the biases of batch norms that a following batch norm cancels have exactly-zero gradients
    in exact arithmetic, so their float values are rounding noise either way)."""
    model = make(drop_path_rate=0.5).train()
    images, lm = cutmix_batch()
    torch.manual_seed(7)
    expected = model(images)
    expected.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    out = backbones.adapt(model, TLAlign())(images, lm)
    out.output.sum().backward()
    assert_close(out.output, expected, rtol=1e-5, atol=1e-6)
    scale = max(g.abs().max().item() for g in want.values())
    for n, p in model.named_parameters():
        assert p.grad is not None
        assert_close(p.grad, want[n], rtol=1e-4, atol=1e-5 * scale, msg=n)


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_fast_path_equals_reference_variants() -> None:
    check_parity(make(drop_path_rate=0.4), "tl_align", token_space=True)
    check_parity(make(aa_layer="avg"), "tl_align")  # mobilenetv4_conv_aa_*: a stride-1 conv, then a 2x2 average pool
    check_parity(make(aa_layer="blurpc"), "tl_align")  # mobilenetv4_conv_blur_medium: the blur pool aggregates


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def _head_per_position(m: nn.Module, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """timm's head (conv_head, norm_head with the given statistics, act, classifier) on one position at a time."""
    mm: object = m
    out = []
    for i in range(x.shape[2]):
        for j in range(x.shape[3]):
            t = mm.conv_head(x[:, :, i : i + 1, j : j + 1])  # type: ignore[attr-defined]
            norm = mm.norm_head  # type: ignore[attr-defined]
            t = norm.act(F.batch_norm(t, mean, var, norm.weight, norm.bias, False, 0.0, norm.eps))
            out.append(mm.classifier(t.flatten(1)))  # type: ignore[attr-defined]
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("train", [True, False])
def test_position_logits_use_the_pooled_statistics(train: bool) -> None:
    """Token-labelling schemes read per-position logits: norm_head normalises them with the statistics of timm's
    pooled pass (batch statistics in training, running ones in eval) and updates the running ones once."""
    model, bare = make(), make()
    bare.load_state_dict(model.state_dict())
    model.train(train)
    bare.train(train)
    model.drop_rate = bare.drop_rate = 0.0
    images, lm = cutmix_batch()
    out = backbones.adapt(model, TokenLabeling(beta=0.5))(images, lm)
    expected = bare(images)
    assert_close(out.output, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.norm_head.buffers(), bare.norm_head.buffers()):  # one running-statistics update, as timm's
        assert_close(a, b)
    with torch.no_grad():
        _check_positions(bare, bare.forward_features(images), out.token_logits, train)


def _check_positions(bare: nn.Module, feats: torch.Tensor, token_logits: torch.Tensor | None, train: bool) -> None:
    if train:
        pooled = bare.conv_head(bare.global_pool(feats))
        mean, var = pooled.mean(dim=(0, 2, 3)), pooled.var(dim=(0, 2, 3), unbiased=False)
    else:
        mean, var = bare.norm_head.running_mean, bare.norm_head.running_var
    assert token_logits is not None
    assert_close(token_logits, _head_per_position(bare, feats, mean, var), rtol=1e-5, atol=1e-5)
    # the mean over positions of the normalised features is the pooled vector timm normalised (conv_head is linear)
    pooled_logits = bare.classifier(F.batch_norm(bare.conv_head(bare.global_pool(feats)), mean, var, bare.norm_head.weight,
                                                 bare.norm_head.bias, False, 0.0, bare.norm_head.eps).flatten(1))  # fmt: skip
    if isinstance(bare.norm_head.act, nn.Identity):
        assert_close(token_logits.mean(dim=1), pooled_logits, rtol=1e-5, atol=1e-5)


def test_every_timm_name_adapts_and_refusals() -> None:
    family = next(f for f in backbones.FAMILIES if f.name == "mobilenetv4")
    v3 = next(f for f in backbones.FAMILIES if f.name == "mobilenetv3")
    names = timm.list_models("mobilenetv4*")
    assert len(names) >= 12
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert family.refusal(model) is None, name
        assert v3.refusal(model) == "norm_head (head_norm=True) is MobileNetV4's head: the mobilenetv4 family takes it"
    with torch.device("meta"):
        v3_model = timm.create_model("mobilenetv3_small_100", pretrained=False)
        effnet = timm.create_model("efficientnet_b0", pretrained=False)
    assert family.refusal(v3_model) == "no norm_head: a MobileNetV3-style head (the mobilenetv3 family takes it)"
    assert family.refusal(effnet) == "EfficientNet is not a timm MobileNetV3 class (MobileNetV4)"
    with torch.device("meta"):
        hybrid = timm.create_model("mobilenetv4_hybrid_medium", pretrained=False)
    attention = next(b for s in hybrid.blocks for b in s if type(b).__name__ == "MobileAttention")
    attention.attn.einsum = True
    assert family.refusal(hybrid) is not None and family.refusal(hybrid).endswith("uses the einsum layout; build it without einsum")
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)


def test_a_training_step_with_a_real_timm_model() -> None:
    """A whole timm MobileNetV4 (32 px: grids 16 down to 1): fast path = reference."""
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv4_conv_small_035", pretrained=False, num_classes=10)
    check_parity(model, "tl_align")


def test_mobile_attention_fused_and_explicit_paths_equal_the_reference() -> None:
    """The hybrids' multi-query attention: keys/values on the strided conv's grid (2x2) and on the full grid (4x4)."""
    model = make(drop_path_rate=0.3)
    with torch.no_grad():  # sharpen the queries and keys: near-uniform attention would hardly move the labels
        for mod in model.modules():
            if type(mod).__name__ == "MultiQueryAttention2d":
                mod.query.proj.weight.mul_(6.0)
                mod.key.proj.weight.mul_(6.0)
    check_parity(model, "tl_align")
    for mod in model.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = False
    check_parity(model, "tl_align")
    check_preservation(model, SCHEMES["tl_align"])
