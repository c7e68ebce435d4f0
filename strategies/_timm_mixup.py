"""``timm_mixup``: timm's ``Mixup`` arguments and defaults, returning this library's mixers.

``timm.data.Mixup(**mixup_args)`` in a training script becomes
``timm_mixup(**mixup_args)``; the result is called the same way, ``mixer(images,
labels)``, and returns ``(images, label_map)`` instead of ``(images, targets)``.
Setting ``mixer.mixup_enabled = False`` (timm's ``--mixup-off-epoch``) stops the
mixing: the images pass through and the map is the identity.

What timm's arguments build (``a`` = ``mixup_alpha``, ``c`` = ``cutmix_alpha``,
active when > 0; ``cutmix_minmax`` makes CutMix active with ``c = 1``, as in timm):

- only ``a``: ``MixUp(num_classes, a, ...)``
- only ``c``: ``CutMix(num_classes, c, minmax, correct_lam, ...)``
- both, ``mode="batch"``: ``Switch([MixUp, CutMix], probs=[1 - switch_prob, switch_prob])``
- both, ``mode="pair"``/``"elem"``: ``ElemSwitch`` (the kind chosen per pair or sample)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mixlabels.strategies._base import Mixer
from mixlabels.strategies._cutmix import CutMix
from mixlabels.strategies._elem_switch import ElemSwitch
from mixlabels.strategies._mixup import MixUp
from mixlabels.strategies._sampling import MODES, Mode, check_prob
from mixlabels.strategies._switch import Switch

__all__ = ["timm_mixup"]


def timm_mixup(
    mixup_alpha: float = 1.0,
    cutmix_alpha: float = 0.0,
    cutmix_minmax: Sequence[float] | None = None,
    prob: float = 1.0,
    switch_prob: float = 0.5,
    mode: str = "batch",
    correct_lam: bool = True,
    label_smoothing: float = 0.1,
    num_classes: int = 1000,
    multi_label: bool = False,
    *,
    generator: torch.Generator | None = None,
) -> Mixer[Any]:
    """The mixer timm's ``Mixup`` with the same arguments describes (same defaults, same draws' laws).

    Args:
        mixup_alpha: MixUp's Beta concentration; MixUp is active if > 0.
        cutmix_alpha: CutMix's Beta concentration; CutMix is active if > 0.
        cutmix_minmax: ``(min, max)`` box side ratios; makes CutMix active (and its alpha 1, as timm).
        prob: probability of mixing per batch, pair or sample.
        switch_prob: probability of CutMix when both kinds are active.
        mode: ``"batch"``, ``"pair"`` or ``"elem"``: which samples share a draw.
        correct_lam: a box's lambda is its clipped area.
        label_smoothing: timm's default 0.1 (this library's mixers default to 0).
        num_classes: timm's default 1000.
        multi_label: timm 1.0.31's dense multi-label targets; only ``False`` is supported.
        generator: source of randomness (``None``: torch's global RNG; in DataLoader workers use
            ``CollateMixer`` or ``timm_collate_mixup``).

    Returns:
        ``MixUp``, ``CutMix``, ``Switch`` or ``ElemSwitch`` (see the module docstring); each has a
        working ``mixup_enabled``.

    Raises:
        ValueError: no kind is active, timm's ``mode="half"`` (its collate-only variant), or ``multi_label``.

    Example:
        >>> mixer = timm_mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=10)
        >>> type(mixer).__name__, mixer.probs
        ('Switch', (0.5, 0.5))
        >>> mixer.mixup_enabled = False  # timm's --mixup-off-epoch
        >>> images, lm = mixer(torch.rand(2, 3, 8, 8), torch.tensor([1, 2]))
        >>> lm.num_sources, round(lm.image_targets()[0, 1].item(), 4)
        (1, 0.91)
    """
    if multi_label:
        raise ValueError(
            "multi_label=True (timm's dense multi-label targets, smoothed towards 0.5) is not supported: the label "
            "map's targets are class distributions. Train single-label targets, or keep timm's Mixup for multi-label"
        )
    if mode not in MODES:
        extra = " timm's 'half' mode (mixing half the batch while collating) is not supported;" if "half" in mode else ""
        raise ValueError(f"mode must be one of {MODES} (one draw per batch, per pair, per element), got {mode!r};{extra} use 'elem'")
    m: Mode = mode  # type: ignore[assignment]  # checked against MODES above
    check_prob(switch_prob, "switch_prob", "the probability of CutMix when both MixUp and CutMix are active")
    minmax: tuple[float, float] | None = None
    if cutmix_minmax is not None:
        if len(cutmix_minmax) != 2:
            raise ValueError(f"cutmix_minmax must be (min, max) side ratios, got {cutmix_minmax}")
        minmax = (float(cutmix_minmax[0]), float(cutmix_minmax[1]))
        cutmix_alpha = 1.0  # timm forces it: with minmax the box ignores lambda
    use_mixup, use_cutmix = mixup_alpha > 0.0, cutmix_alpha > 0.0
    common: dict[str, Any] = dict(label_smoothing=label_smoothing, prob=prob, mode=m)
    if use_mixup and use_cutmix:
        if m == "batch":
            return Switch(
                [MixUp(num_classes, mixup_alpha, **common), CutMix(num_classes, cutmix_alpha, minmax, correct_lam, **common)],
                probs=[1.0 - switch_prob, switch_prob],
                generator=generator,
            )
        return ElemSwitch(
            num_classes, mixup_alpha, cutmix_alpha, switch_prob, minmax, correct_lam, generator=generator, **common
        )
    if use_mixup:
        return MixUp(num_classes, mixup_alpha, generator=generator, **common)
    if use_cutmix:
        return CutMix(num_classes, cutmix_alpha, minmax, correct_lam, generator=generator, **common)
    raise ValueError(
        "no mixing is active: mixup_alpha and cutmix_alpha are 0 and cutmix_minmax is None. Set mixup_alpha > 0 "
        "(--mixup), cutmix_alpha > 0 (--cutmix) or cutmix_minmax (--cutmix-minmax); timm's train.py builds no "
        "mixer in that case"
    )
