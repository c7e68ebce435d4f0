"""ElemSwitch: MixUp or CutMix chosen per pair or per sample (timm's ``switch_prob`` in ``pair``/``elem`` mode).

``Switch`` chooses one mixer per batch. timm's ``Mixup(mode="elem")`` with both
kinds active chooses per sample (``"pair"``: per pair): some samples of a batch
are blended, others get a box. One pairing serves both kinds, so a pair shares
its draw whichever kind it took, as in timm.

Shapes: ``b`` batch, ``H W`` image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from einops import rearrange
from torch import Tensor

from mixlabels import TokenLabelMap
from mixlabels.strategies._base import MixParams, Mixer, mix_images, pair_label_map
from mixlabels.strategies._cutmix import BoxParams, BoxSampler, box_inside
from mixlabels.strategies._mixup import MixUpParams, MixUpSampler
from mixlabels.strategies._sampling import Mode, Pairing, check_prob, sample_pairs, sample_uniform

__all__ = ["ElemSwitch", "ElemSwitchParams"]


@dataclass(frozen=True, eq=False, kw_only=True)
class ElemSwitchParams(MixParams):
    """Per-sample kind and both kinds' draws (each sample uses one of them).

    Attributes:
        cut: ``(b,)`` bool, the sample takes a CutMix box (else a MixUp blend).
        mixup: the MixUp draws (``lam``), read where ``cut`` is False.
        cutmix: the CutMix draws (pixel boxes), read where ``cut`` is True; empty boxes elsewhere.
    """

    cut: Tensor
    mixup: MixUpParams
    cutmix: BoxParams

    def source_weight(self) -> Tensor:
        """``(b, H, W)`` fp32: 0 inside a CutMix box, 1 outside it; a MixUp sample's lambda everywhere."""
        boxes = self.cutmix.boxes
        inside = box_inside(boxes, self.cutmix.grid)  # b H W, empty boxes for blended samples
        lam = rearrange(torch.where(self.cut, 1.0, self.mixup.lam.float()), "b -> b 1 1")
        return torch.where(inside, 0.0, lam.expand_as(inside)).float()

    @property
    def lambda_is_mask_mean(self) -> bool:
        return False  # the lambdas are exact per kind (a mean of H*W copies of lambda may round)

    def image_weight(self) -> Tensor:
        return torch.where(self.cut, self.cutmix.image_weight(), self.mixup.lam.float())

    def to(self, device: torch.device | str) -> ElemSwitchParams:
        return ElemSwitchParams(
            partner=self.partner.to(device), applied=self.applied.to(device), image_size=self.image_size,
            cut=self.cut.to(device), mixup=self.mixup.to(device), cutmix=self.cutmix.to(device),
        )  # fmt: skip


class ElemSwitch(Mixer[ElemSwitchParams]):
    """MixUp for some samples, CutMix (pixel boxes) for the others, chosen per pair or per sample.

    timm's ``Mixup(mixup_alpha=a, cutmix_alpha=c, switch_prob=s, mode="elem")`` is
    ``ElemSwitch(num_classes, a, c, s, mode="elem")``: every sample (every pair in
    ``"pair"`` mode) draws whether it takes a box (probability ``switch_prob``), then
    its own lambda from that kind's Beta, then whether it mixes at all (``prob``).

    Args:
        num_classes: ``c``.
        mixup_alpha: Beta concentration of the blends, > 0.
        cutmix_alpha: Beta concentration of the boxes, > 0.
        switch_prob: probability that a sample (pair) takes a box.
        cutmix_minmax: timm's box side ratios; overrides ``cutmix_alpha`` for the box.
        correct_lam: a box's lambda is its clipped area (timm's default).
        label_smoothing: in ``[0, 1)``.
        prob: probability of mixing a sample (pair).
        mode: ``"elem"`` or ``"pair"`` (for one kind per batch use ``Switch``).
        pairing: ``"flip"`` (timm), ``"derangement"`` or ``"roll"`` (torchvision).
        generator: default source of randomness.

    Example:
        >>> mixer = ElemSwitch(10, generator=torch.Generator().manual_seed(0))
        >>> mixed, lm = mixer(torch.rand(4, 3, 8, 8), torch.tensor([1, 2, 3, 4]))
        >>> mixer.last_params.cut.shape, lm.image_targets().shape
        (torch.Size([4]), torch.Size([4, 10]))
    """

    def __init__(
        self,
        num_classes: int,
        mixup_alpha: float = 1.0,
        cutmix_alpha: float = 1.0,
        switch_prob: float = 0.5,
        cutmix_minmax: tuple[float, float] | None = None,
        correct_lam: bool = True,
        label_smoothing: float = 0.0,
        prob: float = 1.0,
        mode: Mode = "elem",
        pairing: Pairing = "flip",
        generator: torch.Generator | None = None,
    ) -> None:
        if mode not in ("elem", "pair"):
            raise ValueError(
                f"ElemSwitch chooses the kind per sample or per pair: mode must be 'elem' or 'pair', got {mode!r}; "
                "for one kind per batch use Switch([MixUp(...), CutMix(...)], probs=[1 - switch_prob, switch_prob])"
            )
        check_prob(switch_prob, "switch_prob", "the probability that a sample or pair takes a CutMix box instead of MixUp")
        super().__init__(num_classes, label_smoothing, generator)
        self.mixup_sampler = MixUpSampler(mixup_alpha, mode, pairing, prob)
        self.cutmix_sampler = BoxSampler(cutmix_alpha, cutmix_minmax, correct_lam, None, False, mode, pairing, prob)
        self.switch_prob = float(switch_prob)
        self.mode: Mode = mode
        self.pairing: Pairing = pairing
        self.prob = float(prob)

    def __repr__(self) -> str:
        return (
            f"ElemSwitch(switch_prob={self.switch_prob}, mixup=({self.mixup_sampler!r}), "
            f"cutmix=({self.cutmix_sampler!r}))"
        )

    def sample(
        self,
        batch_shape: Sequence[int],
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> ElemSwitchParams:
        """Pair the batch once, then draw each group's kind and both kinds' randomness."""
        if len(batch_shape) != 4:
            raise ValueError(f"batch_shape must be (batch, channels, height, width), got {tuple(batch_shape)}")
        b, hh, ww = int(batch_shape[0]), int(batch_shape[2]), int(batch_shape[3])
        self.cutmix_sampler.check_image_size((hh, ww))
        if generator is not None:
            dev = generator.device
        else:
            dev = torch.device(device) if device is not None else torch.device("cpu")
        pairs = sample_pairs(b, self.mode, self.pairing, self.prob, generator, dev)
        cut = (sample_uniform((pairs.num_groups,), generator, dev) < self.switch_prob)[pairs.group]
        mixup = self.mixup_sampler.draw(pairs, (hh, ww), generator, dev)
        cutmix = self.cutmix_sampler.draw(pairs, (hh, ww), generator, dev)
        # A blended sample holds an empty box, so the box mask and the pixels read only real boxes.
        cutmix = BoxParams(
            partner=cutmix.partner, applied=cutmix.applied, image_size=cutmix.image_size,
            boxes=torch.where(cut[:, None], cutmix.boxes, torch.zeros_like(cutmix.boxes)),
            lam=torch.where(cut, cutmix.lam, torch.ones_like(cutmix.lam)),
            grid=cutmix.grid, correct_lam=cutmix.correct_lam,
        )  # fmt: skip
        mixup = MixUpParams(
            partner=mixup.partner, applied=mixup.applied, image_size=mixup.image_size,
            lam=torch.where(cut, torch.ones_like(mixup.lam), mixup.lam),
        )  # fmt: skip
        return ElemSwitchParams(
            partner=pairs.partner, applied=pairs.applied, image_size=(hh, ww), cut=cut, mixup=mixup, cutmix=cutmix
        )

    def check_params(self, params: object) -> None:
        if not isinstance(params, ElemSwitchParams):
            raise TypeError(
                f"ElemSwitch mixes with ElemSwitchParams, got {type(params).__name__}; replay params that this "
                "mixer sampled (mixer.sample(images.shape) or mixer.last_params)"
            )

    def params_batch_size(self, params: ElemSwitchParams) -> tuple[int, tuple[int, int]]:
        return params.batch_size, params.image_size

    def apply_images(self, images: Tensor, params: ElemSwitchParams) -> Tensor:
        """Blend the MixUp samples, then paste the CutMix samples' boxes from the un-mixed partners; pure."""
        blended = mix_images(images, params.partner, params.mixup.source_weight())  # a box sample keeps weight 1
        keep = ~box_inside(params.cutmix.boxes.to(images.device), params.cutmix.grid)  # b H W
        other = images.index_select(0, params.partner.to(images.device))
        return torch.where(rearrange(keep, "b h w -> b 1 h w"), blended, other)

    def label_map_from(self, params: ElemSwitchParams, labels: Tensor) -> TokenLabelMap:
        return pair_label_map(params, labels, self.num_classes, self.label_smoothing)
