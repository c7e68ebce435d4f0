"""Shared checks of the Swin, PVT v2, CaiT, MLP-Mixer and ConvNeXt adapters (used by their test files).

Each family's file builds tiny timm models and calls these: function preservation
against the bare model (logits and parameter gradients, train mode, stochastic
depth on, same seed), fast path = explicit dense reference, and the identity case.
"""

from __future__ import annotations

import copy

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.testing import assert_close

from mixlabels import backbones
from mixlabels.backbones._count import meta_torchvision_model
from mixlabels import NoAlign, TLAlign, TokenLabeling, TokenLabelMap, TransMix
from mixlabels._align import LabelTracker, Scheme, TokenLayout
from mixlabels._rules import Rules

B, IMG, C = 4, 32, 10
SCHEMES: dict[str, Any] = {
    "none": NoAlign(),
    "transmix": TransMix(),
    "tl_align": TLAlign(),
    "tl_last": TLAlign(layers=(-1,)),
    "tl_first": TLAlign(layers=(0,)),
    "tl_no_norm": TLAlign(normalize=False),
    "tl_official": TLAlign(drop_path="official"),  # the official code's drop-path rule
    "tokens": TokenLabeling(beta=0.5),
    "tokens_aligned": TokenLabeling(beta=0.5, aligned=True),
}
POOLED = [s for s in SCHEMES if s != "transmix"]  # no class token: TransMix refuses


class WrappedScheme:
    """``scheme`` with every tracker it starts passed through ``wrap`` (a test's logging or checking tracker); its
    rules and token-logit need delegated (schemes are a protocol: rules, start, token logits)."""

    def __init__(self, scheme: Scheme, wrap: Callable[[LabelTracker], Any]) -> None:
        self._scheme, self._wrap = scheme, wrap
        self.needs_token_logits = scheme.needs_token_logits

    def rules(self, label_map: TokenLabelMap, layout: TokenLayout) -> Rules:
        return self._scheme.rules(label_map, layout)

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return self._wrap(self._scheme.start(label_map, layout))  # type: ignore[no-any-return]


def cutmix_batch(seed: int = 1, token_space: bool = False) -> tuple[torch.Tensor, TokenLabelMap]:
    """Images and a pixel-resolution CutMix map whose boxes cut through every patch grid."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(B, 3, IMG, IMG, generator=g)
    mask = torch.ones(B, IMG, IMG)
    for i in range(B):
        y0, x0 = torch.randint(0, IMG - 13, (2,), generator=g).tolist()
        mask[i, y0 : y0 + 13, x0 : x0 + 17] = 0.0
    labels = torch.randint(0, C, (B,), generator=g)
    lm = TokenLabelMap.from_mask(mask, torch.arange(B).roll(1), labels, num_classes=C, label_smoothing=0.1, token_space=token_space)
    return (images if token_space else lm.mix_pixels(images)), lm


def sharpen(model: nn.Module, factor: float = 8.0) -> nn.Module:
    """Scale every query and key projection: random-init attention is near uniform, so
    alignment would hardly move the targets and a parity test could hardly fail."""
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "qkv") and isinstance(mod.qkv, nn.Linear):
                mod.qkv.weight[: 2 * mod.qkv.out_features // 3] *= factor
            for name in ("q", "k"):
                if isinstance(getattr(mod, name, None), nn.Linear):
                    getattr(mod, name).weight.mul_(factor)
            if isinstance(getattr(mod, "kv", None), nn.Linear):
                mod.kv.weight[: mod.kv.out_features // 2] *= factor
    return model


def set_fused(model: nn.Module, fused: bool) -> nn.Module:
    for mod in model.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = fused
    return model


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_preservation(model: nn.Module, scheme: Any) -> None:
    """Logits and parameter gradients of the adapted model equal the bare timm model's."""
    model.train()
    images, lm = cutmix_batch()
    torch.manual_seed(7)
    expected = model(images)
    expected.sum().backward()
    expected_grads = grads(model)
    model.zero_grad(set_to_none=True)
    adapted = backbones.adapt(model, scheme)
    assert adapted.model is model
    assert list(adapted.state_dict()) == list(model.state_dict())  # a plain timm state dict
    torch.manual_seed(7)
    out = adapted(images, lm)
    out.output.sum().backward()
    assert_close(out.output, expected, rtol=1e-5, atol=1e-6)
    got = grads(model)
    model.zero_grad(set_to_none=True)
    assert got.keys() == expected_grads.keys()
    for name in got:
        # atol scaled by the tensor's largest entry: fp32 rounding of a sum that reaches 20 is ~2e-6, and
        # the fused attention backward sums in another order than plain SDPA's (CPU kernels vary by CPU)
        scale = max(1.0, float(expected_grads[name].abs().max()))
        assert_close(got[name], expected_grads[name], rtol=1e-4, atol=1e-6 * scale, msg=name)
    torch.manual_seed(5)
    plain = model(images)
    torch.manual_seed(5)
    assert_close(adapted(images), plain, rtol=0, atol=0)  # without labels: the model's own forward


def _fast_and_reference(fast: nn.Module, reference: nn.Module, scheme_name: str, token_space: bool = False) -> tuple[Any, Any, TokenLabelMap]:
    """The fast path's output on ``fast`` and the reference's on ``reference`` (one model, or copies), one CutMix
    batch in training mode, drop path drawing alike; their logits and targets agree to 1e-5."""
    fast.train()
    reference.train()
    images, lm = cutmix_batch(token_space=token_space)
    torch.manual_seed(11)
    a = backbones.adapt(fast, SCHEMES[scheme_name])(images, lm)
    torch.manual_seed(11)
    b = backbones.adapt(reference, SCHEMES[scheme_name], reference=True)(images, lm)
    assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert_close(a.target, b.target, rtol=1e-5, atol=1e-5)
    return a, b, lm


def check_parity(model: nn.Module, scheme_name: str, token_space: bool = False, must_move: bool = True) -> None:
    """Fast path (events, compact labels) = reference (explicit matrices, dense labels) to 1e-5.

    ``must_move``: alignment must move the targets (a parity test on unmoved targets could hardly fail).
    """
    a, b, lm = _fast_and_reference(model, model, scheme_name, token_space)
    assert_close(a.target.sum(-1), torch.ones(B))
    assert not a.target.requires_grad and (a.target >= 0).all()
    if a.token_target is not None or b.token_target is not None:
        assert a.token_target is not None and b.token_target is not None and a.token_logits is not None
        assert_close(a.token_target, b.token_target, rtol=1e-5, atol=1e-5)
        assert_close(a.token_target.sum(-1), torch.ones(a.token_target.shape[:2]))
        assert b.token_logits is not None and a.token_logits.shape == a.token_target.shape
        assert_close(a.token_logits, b.token_logits, rtol=1e-5, atol=1e-5)
    assert_close(a.loss(), b.loss(), rtol=1e-5, atol=1e-5)
    if must_move and scheme_name in ("tl_align", "tl_no_norm", "tokens_aligned", "transmix"):
        assert (a.target - lm.image_targets()).abs().max() > 1e-3, "alignment did not move the targets"
    if scheme_name in ("none", "tokens"):
        assert_close(a.target, lm.image_targets())


def scatter_fold_scales(model: nn.Module, seed: int = 0) -> None:
    """Every batch norm's running variance and weight drawn (variance in [0.5, 1.5)), so the scales a reparameterised
    kernel folds in differ per channel and from 1 (at init they are all 1, which would hide a wrong fold)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g))


def check_parity_moving_statistics(model: nn.Module, scheme_name: str = "tl_align", momentum: float = 0.5) -> None:
    """``check_parity``'s comparison where the training forward moves the batch norms' running statistics that a
    fused kernel reads: the fast path and the reference each on its own copy, from the same statistics. Both must
    read a kernel's statistics at the same point of the forward (before or after its block's norms update)."""
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.momentum = momentum
    fast = copy.deepcopy(model)
    _fast_and_reference(fast, copy.deepcopy(model), scheme_name)
    moved = [n for (n, x), (_, y) in zip(model.named_buffers(), fast.named_buffers()) if "running_var" in n and not torch.equal(x, y)]
    assert moved, "the forward moved no running statistics: this check could not fail"


def check_torchvision_builders(family_name: str) -> None:
    """Every builder a family declares is a torchvision classification model that (built on the meta device,
    no weights) its refusal accepts."""
    import torchvision

    family = next(f for f in backbones.FAMILIES if f.name == family_name)
    classification = set(torchvision.models.list_models(module=torchvision.models))
    assert family.torchvision_builders
    for name in family.torchvision_builders:
        assert name in classification, name
        model = meta_torchvision_model(name)
        assert next(model.parameters()).is_meta, name
        assert family.refusal(model) is None, name


def check_unmixed_is_one_hot(model: nn.Module, schemes: list[str]) -> None:
    """An unmixed batch: every scheme's target is the sample's own (smoothed) one-hot label."""
    g = torch.Generator().manual_seed(3)
    images, labels = torch.randn(B, 3, IMG, IMG, generator=g), torch.randint(0, C, (B,), generator=g)
    lm = TokenLabelMap.unmixed(labels, C, (IMG, IMG), label_smoothing=0.1)
    for name in schemes:
        out = backbones.adapt(model, SCHEMES[name])(images, lm)
        assert_close(out.target, lm.image_targets(), msg=name)
        if out.token_target is not None:
            assert_close(out.token_target, lm.image_targets()[:, None].expand_as(out.token_target), msg=name)
