"""``torchvision_mixup_cutmix``: torchvision's ``get_mixup_cutmix`` (references/classification), returning our mixers.

torchvision's classification reference builds ``RandomChoice([MixUp, CutMix])`` from its
``--mixup-alpha``/``--cutmix-alpha`` flags and calls it in the ``collate_fn`` on
``default_collate(batch)``. Imported as ``get_mixup_cutmix``, this function is called
the same way and its mixer too (``mixer(images, labels)``), but the batch comes out as
``(images, label_map)``. The laws are torchvision's: ``lam ~ Beta(alpha, alpha)`` once
per batch, sample ``i`` mixed with ``i - 1`` (``pairing="roll"``, torchvision's
``batch.roll(1, 0)``), CutMix's box centred uniformly with sides ``sqrt(1 - lam)`` of the
image's, clipped, and ``lam`` corrected to the box's area; no label smoothing (the
script's criterion smooths), one kind per batch, chosen uniformly.
"""

from __future__ import annotations

from typing import Any

from mixlabels.strategies._base import Mixer
from mixlabels.strategies._cutmix import CutMix
from mixlabels.strategies._mixup import MixUp
from mixlabels.strategies._switch import Switch

__all__ = ["torchvision_mixup_cutmix"]


def torchvision_mixup_cutmix(*, mixup_alpha: float, cutmix_alpha: float, num_classes: int, use_v2: bool = False) -> Mixer[Any]:
    """The mixer torchvision's ``get_mixup_cutmix`` describes, with its keyword arguments.

    Args:
        mixup_alpha: MixUp's Beta concentration; MixUp is active if > 0 (``--mixup-alpha``).
        cutmix_alpha: CutMix's Beta concentration; CutMix is active if > 0 (``--cutmix-alpha``).
        num_classes: ``c``.
        use_v2: torchvision's choice between its v1 (``transforms.py``) and v2 MixUp/CutMix, which
            draw from the same laws; accepted and ignored.

    Returns:
        ``Switch([MixUp, CutMix])`` (uniform, as ``RandomChoice``) when both are active, else the
        active one. With neither active torchvision returns ``None`` and collates the plain
        batch; this returns a ``MixUp`` with ``mixup_enabled = False``, which passes the
        images unchanged with the identity map, so a training step written for label maps
        serves runs without mixing (its targets are the one-hot rows of the labels).

    Example:
        >>> import torch
        >>> mixer = torchvision_mixup_cutmix(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=10)
        >>> type(mixer).__name__, mixer.probs
        ('Switch', (0.5, 0.5))
        >>> off = torchvision_mixup_cutmix(mixup_alpha=0.0, cutmix_alpha=0.0, num_classes=10)
        >>> images, lm = off(torch.rand(2, 3, 8, 8), torch.tensor([1, 2]))
        >>> lm.num_sources, lm.image_targets()[0, 1].item()
        (1, 1.0)
    """
    if not isinstance(use_v2, bool):
        raise TypeError(f"use_v2 must be a bool (torchvision's --use-v2 flag), got {type(use_v2).__name__}")
    mixers: list[Mixer[Any]] = []
    if mixup_alpha > 0.0:
        mixers.append(MixUp(num_classes, mixup_alpha, pairing="roll"))
    if cutmix_alpha > 0.0:
        mixers.append(CutMix(num_classes, cutmix_alpha, correct_lam=True, pairing="roll"))
    if len(mixers) == 2:
        return Switch(mixers)
    if mixers:
        return mixers[0]
    off = MixUp(num_classes, pairing="roll")
    off.mixup_enabled = False
    return off
