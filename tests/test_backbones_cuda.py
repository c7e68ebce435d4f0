"""Every aligning family on a GPU: the CUDA route of the label paths (fused attention, window products, label
convs, pixel-window stems) gives the CPU's targets, the dense reference agrees on the GPU, and a bf16 autocast
training step keeps fp32 targets that sum to 1. Skipped without CUDA (CI has none; the device checks run it)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_backbones_common import B, SCHEMES, cutmix_batch, sharpen
from timm.models.mlp_mixer import SpatialGatingUnit
from torch import nn
from torch.testing import assert_close

from mixlabels import backbones

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

ALIGNING = [f for f in backbones.FAMILIES if f.name != "any"]
CHECKED = ("tl_align", "tokens_aligned")


@pytest.fixture(autouse=True)
def exact_matmuls() -> Any:
    """TF32 rounds matmul inputs to 10 mantissa bits: the CPU comparison is of the label path, not of TF32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _model(family: backbones.Family) -> nn.Module:
    """The family's tiny model, sharpened: random-init attention is near uniform and gMLP's gating starts as the
    identity (W ~ 1e-6, b = 1), so alignment would hardly move the targets; a trained scale makes it move them."""
    model = sharpen(family.example())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, SpatialGatingUnit):
                mod.proj.weight.normal_(0.0, 0.5)
                mod.proj.bias.normal_(0.0, 0.5)
    return model


def _targets(out: Any) -> list[torch.Tensor]:
    return [out.target] + ([] if out.token_target is None else [out.token_target])


def _frozen_statistics(model: nn.Module) -> nn.Module:
    """Momentum 0: a train-mode forward leaves the running statistics as they are. They would move with every
    forward, and eval-mode logits and the labels of reparameterised kernels (FastViT) read them."""
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.momentum = 0.0
    return model


def check_family_on(family: backbones.Family, device: str) -> None:
    """Eval mode (no drop-path draw, which differs between devices): fast path on ``device`` == fast path on the
    CPU; train mode on ``device``, one seed: fast path == float64 reference (stochastic depth drawn alike), on a
    copy of its own with frozen statistics."""
    cpu_model = _model(family).eval()
    model = copy.deepcopy(cpu_model).to(device)
    train_model = _frozen_statistics(copy.deepcopy(model)).train()
    images, lm = cutmix_batch()
    dev_images, dev_lm = images.to(device), lm.to(device)
    for name in CHECKED:
        scheme = SCHEMES[name]
        cpu = backbones.adapt(cpu_model, scheme)(images, lm)
        out = backbones.adapt(model, scheme)(dev_images, dev_lm)
        assert out.target.device.type == device and out.target.dtype == torch.float32
        assert_close(out.logits.cpu(), cpu.logits, rtol=1e-4, atol=1e-4, msg=f"{family.name} {name} logits")
        for got, want in zip(_targets(out), _targets(cpu), strict=True):
            assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5, msg=f"{family.name} {name}")
        torch.manual_seed(11)
        fast = backbones.adapt(train_model, scheme)(dev_images, dev_lm)
        torch.manual_seed(11)
        ref = backbones.adapt(train_model, scheme, reference=True)(dev_images, dev_lm)
        for got, want in zip(_targets(fast), _targets(ref), strict=True):
            assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5, msg=f"{family.name} {name} reference")
    moved = (cpu.target - lm.image_targets()).abs().max()
    assert moved > 1e-4, f"{family.name}: alignment did not move the targets, so the parity above proves little"


@pytest.mark.parametrize("family", ALIGNING, ids=lambda f: f.name)
def test_cuda_targets_equal_the_cpus_and_the_reference(family: backbones.Family) -> None:
    check_family_on(family, "cuda")


@pytest.mark.parametrize("family", ALIGNING, ids=lambda f: f.name)
def test_cuda_bf16_training_step(family: backbones.Family) -> None:
    """Under bf16 autocast the labels stay fp32 at every event (rows sum to 1, close to the fp32 targets), the loss
    trains: ``test_backbones_bf16``'s check, on the GPU."""
    from test_backbones_bf16 import check_bf16_step

    check_bf16_step(family, "cuda")


def test_cuda_hand_built_map_is_checked_once_with_no_sync_per_step() -> None:
    """A hand-built map on the GPU is checked at the adapter's first call (one host read), then never again: the
    check and with_token_targets cause no device sync per step. A mixer's map is never checked."""
    import dataclasses

    from mixlabels.backbones._timm_face import check_label_map

    family = next(f for f in ALIGNING if f.name == "vit")
    images, lm = cutmix_batch()
    images, lm = images.cuda(), lm.to("cuda")
    hand = dataclasses.replace(lm, validated=False)  # as if built by hand
    bad = dataclasses.replace(hand, mask=type(hand.mask)(torch.full_like(hand.mask.dense(), 0.7)))  # summing to 1.4
    with pytest.raises(ValueError, match="label map passed to AdaptedViT is invalid: .*sum to 1"):
        backbones.adapt(family.example().cuda(), SCHEMES["tl_align"])(images, bad)
    adapted = backbones.adapt(family.example().cuda(), SCHEMES["tl_align"])
    adapted(images, hand)  # the first call: checked
    torch.cuda.synchronize()
    maps = torch.rand(B, 4, 4, hand.num_classes, device="cuda").softmax(-1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            check_label_map(adapted, images, hand)  # later calls: no host read
            check_label_map(adapted, images, lm)
            hand.with_token_targets(maps)  # checked by the adapter, not here: no sync
        with pytest.raises(RuntimeError):  # the mode does catch a host read: the check itself syncs
            hand.check()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not lm.with_token_targets(maps).validated  # left to the adapter's (first-call) check
