"""Switch: draw one of several mixers per batch (timm's ``switch_prob`` between MixUp and CutMix)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from mixlabels import TokenLabelMap
from mixlabels.strategies._base import Mixer, check_generator
from mixlabels.strategies._host_draws import host_rng

__all__ = ["Switch", "SwitchParams"]


@dataclass(frozen=True, eq=False, kw_only=True)
class SwitchParams:
    """Which mixer a batch drew, and that mixer's params.

    Attributes:
        choice: index of the mixer in ``Switch.mixers``.
        params: the chosen mixer's params.
    """

    choice: int
    params: Any

    def to(self, device: torch.device | str) -> SwitchParams:
        """The same choice with the chosen mixer's params on ``device`` (as ``MixParams.to``)."""
        return SwitchParams(choice=self.choice, params=self.params.to(device))


class Switch(Mixer[SwitchParams]):
    """Draw one mixer per batch with the given probabilities, then mix with it.

    timm's ``Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5)`` is
    ``Switch([MixUp(c, 0.8), CutMix(c, 1.0)], probs=[0.5, 0.5])``. The choice is per
    batch (each child keeps its own ``mode`` and ``prob``); timm's per-sample switching
    in ``pair``/``elem`` mode is ``ElemSwitch``, and ``timm_mixup`` picks the right one.

    Args:
        mixers: two or more mixers with the same ``num_classes``.
        probs: probability of each mixer (normalised); default uniform.
        generator: default source of randomness for the choice and the chosen mixer.

    Example:
        >>> from mixlabels.strategies import CutMix, MixUp
        >>> switch = Switch([MixUp(10), CutMix(10)], probs=[0.5, 0.5], generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = switch(torch.rand(4, 3, 8, 8), torch.tensor([1, 2, 3, 4]))
        >>> switch.last_params.choice in (0, 1), lm.image_targets().shape
        (True, torch.Size([4, 10]))
    """

    def __init__(
        self,
        mixers: Sequence[Mixer[Any]],
        probs: Sequence[float] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if len(mixers) < 1:
            raise ValueError("Switch needs at least one mixer")
        wrong = [type(m).__name__ for m in mixers if not isinstance(m, Mixer)]
        if wrong:
            raise TypeError(f"Switch takes mixers (MixUp(c), CutMix(c), ...), got {wrong}; build them first")
        classes = {m.num_classes for m in mixers}
        if len(classes) != 1:
            raise ValueError(f"all mixers of a Switch must have the same num_classes, got {sorted(classes)}")
        weights = [1.0] * len(mixers) if probs is None else [float(p) for p in probs]
        if len(weights) != len(mixers) or any(not 0 <= p < float("inf") for p in weights) or sum(weights) <= 0:
            raise ValueError(
                f"probs must hold one non-negative number per mixer ({len(mixers)}) with a positive sum, got {probs}"
            )
        smoothing = {m.label_smoothing for m in mixers}
        # Unmixed batches (mixup_enabled off) take the children's smoothing, when they agree on one.
        super().__init__(mixers[0].num_classes, smoothing.pop() if len(smoothing) == 1 else 0.0, generator)
        self._one_smoothing = not smoothing
        self.mixers = nn.ModuleList(mixers)
        total = sum(weights)
        self.probs = tuple(p / total for p in weights)

    def _child(self, i: int) -> Mixer[Any]:
        child = self.mixers[i]
        assert isinstance(child, Mixer)
        return child

    def draw_device(self, images_device: torch.device, generator: torch.Generator | None = None) -> torch.device | None:
        """The children's draw device when they agree; else the images' device."""
        devices = {self._child(i).draw_device(images_device, generator) for i in range(len(self.mixers))}
        return devices.pop() if len(devices) == 1 else images_device

    def sample(
        self,
        batch_shape: Sequence[int],
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> SwitchParams:
        """Draw the mixer, then its params, from the same generator."""
        check_generator(generator, "Switch.sample")
        u = host_rng(generator).random()  # the choice picks Python code: a Python number, never a device read
        cumulative, choice = 0.0, len(self.probs) - 1
        for i, p in enumerate(self.probs):
            cumulative += p
            if u < cumulative:
                choice = i
                break
        params = self._child(choice).sample(batch_shape, generator=generator, device=device)
        return SwitchParams(choice=choice, params=params)

    def unmixed_map(self, labels: Tensor, image_size: tuple[int, int]) -> TokenLabelMap:
        if not self._one_smoothing:
            raise ValueError(
                "mixup_enabled is off, but this Switch's mixers smooth labels differently, so the unmixed "
                "targets are ambiguous; give every mixer the same label_smoothing"
            )
        return super().unmixed_map(labels, image_size)

    def check_params(self, params: object) -> None:
        if not isinstance(params, SwitchParams) or not 0 <= params.choice < len(self.mixers):
            raise TypeError(
                f"Switch mixes with SwitchParams whose choice indexes its {len(self.mixers)} mixers, got "
                f"{type(params).__name__}; replay params this Switch sampled (switch.sample(images.shape))"
            )
        self._child(params.choice).check_params(params.params)

    def params_batch_size(self, params: SwitchParams) -> tuple[int, tuple[int, int]]:
        return self._child(params.choice).params_batch_size(params.params)

    def place(self, params: SwitchParams, images: Tensor) -> SwitchParams:
        return SwitchParams(choice=params.choice, params=self._child(params.choice).place(params.params, images))

    def apply_images(self, images: Tensor, params: SwitchParams) -> Tensor:
        return self._child(params.choice).apply_images(images, params.params)

    def label_map_from(self, params: SwitchParams, labels: Tensor) -> TokenLabelMap:
        return self._child(params.choice).label_map_from(params.params, labels)

    def __repr__(self) -> str:
        inner = ", ".join(f"{p:.3g}: {m!r}" for p, m in zip(self.probs, self.mixers))
        return f"Switch({inner})"
