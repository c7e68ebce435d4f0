"""What the port of torchvision's references/classification/train.py relies on (docs/porting-torchvision.md).

The fetched script is not part of the repository; these tests check the library pieces its five
changed lines use: ``torchvision_mixup_cutmix`` (torchvision's ``get_mixup_cutmix``, replayed
against torchvision's own v2 MixUp/CutMix), ``AlignedOutput.loss(criterion)`` with the script's
``nn.CrossEntropyLoss(label_smoothing=...)``, and an adapted torchvision model under the
script's EMA and checkpoints (plain state dicts).
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, TensorDataset, default_collate
from torchvision.transforms import v2

import mixlabels
from mixlabels import backbones
from mixlabels.strategies import CutMix, MixUp, Switch, torchvision_mixup_cutmix
from mixlabels.strategies._cutmix import BoxParams
from mixlabels.strategies._mixup import MixUpParams

NC, B, HW = 6, 5, 12


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, 3, HW, HW, generator=g), torch.tensor([0, 1, 2, 3, 4])  # distinct labels: lam is readable


def roll_partner() -> torch.Tensor:
    return (torch.arange(B) - 1) % B  # torchvision's batch.roll(1, 0)


def test_mixup_replays_torchvision_v2() -> None:
    images, labels = batch()
    torch.manual_seed(0)
    tv_images, tv_targets = v2.MixUp(alpha=0.7, num_classes=NC)(images, labels)
    lam = tv_targets[0, 0].item()  # sample 0's own weight
    params = MixUpParams(partner=roll_partner(), applied=torch.ones(B, dtype=torch.bool), image_size=(HW, HW),
                         lam=torch.full((B,), lam))
    mixed, lm = MixUp(NC, pairing="roll").mix(images, labels, params)
    torch.testing.assert_close(mixed, tv_images)
    torch.testing.assert_close(lm.image_targets(), tv_targets)
    assert 0.0 < lam < 1.0  # the batch was mixed, so the comparison can fail


def test_cutmix_replays_torchvision_v2() -> None:
    images, labels = batch(1)
    for seed in range(20):  # the first draw whose box is neither empty nor the whole image
        torch.manual_seed(seed)
        tv_images, tv_targets = v2.CutMix(alpha=1.0, num_classes=NC)(images, labels)
        changed = (tv_images != images).any(0).any(0)  # (H, W)
        if 0 < int(changed.sum()) < HW * HW:
            break
    rows, cols = changed.any(1).nonzero().flatten(), changed.any(0).nonzero().flatten()
    box = [int(rows.min()), int(rows.max()) + 1, int(cols.min()), int(cols.max()) + 1]  # (y0, y1, x0, x1)
    assert int(changed.sum()) == (box[1] - box[0]) * (box[3] - box[2])  # one rectangle
    params = BoxParams(partner=roll_partner(), applied=torch.ones(B, dtype=torch.bool), image_size=(HW, HW),
                       boxes=torch.tensor([box] * B), lam=torch.full((B,), 0.5), grid=(HW, HW), shared=True)
    mixed, lm = CutMix(NC, pairing="roll").mix(images, labels, params)
    torch.testing.assert_close(mixed, tv_images)
    torch.testing.assert_close(lm.image_targets(), tv_targets)  # torchvision's lam_adjusted: the box's area


def test_roll_pairing_samples_i_minus_1() -> None:
    mixer = MixUp(NC, pairing="roll", mode="elem", generator=torch.Generator().manual_seed(0))
    params = mixer.sample((B, 3, HW, HW))
    assert params.partner.tolist() == roll_partner().tolist()
    with pytest.raises(ValueError, match="roll.*cycle, not pairs.*'batch' or 'elem'"):
        CutMix(NC, pairing="roll", mode="pair")


def test_get_mixup_cutmix_kinds() -> None:
    both = torchvision_mixup_cutmix(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=NC, use_v2=True)
    assert isinstance(both, Switch) and both.probs == (0.5, 0.5)  # torchvision's RandomChoice
    kinds = [(type(m).__name__, m.sampler.pairing, m.sampler.mode, m.label_smoothing) for m in both.mixers]  # type: ignore[union-attr]
    assert kinds == [("MixUp", "roll", "batch", 0.0), ("CutMix", "roll", "batch", 0.0)]
    assert both.mixers[0].sampler.alpha == 0.2 and both.mixers[1].sampler.correct_lam  # type: ignore[union-attr]
    only = torchvision_mixup_cutmix(mixup_alpha=0.0, cutmix_alpha=0.5, num_classes=NC)
    assert isinstance(only, CutMix) and only.sampler.alpha == 0.5
    with pytest.raises(TypeError, match="use_v2 must be a bool"):
        torchvision_mixup_cutmix(mixup_alpha=0.2, cutmix_alpha=0.0, num_classes=NC, use_v2="yes")  # type: ignore[arg-type]


def test_no_mixing_is_torchvision_loss_on_class_ids() -> None:
    """Both alphas 0: torchvision collates plain ids; the identity map gives the same loss, smoothing included."""
    off = torchvision_mixup_cutmix(mixup_alpha=0.0, cutmix_alpha=0.0, num_classes=NC)
    images, labels = batch()
    same, lm = off(images, labels)
    assert same is images or torch.equal(same, images)
    logits = torch.randn(B, NC)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    out = mixlabels.AlignedOutput(logits, logits, lm.image_targets())
    torch.testing.assert_close(out.loss(criterion), criterion(logits, labels))
    torch.testing.assert_close(out.loss(), mixlabels.soft_target_cross_entropy(logits, lm.image_targets()))


def tiny_resnet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=NC)


def test_port_step_ema_and_checkpoint() -> None:
    """The ported loop in miniature: collate-time mixing, adapter, criterion, EMA, plain checkpoints."""
    model = backbones.adapt(tiny_resnet(), mixlabels.NoAlign())
    bare_twin = tiny_resnet()
    mixer = torchvision_mixup_cutmix(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=NC)
    images, labels = batch()
    loader = DataLoader(TensorDataset(images, labels), batch_size=B, collate_fn=lambda b: mixer(*default_collate(b)))
    ema, bare_ema = AveragedModel(model, use_buffers=True), AveragedModel(bare_twin, use_buffers=True)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    image, target = next(iter(loader))
    assert isinstance(target, mixlabels.TokenLabelMap)
    output = model(image, target)
    loss, logits, soft = output.loss(criterion), output.logits, output.target
    torch.testing.assert_close(loss, criterion(bare_twin(image), soft))  # the script's loss on the map's targets
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)  # type: ignore[operator]
    ema.update_parameters(model)
    bare_ema.load_state_dict(ema.state_dict())  # an EMA of the adapter is an EMA of the bare model
    assert list(model.state_dict()) == list(bare_twin.state_dict())  # no "model." prefix
    bare_twin.load_state_dict(model.state_dict())  # strict: the checkpoint is torchvision's
    model.eval(), bare_twin.eval()
    torch.testing.assert_close(model(images), bare_twin(images))  # evaluate() calls model(image)
    fresh = backbones.adapt(tiny_resnet(), mixlabels.NoAlign())
    fresh.load_state_dict(bare_twin.state_dict())  # --resume of a bare torchvision checkpoint
    assert logits.shape == soft.shape == (B, NC)


def test_torchvision_mixed_targets_refused() -> None:
    """Keeping torchvision's own MixUp/CutMix with the adapter: its float targets are refused by name."""
    model = backbones.adapt(tiny_resnet(), mixlabels.NoAlign())
    images, labels = v2.MixUp(alpha=1.0, num_classes=NC)(*batch())
    with pytest.raises(TypeError, match="float tensor.*torchvision_mixup_cutmix"):
        model(images, labels)
    with pytest.raises(TypeError, match="TokenLabelMap.unmixed"):
        model(images, torch.arange(B))
